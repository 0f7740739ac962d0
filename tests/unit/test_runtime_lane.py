"""Issue 16: ``CompiledModel.execute`` runs an execution laid out as the last
one on the whole step's lane (``nnrt.runtime.step.Lane``) without the
general path's per-call work. Nothing an app can see may differ: each test
runs the same calls on a compiled model with its lane and on one without
(``_lane_steps`` always None: the general path only) and compares what they
gave."""
import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import DeviceType, ExecutionResult, OutputShape
from nnrt.runtime.runtime import CompiledModel

from .test_runtime import add_model, add_model_activation_input


class Npu(ReferenceDevice):
    """A non-CPU device on the reference kernels whose executions answer
    ``script``'s results first (one each), then run; and count."""

    type = DeviceType.ACCELERATOR

    def __init__(self, name="npu"):
        super().__init__(name)
        self.script: list[ExecutionResult] = []
        self.executions = 0

    async def prepare_model(self, model, *args, **kwargs):
        prepared = await super().prepare_model(model, *args, **kwargs)
        device = self

        class Scripted(type(prepared)):
            def execute_synchronously(self, request, *a, **k):
                device.executions += 1
                if device.script:
                    return device.script.pop(0)
                return super().execute_synchronously(request, *a, **k)
        prepared.__class__ = Scripted
        return prepared


def outcome(value):
    """What an app sees of a call: its result or its error."""
    if isinstance(value, NnrtError):
        return ("error", value.status, value.message, value.output_shapes, value.result_code)
    if isinstance(value, BaseException):
        return ("raised", type(value).__name__)
    return ("result", [np.asarray(o).tolist() for o in value.outputs],
            [np.asarray(o).dtype for o in value.outputs], value.output_shapes,
            value.timing is None)


async def run(compiled, inputs, **kw):
    """The outcome of ``compiled.execute`` (or a burst's) on ``inputs``."""
    try:
        return outcome(await compiled.execute(inputs, **kw))
    except Exception as e:   # noqa: BLE001 -- compared between the two paths
        return outcome(e)


class Counted:
    """Counts the calls of a compiled model's general path."""

    def __init__(self, compiled):
        self.calls = 0
        general = compiled._execute

        def counted(*a, **k):
            self.calls += 1
            return general(*a, **k)
        compiled._execute = counted


def dynamic_model() -> nnrt.Model:
    """The driver reports its output shapes afresh on every execution: no lane."""
    return add_model((0, 4))


MODELS = pytest.mark.parametrize("model_fn", [add_model, dynamic_model])


async def both(rt_devices, model_fn, scenario):
    """``scenario(compiled, device)`` on a compiled model with its lane and
    on one with the general path only, in runtimes of their own; the two
    lists of outcomes (and statistics) must be equal."""
    seen = []
    use_steps = CompiledModel._use_steps

    def general_only(self, steps):
        use_steps(self, steps)
        self._lane_steps = None
    for lane in (True, False):
        devices = rt_devices()
        if not lane:
            CompiledModel._use_steps = general_only
        try:
            async with nnrt.Runtime(devices=devices, discover=False) as rt:
                compiled = await rt.compile(model_fn())
                got = await scenario(compiled, devices[0])
                seen.append((got, compiled.statistics(), getattr(devices[0], "executions", None)))
        finally:
            CompiledModel._use_steps = use_steps
    (got, *counts), (expected, *expected_counts) = seen
    for k, (a, b) in enumerate(zip(got, expected)):
        assert a == b, f"call {k}"
    assert len(got) == len(expected) and counts == expected_counts
    return got


X = np.arange(4, dtype=np.float32).reshape(1, 4)
Y = np.ones((1, 4), np.float32)


async def test_the_lane_is_taken_once_a_layout_repeats():
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())
        general = Counted(compiled)
        results = [await compiled.execute([X, Y]) for _ in range(3)]
        assert compiled._steps[0].lane is not None
        before = general.calls
        results += [await compiled.execute((X, Y)) for _ in range(20)]
        assert general.calls == before
        for r in results:
            np.testing.assert_array_equal(r.outputs[0], X + Y)
            assert r.output_shapes == [(1, 4)] and r.timing is None
        assert len({id(r.outputs[0]) for r in results}) == len(results)
        assert len({id(r.output_shapes) for r in results}) == len(results)
        assert compiled.statistics().executions == 23


