"""Pipelines (issue 43): placement from given costs, frame order, deadlines
dropped at the earliest stage and counted, bad input refused with nothing
lost. Small models on the reference device; what is asserted is what the
pipeline decides, never a time."""
import time

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, Stage, Step
from nnrt.drivers.reference import ReferenceDevice
from nnrt.runtime.pipeline import place, simulate


def add_constant(k: float, n: int = 4) -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, n])
    c = m.add_operand(T.TENSOR_FLOAT32, [1, n])
    m.set_operand_value(c, np.full((1, n), k, np.float32))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, n])
    m.add_operation(Op.ADD, [a, c, act], [out])
    m.identify_inputs_and_outputs([a], [out])
    return m.finish()


# -- placement --------------------------------------------------------------------

FACE = ["detect", "box", "landmarks", "segment"]
FACE_NEEDS = {"detect": set(), "box": {"detect"}, "landmarks": {"box"}, "segment": set()}


def test_the_issues_split_detection_then_landmarks_beside_segmentation():
    """The issue's measured costs (ms): segmentation alone on one lane is
    the split with the least busy busiest lane."""
    costs = {"detect": 1.0, "box": 0.05, "landmarks": 2.0, "segment": 4.5}
    assert place(FACE, FACE_NEEDS, costs, 2) == (("detect", "box", "landmarks"), ("segment",))


def test_placement_cuts_a_chain_when_that_balances_the_lanes():
    """When segmentation is cheap, the chain is cut instead: the detector
    beside segmentation, box and landmarks on the other lane -- frames
    overlap, so a frame every 4 (against 6 keeping the chain whole)."""
    costs = {"detect": 2.0, "box": 0.5, "landmarks": 3.5, "segment": 2.0}
    lanes = place(FACE, FACE_NEEDS, costs, 2)
    assert lanes == (("detect", "segment"), ("box", "landmarks"))
    lane_of = {s: k for k, lane in enumerate(lanes) for s in lane}
    assert simulate(FACE, FACE_NEEDS, costs, lane_of)[0] == 4.0
    whole = {"detect": 0, "box": 0, "landmarks": 0, "segment": 1}
    assert simulate(FACE, FACE_NEEDS, costs, whole)[0] == 6.0


def test_the_simulation_sees_a_stage_waiting_behind_the_other_lanes_work():
    """Splitting detect+landmarks from box+segmentation loads each lane 4 per
    frame, but a lane runs its stages in frame order: box waits behind the
    previous frame's segmentation and stalls the landmarks, a frame every 5,
    no better than keeping the chain whole, whose frames are shorter."""
    costs = {"detect": 2.0, "box": 1.0, "landmarks": 2.0, "segment": 3.0}
    stalled = {"detect": 0, "box": 1, "landmarks": 0, "segment": 1}
    whole = {"detect": 0, "box": 0, "landmarks": 0, "segment": 1}
    assert simulate(FACE, FACE_NEEDS, costs, stalled) == (5.0, 11.0)
    assert simulate(FACE, FACE_NEEDS, costs, whole) == (5.0, 10.0)
    assert place(FACE, FACE_NEEDS, costs, 2) == (("detect", "box", "landmarks"), ("segment",))


def test_ties_go_to_the_shorter_frame_then_to_fewer_lanes():
    # A chain of two: one lane or two give a frame every 2 and frames of 2;
    # one lane (no hand-over) wins.
    assert place(["a", "b"], {"a": set(), "b": {"a"}}, {"a": 2.0, "b": 0.0}, 2) == (("a", "b"),)
    assert place(["a"], {"a": set()}, {"a": 1.0}, 4) == (("a",),)
    # in_flight=1: no overlap, so the period is a whole frame's time.
    lane_of = {"detect": 0, "box": 0, "landmarks": 0, "segment": 1}
    costs = {"detect": 1.0, "box": 0.05, "landmarks": 2.0, "segment": 4.5}
    assert simulate(FACE, FACE_NEEDS, costs, lane_of, in_flight=1) == (4.5, 4.5)


# -- running --------------------------------------------------------------------------

@pytest.fixture
async def rt():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as runtime:
        yield runtime


async def _chain(rt):
    """frame -> a (+1) -> double (x2, Python) -> b (+10); frame -> c (+100)."""
    a, b, c = [await rt.compile(add_constant(k)) for k in (1, 10, 100)]
    return a, b, c, [Stage("a", a), Step("double", lambda x: x * 2, ["a"], [((1, 4), np.float32)]),
                     Stage("b", b, ["double"]), Stage("c", c)]


