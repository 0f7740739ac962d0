"""nnrt.bench's pure parts: statistics, stages, accuracy, reference files,
/proc/stat parsing, per-app share and the report."""
import math
import re

import numpy as np
import pytest

from nnrt.bench import report
from nnrt.bench.machine import CpuTimes, LoadSample, MachineInfo, parse_proc_stat, shares
from nnrt.bench.results import ERROR, MISS, Case, Sample, ShareSeries, percentile, share_over_time
from nnrt.bench.runner import compare, reference_files
from nnrt.qos.scheduler import JobRecord
from nnrt.hal.types import Priority
from nnrt.errors import ErrorStatus


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile(values, 1.0) == 100 and percentile([], 0.5) is None


def test_case_statistics_count_misses_and_errors_apart_from_latencies():
    samples = [Sample(t=k, latency=0.010 * (k + 1), on_device=0.005, in_driver=0.007)
               for k in range(9)]
    samples += [Sample(9, 0.5, MISS), Sample(10, 0.001, ERROR)]
    s = Case("m", "d", "execute", samples=samples, wall=2.0).stats()
    assert (s.runs, s.ok, s.misses, s.errors) == (11, 9, 1, 1)
    assert s.p50 == pytest.approx(0.05) and s.max == pytest.approx(0.09)
    assert s.throughput == pytest.approx(4.5)          # successes per wall second
    # Stages: on device 5 ms, queue 2 ms, the rest of the median latency.
    assert s.stages["on device"] == pytest.approx(0.005)
    assert s.stages["queue + parked"] == pytest.approx(0.002)
    assert s.stages["app + transport"] == pytest.approx(0.050 - 0.007)


def test_stages_never_exceed_the_latency():
    # A driver that reports more than the app measured (clock skew) is clipped.
    cut = Sample(0, 0.001, on_device=0.002, in_driver=0.003).stages()
    assert cut == pytest.approx((0.0, 0.0, 0.001)) and sum(cut) == pytest.approx(0.001)
    assert Sample(0, 0.001).stages() is None


def test_accuracy_in_lsb_for_integers_and_relative_for_floats():
    q = compare([np.array([[10, 20, 30]], np.int8)], [np.array([[10, 22, 30]], np.int8)], "x")
    assert q.unit == "LSB" and q.max_diff == [2.0] and not q.within_tolerance
    assert q.top1_match
    f = compare([np.array([[1.0, 5.0002]], np.float32)], [np.array([[1.0, 5.0]], np.float32)], "x")
    assert f.within_tolerance and f.max_diff[0] == pytest.approx(2e-4, rel=1e-2)
    off = compare([np.array([[3.0, 1.0]], np.float32)], [np.array([[1.0, 3.0]], np.float32)], "x")
    assert not off.within_tolerance and off.top1_match is False
    bad = compare([np.zeros((2, 2))], [np.zeros((4,))], "x")
    assert bad.unit == "shape" and not bad.within_tolerance


def test_against_reference_kernels_no_further_than_xnnpack_is_within_tolerance():
    """LiteRT's XNNPACK outputs are 3 LSB from its reference kernels here: a
    device as far from them is not marked out of tolerance, one further is."""
    ref = [np.array([[10, 20, 30]], np.int8)]
    xnnpack = [np.array([[10, 23, 30]], np.int8)]
    assert compare([np.array([[10, 17, 30]], np.int8)], ref, "ref", beside=xnnpack
                   ).within_tolerance
    assert not compare([np.array([[10, 16, 30]], np.int8)], ref, "ref", beside=xnnpack
                       ).within_tolerance
    floats = [np.array([[1.0, 2.0]], np.float32)]
    near = compare([np.array([[1.0, 2.01]], np.float32)], floats, "ref",
                   beside=[np.array([[1.0, 1.985]], np.float32)])
    assert near.within_tolerance and not compare(
        [np.array([[1.0, 2.01]], np.float32)], floats, "ref").within_tolerance