@MODELS
async def test_every_other_layout_and_mistake_is_the_general_paths(model_fn):
    x2 = np.arange(8, dtype=np.float32).reshape(2, 4)

    general_calls = []

    async def scenario(compiled, _device):
        general = Counted(compiled)
        got = [await run(compiled, [X, Y]) for _ in range(5)]
        general_calls.append(general.calls)
        got += [
            await run(compiled, [X, Y]),
            await run(compiled, [x2, x2]),                               # new shapes
            await run(compiled, [X, Y]),
            await run(compiled, [X.astype(np.float64), Y]),              # converted
            await run(compiled, [X.astype(np.int32), Y]),                # refused
            await run(compiled, [X.tolist(), Y]),
            await run(compiled, [np.asfortranarray(x2.T).T[:1], Y]),
            await run(compiled, [x2[:, ::2].copy().reshape(1, 4), Y]),
            await run(compiled, [x2[::2], Y]),                   # (contiguous: a 1-row slice)
            await run(compiled, [x2.reshape(1, 8)[:, ::2], Y]),          # not contiguous
            await run(compiled, [X]),                                    # count
            await run(compiled, [X, Y, Y]),
            await run(compiled, [X.reshape(4), Y]),                      # rank
            await run(compiled, [None, Y]),
            await run(compiled, X),                                      # a bare array
            await run(compiled, {"input1": Y, "input0": X}),
            await run(compiled, [X, Y], deadline=float("nan")),
            await run(compiled, [X, Y], deadline="soon"),
            await run(compiled, [X, Y], deadline=10**9),                 # an int: far away
            await run(compiled, [X, Y], deadline=1e12),
            await run(compiled, [X, Y], deadline=0.0),                   # missed
            await run(compiled, [X, Y], measure_timing=1),
            await run(compiled, [X, Y], measure_timing=True),
            await run(compiled, [X, Y]),
        ]
        got[-2] = got[-2][:4]   # timings differ
        return got

    got = await both(lambda: [ReferenceDevice()], model_fn, scenario)
    if model_fn is add_model:
        assert general_calls[0] < 5 == general_calls[1]   # the lane took the repeated calls
    assert got[-1][0] == "result" and got[8][0] == "result" and got[14][0] == "result"


@MODELS
async def test_outputs_given_by_the_app(model_fn):
    general_calls = []

    async def scenario(compiled, _device):
        out, other = np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)
        got = [await run(compiled, [X, Y])]
        for _ in range(4):
            out[...] = 0
            got.append(await run(compiled, [X, Y], outputs=[out]))
            got.append(out.tolist())
        general = Counted(compiled)
        got.append(await run(compiled, [X, Y], outputs=(other,)))
        general_calls.append(general.calls)
        r = await compiled.execute([X, Y], outputs=[out])
        got.append(r.outputs[0] is out)
        readonly = np.zeros((1, 4), np.float32)
        readonly.flags.writeable = False
        flat = np.zeros(8, np.float32)
        got += [
            await run(compiled, [X, Y], outputs=[X]),                    # overlaps an input
            await run(compiled, [X, Y], outputs=[readonly]),
            await run(compiled, [X, Y], outputs=[np.zeros((1, 4), np.float64)]),
            await run(compiled, [X, Y], outputs=[np.zeros((4, 1), np.float32)[::1].T]),
            await run(compiled, [X, Y], outputs=[flat]),                 # a view of it, shaped
            flat.tolist(),
            await run(compiled, [X, Y], outputs=[np.zeros(2, np.float32)]),   # too small
            await run(compiled, [X, Y], outputs=[out, other]),
            await run(compiled, [X, Y], outputs=out),
            await run(compiled, [X, Y]),                                 # made by the runtime
            await run(compiled, [X, Y], outputs=[out]),
        ]
        return got

    got = await both(lambda: [ReferenceDevice()], model_fn, scenario)
    if model_fn is add_model:   # outputs of the lane's shapes: the lane
        assert general_calls[0] == 0 < general_calls[1]
    assert got[10] is True
    assert got[11][0] == "error" and "overlaps input 0" in got[11][2]


