"""`nnrt bench` end to end on a small model: every mode on the in-process
reference device and a spawned service, JSON samples, the report, the
accuracy against the LiteRT outputs beside the model, and deadlines."""
import json
import subprocess
import sys
from pathlib import Path

import nnrt.tflite

MODEL = str(Path(__file__).parents[1] / "data" / "tflite" / "float_chain.tflite")
OPERATIONS = len(nnrt.tflite.load(MODEL).hal_model.main.operations)


def _bench(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "nnrt", "bench", MODEL, "--no-discover", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_every_mode_on_two_devices_with_json_and_report(tmp_path):
    out = _bench("--spawn", "sample-float-fast", "--device", "sample-float-fast",
                 "--device", "nnrt-reference", "--mode", "execute,burst,fenced,sync",
                 "--runs", "8", "--warmup", "1", "--json", str(tmp_path / "b.json"),
                 "--report", str(tmp_path / "b.html"))
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    cases = {(c["device"], c["mode"]): c for c in doc["cases"]}
    assert set(cases) == {(d, m) for d in ("sample-float-fast", "nnrt-reference")
                          for m in ("execute", "burst", "fenced", "sync")}
    for (device, mode), c in cases.items():
        s = c["stats"]
        assert c["error"] is None and s["runs"] == 8 and s["ok"] == 8, (device, mode)
        assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
        assert sum(c["placement"].values()) == OPERATIONS
        if device == "nnrt-reference":
            assert c["placement"] == {device: OPERATIONS}
        else:   # the sample takes the float32 operations, the CPU the rest (NNAPI's fallback)
            assert set(c["placement"]) == {device, "nnrt-reference"}
            assert c["placement"][device] > c["placement"]["nnrt-reference"]
        against = {a["against"]: a for a in c["accuracy"]}
        assert against["LiteRT (.out*.npy)"]["within_tolerance"], c["accuracy"]
        if device != "nnrt-reference":
            assert against["reference device"]["max_diff"] == [0.0, 0.0, 0.0]
    # The service measured its timing: the stages are there and add up to the median-ish run.
    stages = cases[("sample-float-fast", "execute")]["stats"]["stages"]
    assert set(stages) == {"app + transport", "queue + parked", "on device"}
    assert stages["on device"] > 0 and stages["app + transport"] > 0
    assert doc["machine"]["cpus"] >= 1 and "load_start" in doc["machine"]
    html = (tmp_path / "b.html").read_text()
    assert "Latency over time" in html and "sample-float-fast" in html
    assert "float_chain" in out.stdout and "machine:" in out.stdout


def test_an_impossible_deadline_is_counted_as_misses(tmp_path):
    out = _bench("--device", "nnrt-reference", "--mode", "execute", "--runs", "5", "--warmup", "0",
                 "--deadline-ms", "0.001",
                 "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    [case] = json.loads((tmp_path / "b.json").read_text())["cases"]
    assert case["stats"]["misses"] == 5 and case["stats"]["ok"] == 0
    assert case["deadline"] == 1e-6


def test_an_unknown_mode_or_device_is_refused():
    out = _bench("--mode", "teleport")
    assert out.returncode == 1 and "teleport" in out.stderr
    out = _bench("--device", "nope")
    assert out.returncode == 1 and "nope" in out.stderr