async def test_frames_come_out_in_order_with_each_frames_own_outputs(rt):
    *_, stages = await _chain(rt)
    # Given costs: no warm frames; c alone on one lane, the chain on the other.
    costs = {"a": 1.0, "double": 1.0, "b": 1.0, "c": 2.5}
    async with rt.pipeline(stages, in_flight=3, costs=costs) as pipe:
        assert pipe.statistics().lanes == (("a", "double", "b"), ("c",))
        frames = [np.full((1, 4), i, np.float32) for i in range(12)]
        got = [r async for r in pipe.run(frames)]
    assert [r.index for r in got] == list(range(12))
    for i, r in enumerate(got):
        assert r.dropped_at is None
        np.testing.assert_array_equal(r.outputs["b:0"], np.full((1, 4), (i + 1) * 2 + 10))
        np.testing.assert_array_equal(r.outputs["c:0"], np.full((1, 4), i + 100))
    assert set(got[0].outputs) == {"b:0", "c:0"}   # what no stage reads
    stats = pipe.statistics()
    assert stats.frames == 12 and sum(stats.dropped.values()) == 0


async def test_without_costs_the_warm_frames_measure_them_and_place_the_stages(rt):
    *_, stages = await _chain(rt)
    async with rt.pipeline(stages, warmup=2) as pipe:
        assert pipe.statistics().lanes is None and "placed when warm" in repr(pipe)
        got = [r async for r in pipe.run([np.zeros((1, 4), np.float32)] * 5)]
        stats = pipe.statistics()
    assert [r.index for r in got] == [0, 1, 2, 3, 4]
    assert stats.lanes is not None and sorted(s for lane in stats.lanes for s in lane) == \
        sorted(["a", "double", "b", "c"])
    assert set(stats.stage_seconds) == {"a", "double", "b", "c"}


async def test_a_frame_that_cannot_make_its_deadline_is_dropped_at_its_first_stage(rt):
    a, b, c, stages = await _chain(rt)
    # b on the other lane costs 100 s by the estimate: the chain after a
    # cannot fit a 60 s deadline, so the frame is dropped at a, before
    # anything runs; c (another lane) also knows at its first stage.
    costs = {"a": 0.0, "double": 0.0, "b": 100.0, "c": 0.0}
    async with rt.pipeline(stages, costs=costs) as pipe:
        ran = {name: m.statistics().executions for name, m in (("a", a), ("b", b), ("c", c))}
        ticket = await pipe.submit(np.zeros((1, 4), np.float32), deadline=nnrt.deadline_in(s=60))
        result = await ticket.result()
        assert result.dropped_at in ("a", "c") and result.outputs == {}
        assert pipe.statistics().dropped[result.dropped_at] == 1
        assert sum(pipe.statistics().dropped.values()) == 1      # one frame, counted once
        assert {name: m.statistics().executions for name, m in
                (("a", a), ("b", b), ("c", c))} == ran            # nothing computed
        # A feasible deadline runs, and the next frame in the same slot is fine.
        pipe_ok = await pipe.submit(np.ones((1, 4), np.float32))
        assert (await pipe_ok.result()).dropped_at is None


async def test_a_deadline_already_past_drops_the_frame_and_the_pipeline_goes_on(rt):
    *_, stages = await _chain(rt)
    costs = {"a": 0.0, "double": 0.0, "b": 0.0, "c": 0.0}
    async with rt.pipeline(stages, costs=costs, in_flight=1) as pipe:
        late = await pipe.submit(np.zeros((1, 4), np.float32), deadline=time.monotonic() - 1)
        assert (await late.result()).dropped_at in ("a", "c")
        fine = await (await pipe.submit(np.ones((1, 4), np.float32))).result()
        np.testing.assert_array_equal(fine.outputs["c:0"], np.full((1, 4), 101))


async def test_bad_frames_and_failing_steps_are_clear_errors_and_lose_nothing(rt):
    a, b, c, _ = await _chain(rt)

    def fragile(x):
        if x[0, 0] == 2:                              # frame 1: 1 + 1
            raise ValueError("no face")
        return x[:, :2] if x[0, 0] == 8 else x        # a frame of 7: the wrong shape

    stages = [Stage("a", a), Step("check", fragile, ["a"], [((1, 4), np.float32)]),
              Stage("b", b, ["check"])]
    async with rt.pipeline(stages, costs={"a": 1.0, "check": 1.0, "b": 1.0}) as pipe:
        with pytest.raises(NnrtError) as e:
            await pipe.submit(np.zeros((1, 5), np.float32))
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT and "[1, 5]" in e.value.message
        tickets = [await pipe.submit(np.full((1, 4), i, np.float32)) for i in range(2)]
        assert (await tickets[0].result()).outputs["b:0"][0, 0] == 11
        with pytest.raises(NnrtError) as e:
            await tickets[1].result()
        assert e.value.status == ErrorStatus.GENERAL_FAILURE
        assert "'check'" in e.value.message and "ValueError: no face" in e.value.message
        with pytest.raises(NnrtError):
            await pipe.submit(np.zeros((1, 4), np.float64))      # another dtype
        with pytest.raises(NnrtError) as e:
            await (await pipe.submit(np.full((1, 4), 7, np.float32))).result()
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT and "declares" in e.value.message
        last = await (await pipe.submit(np.full((1, 4), 5, np.float32))).result()
        assert last.outputs["b:0"][0, 0] == 16