def test_reference_files_beside_a_model(tmp_path):
    for name in ["m.tflite", "m.in0.npy", "m.out1.npy", "m.out0.npy", "m.ref_out0.npy",
                 "m.out10.npy", "c.tflite", "c.case1.in0.npy", "c.case0.in0.npy",
                 "c.case0.out0.npy"]:
        (tmp_path / name).write_bytes(b"")
    ins, outs = reference_files(str(tmp_path / "m.tflite"))
    assert [p.rsplit("/", 1)[1] for p in ins] == ["m.in0.npy"]
    assert [p.rsplit("/", 1)[1] for p in outs] == ["m.out0.npy", "m.out1.npy", "m.out10.npy"]
    ins, outs = reference_files(str(tmp_path / "c.tflite"))
    assert [p.rsplit("/", 1)[1] for p in ins + outs] == ["c.case0.in0.npy", "c.case0.out0.npy"]
    assert reference_files(str(tmp_path / "none.tflite")) == ([], [])


def test_proc_stat_busy_and_steal():
    before = parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    after = parse_proc_stat("cpu  200 0 100 850 50 0 0 50 0 0\n")
    assert before == CpuTimes(150, 850, 0)
    busy, steal = shares(before, after)
    assert busy == pytest.approx(150 / 250) and steal == pytest.approx(50 / 250)
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n")


def _job(app, start, end, ran):
    return JobRecord(app, Priority.LOW, "m", 1, start, start, end, ran, 0, 0.0,
                     ErrorStatus.NONE, "")


def test_share_over_time_splits_device_time_per_app_and_bin():
    jobs = [_job("a", 10.0, 11.0, 1.0), _job("b", 11.0, 11.5, 0.25)]
    s = share_over_time("npu", jobs, t0=10.0, names={"a": "app A"}, bin_seconds=0.5)
    assert s.times == [0.0, 0.5, 1.0]
    assert s.shares["app A"] == pytest.approx([1.0, 1.0, 0.0])
    assert s.shares["b"] == pytest.approx([0.0, 0.0, 0.5])   # ran half of its span


def _page():
    fast = Case("detector", "npu", "burst", deadline=0.033,
                samples=[Sample(k * 0.1, 0.002 + 0.0001 * k, on_device=0.001, in_driver=0.0015)
                         for k in range(20)] + [Sample(2.1, 0.04, MISS)], wall=2.0)
    slow = Case("background", "npu", "execute",
                samples=[Sample(k * 0.3, 0.4 + 0.01 * k) for k in range(7)], wall=2.0,
                error=None, preemptions=5)
    broken = Case("model", "litert", "execute", error="INVALID_ARGUMENT: no such op")
    machine = MachineInfo("cpu", 2, "3.11", "2.0", "6.1", (1.0, 1.0, 1.0), (3.0, 1.0, 1.0),
                          0.9, 0.05, [LoadSample(0.5, 2.5, 0.9, 0.05)])
    share = ShareSeries("npu", 0.5, [0.0, 0.5], {"app A": [0.5, 0.2], "app B": [0.3, 0.8]})
    return report.Page("t", cases=[fast, slow, broken], machine=machine, share=[share])


def test_the_report_is_one_offline_file_with_every_chart():
    doc = report.render(_page())
    assert doc.startswith("<!doctype html>") and doc.count("Plotly.newPlot") == 5
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?https?:", doc)
    assert doc.count("<script type=\"text/javascript\">/**") <= 1   # the library inlined once
    for title in ("Latency distribution", "Latency over time", "deadline 33.0 ms",
                  "1 deadline misses", "Where the time goes", "share of npu over time",
                  "The machine during the run", "INVALID_ARGUMENT: no such op"):
        assert title in doc, title


def test_latency_axes_are_logarithmic_with_plain_millisecond_ticks():
    ticks = report._log_ticks([2.0, 450.0])
    assert ticks["tickvals"][0] <= 2.0 and ticks["tickvals"][-1] >= 450.0
    assert ticks["ticktext"] == [f"{v:g}" for v in ticks["tickvals"]]   # "200", not "2"
    for v in ticks["tickvals"]:
        assert round(v / 10 ** math.floor(math.log10(v)), 6) in (1, 2, 5)
    assert report._log_ticks([]) == {}
