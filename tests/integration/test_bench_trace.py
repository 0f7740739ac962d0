"""Traces: a burst camera loop with a LOW flood on a driver service, traced
with NNRT_TRACE semantics (trace.start), gives one Chrome trace-event JSON
file holding the app's and the service's events on one timeline, with the
preemptions of the LOW work."""
import json
import subprocess
import sys
import textwrap
from collections import Counter

from nnrt import trace

LOOP = textwrap.dedent("""
    import sys, time
    import anyio, numpy as np
    import nnrt
    from nnrt import trace
    from nnrt.demo import BACKGROUND, FRAME, chain_model, detector_model

    async def main():
        async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid")],
                                discover=False) as rt:
            high = await rt.compile(detector_model(), priority=nnrt.Priority.HIGH, devices=["npu"])
            low = await rt.compile(chain_model(30, seed=2), priority=nnrt.Priority.LOW,
                                   devices=["npu"])
            frame = np.zeros(FRAME, np.float32)
            x = np.zeros(BACKGROUND, np.float32)
            stop = time.monotonic() + 3.0
            async def flood():
                while time.monotonic() < stop:
                    await low.execute([x])
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(flood)
                async with high.burst() as burst:
                    while time.monotonic() < stop:
                        await burst.execute([frame])
                        await anyio.sleep(0.01)
            stats = await rt.statistics("npu")
            print("preempted", sum(c.preempted for c in stats.classes))

    trace.start(sys.argv[1])
    anyio.run(main)
    print("written", trace.stop())
""")


def validate_trace_events(doc) -> list[dict]:
    """Check ``doc`` against the trace-event format (JSON object form) for
    the phases nnrt writes; return the events."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    open_async = Counter()
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["name"], e
        assert e["ph"] in trace.PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and "name" in e["args"], e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
        if e["ph"] in ("b", "e"):
            assert "id" in e and "cat" in e, e
            open_async[(e["pid"], e["cat"], e["id"], e["name"])] += 1 if e["ph"] == "b" else -1
        if "args" in e:
            assert isinstance(e["args"], dict)
    assert all(v == 0 for v in open_async.values()), "an async span without its end"
    return doc["traceEvents"]


def test_a_burst_loop_with_a_low_flood_traces_both_processes_and_the_preemptions(tmp_path):
    path = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, "-c", LOOP, str(path)], capture_output=True, text=True,
                         timeout=180, check=True).stdout
    assert f"written {path}" in out
    events = validate_trace_events(json.loads(path.read_text()))
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert any(n.startswith("app") for n in names) and \
        any(n.startswith("driver service npu") for n in names), names
    by_pid = {}
    for e in events:
        by_pid.setdefault(e["pid"], set()).add(e["name"])
    app = next(p for p, n in by_pid.items() if "burst hand-off" in n)
    service = next(p for p, n in by_pid.items() if "burst serve" in n)
    assert app != service
    assert {"app: execute", "burst hand-off"} <= by_pid[app]
    assert {"scheduled run", "queue wait", "CONV_2D", "service: execute"} <= by_pid[service]
    preempted = [e for e in events if e["name"] == "preempted"]
    reported = int(out.split("preempted ")[1].split()[0])
    assert reported > 0 and len(preempted) == reported
    assert all(e["args"]["priority"] == "LOW" for e in preempted)
    # One timeline: each burst hand-off in the app encloses its serve in the service.
    serve = sorted(e["ts"] for e in events if e["name"] == "burst serve" and e["ph"] == "X")
    handoffs = sorted(e["ts"] for e in events if e["name"] == "burst hand-off" and e["ph"] == "b")
    ends = sorted(e["ts"] for e in events if e["name"] == "burst hand-off" and e["ph"] == "e")
    assert serve and all(any(b <= s <= f for b, f in zip(handoffs, ends)) for s in serve)
    assert not list(tmp_path.glob("*.part"))   # the fragments were merged


def test_trace_is_off_unless_asked_and_writes_a_valid_file(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    monkeypatch.delenv(trace.OWNER_ENV, raising=False)
    assert not trace.enabled()
    trace.instant("ignored")
    path = tmp_path / "t.json"
    trace.start(str(path))
    try:
        @trace.traced("work")
        def work():
            return 42
        assert work() == 42
        trace.interval("waited", 1.0, 1.5, app=("uid", 7))
    finally:
        written = trace.stop()
    assert written == str(path) and not trace.enabled()
    events = validate_trace_events(json.loads(path.read_text()))
    assert [e["name"] for e in events if e["ph"] == "X"] == ["work"]
    waited = [e for e in events if e["name"] == "waited"]
    assert [e["ts"] for e in waited] == [1.0e6, 1.5e6]
    assert "ignored" not in {e["name"] for e in events}
