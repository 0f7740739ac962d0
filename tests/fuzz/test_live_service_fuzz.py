"""The live-service fuzzer (tests/fuzz/live_service.py) against a real
`nnrt driver serve` process: a short run here (a few seconds); the long run
of issue 23 (100,000 frames, 10,000 hostile ring writes) with
NNRT_FUZZ_LONG=1. Either way: no crash, no hang (a normal client gets
correct results after every batch), the service stops cleanly on SIGTERM,
and its fd count and RSS come back within 10% of where they started."""
import os

import anyio
import pytest

from .live_service import LiveFuzzer, serve

LONG = os.environ.get("NNRT_FUZZ_LONG") == "1"
FRAMES, RING_WRITES = (100_000, 10_000) if LONG else (2_000, 200)


@pytest.mark.parametrize("seed", [int(os.environ.get("NNRT_FUZZ_SEED", "1"))])
def test_a_live_service_survives_hostile_apps(tmp_path, seed):
    path = str(tmp_path / "fuzzed.sock")
    proc = serve(path)
    try:
        fuzzer = LiveFuzzer(path, proc.pid, seed, str(tmp_path))
        f = anyio.run(lambda: fuzzer.run(FRAMES, RING_WRITES,
                                         alive=lambda: proc.poll() is None))
    finally:
        proc.terminate()
        code = proc.wait(30)
    print(f.line())
    assert (f.crashes, f.hangs) == (0, 0), f.line()
    assert f.frames >= FRAMES and f.ring_writes >= RING_WRITES
    assert f.witness_checks == f.batches + 1
    assert f.end_fds <= f.start_fds * 1.1, f.line()
    assert f.end_rss <= f.start_rss * 1.1, f.line()
    assert code == 0, "SIGTERM ends the service cleanly after the fuzzing"
