"""Giving freed heap back to the kernel after a peer leaves: many requests
while one is pending make one trim, and trims keep their interval however
often peers come and go (a connect/close loop must not buy a trim each)."""
import time

from nnrt.drivers import heap


def test_give_back_soon_coalesces_and_keeps_its_interval(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "give_back_freed_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(heap, "GIVE_BACK_INTERVAL", 0.1)
    monkeypatch.setattr(heap, "_given_back_at", 0.0)
    calls = 0
    deadline = time.monotonic() + 30          # a guard, not a timing
    while len(trims) < 3 and time.monotonic() < deadline:   # a peer leaving every ms
        heap.give_back_soon()
        calls += 1
        time.sleep(0.001)
    while heap._give_back_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not heap._give_back_pending and len(trims) >= 3
    # Sleeps never end early, so the interval is a lower bound whatever the
    # load; the calls in between were folded into those trims.
    assert all(b - a >= 0.1 for a, b in zip(trims, trims[1:]))
    assert calls > len(trims)