@MODELS
async def test_a_driver_failure_after_many_fast_calls_falls_back_and_the_lane_follows(model_fn):
    async def scenario(compiled, device):
        got = [await run(compiled, [X, Y]) for _ in range(5)]
        device.script.append(ExecutionResult(ErrorStatus.GENERAL_FAILURE, message="the NPU hung"))
        got.append(await run(compiled, [X, Y]))
        got.append([d.name for d in compiled.devices])
        got += [await run(compiled, [X, Y]) for _ in range(4)]
        got.append(compiled._steps[0].lane is not None)
        got.append(compiled._lane_steps is compiled._steps or compiled._lane_steps is None)
        return got

    got = await both(lambda: [Npu(), ReferenceDevice()], model_fn, scenario)
    assert got[5] == got[0] and got[6] == ["nnrt-reference"]


@MODELS
async def test_failures_the_driver_reports_after_the_lane_is_set_up(model_fn):
    async def scenario(compiled, device):
        got = [await run(compiled, [X, Y]) for _ in range(5)]
        # Larger outputs needed (as a dynamic shape would): resized and retried.
        device.script.append(ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
                                             (OutputShape((1, 4), False),)))
        got.append(await run(compiled, [X, Y]))
        got += [await run(compiled, [X, Y]) for _ in range(3)]
        device.script.append(ExecutionResult(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                             message="late"))
        got.append(await run(compiled, [X, Y]))
        # Not a resize the app's own outputs could take: its error.
        device.script.append(ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
                                             (OutputShape((1, 4), False),)))
        got.append(await run(compiled, [X, Y], outputs=[np.zeros((1, 4), np.float32)]))
        # Other shapes reported for the same layout.
        device.script.append(ExecutionResult(ErrorStatus.NONE, (OutputShape((2, 2)),)))
        got.append((await run(compiled, [X, Y]))[3])   # (nothing was written)
        got += [await run(compiled, [X, Y]) for _ in range(3)]
        got.append([d.name for d in compiled.devices])
        return got

    got = await both(lambda: [Npu(), ReferenceDevice()], model_fn, scenario)
    assert got[5] == got[0] and got[9][1] == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert got[11] == [(2, 2)] and got[-1] == ["npu"]


@MODELS
async def test_a_cancelled_execution_counts_as_failed(model_fn):
    async def scenario(compiled, _device):
        got = [await run(compiled, [X, Y]) for _ in range(5)]
        with anyio.CancelScope() as scope:
            scope.cancel()
            await compiled.execute([X, Y])
        got.append(compiled.statistics().failures)
        got.append(await run(compiled, [X, Y]))
        return got

    got = await both(lambda: [ReferenceDevice()], model_fn, scenario)
    assert got[5] == 1 and got[6] == got[0]


@MODELS
async def test_closed_models_and_runtimes_are_refused_as_before(model_fn):
    async def scenario(compiled, _device):
        got = [await run(compiled, [X, Y]) for _ in range(5)]
        other = await compiled.runtime.compile(model_fn())
        got += [await run(other, [X, Y]) for _ in range(5)]
        other.close()
        got.append(await run(other, [X, Y]))
        await compiled.runtime.__aexit__(None, None, None)
        got.append(await run(compiled, [X, Y]))
        return got

    got = await both(lambda: [ReferenceDevice()], model_fn, scenario)
    assert got[-2][4] == got[-1][4] == nnrt.ResultCode.BAD_STATE
    assert got[-2][2] != got[-1][2]


@MODELS
async def test_steps_shared_with_bursts_and_concurrent_executions(model_fn):
    x2 = np.arange(8, dtype=np.float32).reshape(2, 4)

    async def scenario(compiled, _device):
        got = [await run(compiled, [X, Y]) for _ in range(5)]
        async with compiled.burst() as burst:
            got.append(await run(burst, [x2, x2]))
            got.append(await run(burst, [X, Y]))
            got.append(await run(burst, [X, Y]))
        got.append(await run(compiled, [X, Y]))
        results = {}

        async def one(k, x):
            results[k] = [await run(compiled, [x, x]) for _ in range(5)]
        async with anyio.create_task_group() as tg:
            for k, x in enumerate((X, x2, X)):
                tg.start_soon(one, k, x)
        got.append(sorted(results.items()))
        got.append(await run(compiled, [X, Y]))
        return got

    got = await both(lambda: [ReferenceDevice()], model_fn, scenario)
    assert got[-1] == got[0]


