"""`make demo` (nnrt demo): the camera loop runs end to end with real
processes, prints its summary and writes a self-contained HTML report."""
import re
import subprocess
import sys


def test_camera_loop_demo_prints_a_summary_and_writes_a_report(tmp_path):
    report = tmp_path / "demo.html"
    out = subprocess.run([sys.executable, "-m", "nnrt", "demo", "--seconds", "2",
                          "--report", str(report)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "detector" in out and "background" in out and "competitor" in out
    assert "preemptions:" in out and "share of device time:" in out
    # Both apps' device time, though the second app has exited (and left the
    # service's statistics) when the demo sums it up.
    share = next(line for line in out.splitlines() if line.startswith("share of device time:"))
    assert "demo " in share and "app 2 " in share, share
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("detector", "background", "competitor")}
    detector = rows["detector"]
    assert int(detector[detector.index("HIGH") + 1]) > 0  # frames ran (the runs column)
    html = report.read_text()
    assert html.startswith("<!doctype html>")
    # The bench report's charts: latency over time with the deadline, the stages, the share.
    for title in ("Latency over time", "deadline 33.3 ms", "Where the time goes",
                  "share of cpu-service over time", "The machine during the run"):
        assert title in html, title
    # Self-contained: the plotting library is inlined, nothing is fetched.
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?https?:", html)
    assert "Plotly.newPlot" in html and len(html) > 1_000_000   # the library itself is inside


def test_pipeline_demo_runs_the_face_pipeline_and_matches_litert():
    """`nnrt demo --pipeline` (examples/face_pipeline.py): the face is found
    on every frame of the synthetic camera, and the checked frames match
    LiteRT run one model after another (the script exits 1 otherwise)."""
    done = subprocess.run([sys.executable, "-m", "nnrt", "demo", "--pipeline", "--frames", "6",
                           "--check", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "face found on 6;" in done.stdout
    assert "checked 2 frames against LiteRT" in done.stdout and "MISMATCH" not in done.stdout