async def test_descriptions_that_cannot_work_are_refused_up_front(rt):
    a, b, *_ = await _chain(rt)
    cases = [
        ([Stage("a", a, ["later"]), Stage("later", b)], "not the frame or an earlier stage"),
        ([Stage("a", a), Stage("a", b)], "unique"),
        ([Stage("a", a, ["frame", "frame"])], "names 2 input(s)"),
        ([Stage("a", a), "b"], "neither a Stage nor a Step"),
        ([], "no stages"),
        ([Stage("a", "not a model")], "compiled by this runtime"),
        ([Stage("a", a), Step("s", len, ["a"], [((1, 4), "no such dtype")])], "(shape, dtype)"),
        ([Stage("a", a), Step("s", None, ["a"], [((1, 4), np.float32)])], "not callable"),
    ]
    for stages, words in cases:
        with pytest.raises(NnrtError) as e:
            rt.pipeline(stages)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT and words in e.value.message
    with pytest.raises(NnrtError, match="in_flight"):
        rt.pipeline([Stage("a", a)], in_flight=0)
    with pytest.raises(NnrtError, match="costs lack"):
        rt.pipeline([Stage("a", a), Stage("b", b, ["a"])], costs={"a": 1.0})
    with pytest.raises(NnrtError, match="no output named"):
        rt.pipeline([Stage("a", a)], outputs=["a:nothing"])


def test_a_review_moves_stages_only_for_a_tenth_shorter_period():
    from nnrt.runtime.pipeline import review
    now = (("detect", "box", "landmarks"), ("segment",))
    # Segmentation got cheap: cutting the chain gives a frame every 4, not 6.
    cheap = {"detect": 2.0, "box": 0.5, "landmarks": 3.5, "segment": 2.0}
    assert review(FACE, FACE_NEEDS, cheap, now, 2) == (("detect", "segment"), ("box", "landmarks"))
    # The costs the lanes were placed for: nothing to gain.
    costs = {"detect": 1.0, "box": 0.05, "landmarks": 2.0, "segment": 4.5}
    assert review(FACE, FACE_NEEDS, costs, now, 2) is None
    # A better placement by less than a tenth is not worth a switch.
    close = {"detect": 0.5, "box": 0.1, "landmarks": 3.0, "segment": 3.0}   # 3.6 -> 3.5
    better = place(FACE, FACE_NEEDS, close, 2)
    assert better != now and review(FACE, FACE_NEEDS, close, now, 2) is None


async def test_lanes_placed_again_keep_every_frame_in_order(rt, monkeypatch):
    """Given costs that the measured ones overturn: at a review the lanes
    change hands at a frame boundary, and no frame is lost or reordered."""
    from nnrt.runtime import pipeline
    monkeypatch.setattr(pipeline, "REVIEW", 4)
    *_, stages = await _chain(rt)
    # 'c' costs 1000 s by the given costs: alone on a lane. Measured, every
    # stage takes well under a second, so two lanes of two stages each win.
    costs = {"a": 1.0, "double": 1.0, "b": 1.0, "c": 1000.0}
    monkeypatch.setattr(pipeline, "review",
                        lambda *args: (("a", "double"), ("b", "c")))
    async with rt.pipeline(stages, costs=costs) as pipe:
        assert pipe.statistics().lanes == (("a", "double", "b"), ("c",))
        frames = [np.full((1, 4), i, np.float32) for i in range(20)]
        got = [r async for r in pipe.run(frames)]
        stats = pipe.statistics()
    assert stats.replaced >= 1 and stats.lanes == (("a", "double"), ("b", "c"))
    assert [r.index for r in got] == list(range(20))
    for i, r in enumerate(got):
        np.testing.assert_array_equal(r.outputs["b:0"], np.full((1, 4), (i + 1) * 2 + 10))
        np.testing.assert_array_equal(r.outputs["c:0"], np.full((1, 4), i + 100))


async def test_submit_nowait_refuses_a_frame_while_the_pipeline_is_full(rt):
    """A live camera drops the frame instead of falling behind."""
    import threading
    import anyio
    a, *_ = await _chain(rt)
    release = threading.Event()

    def held(x):
        assert release.wait(timeout=30), "the test never released the step"
        return x

    stages = [Stage("a", a), Step("held", held, ["a"], [((1, 4), np.float32)])]
    async with rt.pipeline(stages, in_flight=1, costs={"a": 0.0, "held": 0.0}) as pipe:
        first = pipe.submit_nowait(np.zeros((1, 4), np.float32))
        with pytest.raises(anyio.WouldBlock):                  # held in its step
            pipe.submit_nowait(np.ones((1, 4), np.float32))
        release.set()
        assert (await first.result()).outputs["held:0"][0, 0] == 1
        second = pipe.submit_nowait(np.full((1, 4), 2, np.float32))
        assert (second.index, (await second.result()).outputs["held:0"][0, 0]) == (1, 3)