async def test_a_burst_takes_the_lane_once_a_layout_repeats():
    """A burst's frames are executions of the compiled model run by its
    sessions: laid out as the last, they skip the general path too."""
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())
        general = Counted(compiled)
        async with compiled.burst() as burst:
            results = [await burst.execute([X, Y]) for _ in range(3)]
            before = general.calls
            results += [await burst.execute((X, Y)) for _ in range(20)]
            assert general.calls == before
            assert burst.statistics().frames == 23
        for r in results:
            np.testing.assert_array_equal(r.outputs[0], X + Y)
            assert r.output_shapes == [(1, 4)] and r.timing is None
        assert len({id(r.outputs[0]) for r in results}) == len(results)
        assert compiled.statistics().executions == 23


@MODELS
async def test_a_bursts_frames_see_what_the_general_path_gives(model_fn):
    """Resizes, the app's own outputs, a driver failure that moves the model
    to the CPU mid-burst, refusals and a cancelled frame: the same outcomes,
    statistics and driver calls with the lane as without it."""
    async def scenario(compiled, device):
        got = []
        async with compiled.burst() as burst:
            got += [await run(burst, [X, Y]) for _ in range(5)]
            device.script.append(ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
                                                 (OutputShape((1, 4), False),)))
            got.append(await run(burst, [X, Y]))
            got.append(await run(burst, [X, Y], outputs=[np.zeros((1, 4), np.float32)]))
            got.append(await run(burst, [X, Y], outputs=[np.zeros((2, 4), np.float32)]))
            got.append(await run(burst, [X, Y], deadline=float("nan")))
            device.script.append(ExecutionResult(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                                 message="late"))
            got.append(await run(burst, [X, Y]))
            with anyio.CancelScope() as scope:
                scope.cancel()
                await burst.execute([X, Y])
            device.script.append(ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                                 message="the NPU hung"))
            got.append(await run(burst, [X, Y]))     # on the CPU from here, the burst goes on
            got.append([d.name for d in compiled.devices])
            got += [await run(burst, [X, Y]) for _ in range(3)]
            stats = burst.statistics()
            got.append((stats.frames, stats.failures, stats.fallbacks))
        return got

    got = await both(lambda: [Npu(), ReferenceDevice()], model_fn, scenario)
    assert got[5] == got[6] == got[7] == got[0] and got[10] == got[0]
    assert got[8][1] == ErrorStatus.INVALID_ARGUMENT
    assert got[9][1] == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    # Twelve frames ran; two failed (the deadline refused, the late one);
    # the frame cancelled before it started is neither.
    assert got[11] == ["nnrt-reference"] and got[-1] == (12, 2, 1)


async def test_no_lane_with_a_scalar_input():
    """A scalar input's array is staged reshaped: the step's layout is not
    the app's, so the general path takes every call."""
    m = add_model_activation_input()
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(m)
        assert compiled._whole_steps is compiled._steps and compiled._lane_steps is None
        for _ in range(3):
            r = await compiled.execute([X, Y, np.array(0, np.int32)])
            np.testing.assert_array_equal(r.outputs[0], X + Y)
        with pytest.raises(NnrtError, match="is a scalar INT32"):
            await compiled.execute([X, Y, np.zeros(1, np.int32)])


@pytest.mark.parametrize("trace_on", [False, True])
async def test_tracing_takes_the_general_path(tmp_path, trace_on):
    from nnrt import trace
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())
        for _ in range(3):
            await compiled.execute([X, Y])
        general = Counted(compiled)
        if trace_on:
            trace.start(str(tmp_path / "t.json"))
        try:
            await compiled.execute([X, Y])
        finally:
            if trace_on:
                trace.stop()
        assert general.calls == (1 if trace_on else 0)


async def test_a_step_drops_its_lane_whenever_it_learns_something_new():
    """A lane stands for the step's state when it was kept: another layout's
    request, another result object from the driver or a new guess of the
    output shapes drops it (and the general path keeps a new one)."""
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())

        async def lane_again():
            for _ in range(2):
                await compiled.execute([X, Y])
            assert step.lane is not None and step.lane.sized is step._sized

        step = compiled._steps[0]
        await lane_again()
        step.request([X, Y], [np.empty((2, 2), np.float32)])
        assert step.lane is None
        await lane_again()
        reported = step.lane.reported

        async def answer(request):
            return ExecutionResult(ErrorStatus.NONE, tuple(list(reported)))   # equal, not it
        result, outs = await step.run_inputs([X, Y], answer)
        assert result.output_shapes == reported and step.lane is None
        await lane_again()
        step.output_guess = [(1, 4)]
        assert step.lane is None
        await lane_again()
