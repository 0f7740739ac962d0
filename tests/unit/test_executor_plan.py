"""The reference driver's prepared request path (issue 16): the request
validator remembers the last valid layout, and every check still applies to
a request whose layout changed; the request plan reads and writes exactly
what nnrt.hal.request does."""
from __future__ import annotations

import numpy as np
import pytest

import nnrt
from nnrt import OperandType as T, OperationType as Op
from nnrt.drivers.reference import ReferenceDevice
from nnrt.errors import ErrorStatus, NnrtError
from nnrt.hal import Request, RequestArgument
from nnrt.hal.validate import RequestValidator, validate_request
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation

from .test_runtime import add_model_activation_input


def _add_model(dims=(1, 4)):
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    b = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


def _request(x, y, out, in_length=None, dims=()):
    pools = tuple(a.reshape(-1).view(np.uint8) for a in (x, y, out))
    ins = tuple(RequestArgument(False, DataLocation(k, 0, in_length or a.nbytes), dims)
                for k, a in enumerate((x, y)))
    return Request(ins, (RequestArgument(False, DataLocation(2, 0, out.nbytes)),), pools)


def _rows_model():
    """x + x for x of any number of rows of 4: the output's shape is open."""
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [0, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [0, 4])
    m.add_operation(Op.ADD, [a, a, act], [out])
    m.identify_inputs_and_outputs([a], [out])
    return m.finish().hal_model


def _prepared(model):
    import anyio
    return anyio.run(ReferenceDevice().prepare_model, model)


def test_same_layout_is_not_revalidated_but_a_new_one_is():
    model = _add_model()
    validator = RequestValidator(model)
    x, y, out = (np.ones((1, 4), np.float32) for _ in range(3))
    validator.check(_request(x, y, out))
    # Same layout, other arrays: passes (nothing about it changed).
    validator.check(_request(x * 2, y * 3, out.copy()))
    # Each change of layout is checked again, after a valid one was cached.
    with pytest.raises(NnrtError) as e:
        validator.check(_request(x, y, out, in_length=8))
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT and "needs 16 bytes" in e.value.message
    small = np.ones((1, 2), np.float32)       # a pool smaller than the region
    with pytest.raises(NnrtError, match="outside pool"):
        validator.check(Request(_request(x, y, out).inputs, _request(x, y, out).outputs,
                                (small.view(np.uint8).reshape(-1),
                                 y.view(np.uint8).reshape(-1), out.view(np.uint8).reshape(-1))))
    with pytest.raises(NnrtError, match="conflict"):
        validator.check(_request(x, y, out, dims=(2, 2)))
    # And the cached valid layout still passes afterwards.
    validator.check(_request(x, y, out))


def test_validator_agrees_with_validate_request_on_every_failure():
    model = _add_model()
    x, y, out = (np.ones((1, 4), np.float32) for _ in range(3))
    good = _request(x, y, out)
    bad = [
        _request(x, y, out, in_length=12),
        _request(x, y, out, dims=(1, 5)),
        Request(good.inputs[:1], good.outputs, good.pools),
        Request(good.inputs, (RequestArgument(True),), good.pools),
        Request(good.inputs, (RequestArgument(False, DataLocation(7, 0, 16)),), good.pools),
    ]
    validator = RequestValidator(model)
    for request in bad:
        validator.check(good)                 # a valid layout is cached each time
        with pytest.raises(NnrtError) as direct:
            validate_request(model, request)
        with pytest.raises(NnrtError) as cached:
            validator.check(request)
        assert cached.value.message == direct.value.message


def test_reference_driver_repeated_executions_follow_each_request():
    prepared = _prepared(_add_model())
    out = np.zeros((1, 4), np.float32)
    for k in range(5):
        x = np.full((1, 4), k, np.float32)
        y = np.arange(4, dtype=np.float32).reshape(1, 4)
        result = prepared.execute_synchronously(_request(x, y, out))
        assert result.status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, x + y)
        assert result.output_shapes[0].dimensions == (1, 4)
    # A request whose layout changed is refused even after many good ones.
    bad = prepared.execute_synchronously(_request(x, y, out, in_length=4))
    assert bad.status == ErrorStatus.INVALID_ARGUMENT
    # A read-only output pool with a known layout is still refused.
    frozen = out.copy()
    req = _request(x, y, frozen)
    ro = Request(req.inputs, req.outputs, (*req.pools[:2], bytes(16)))
    assert prepared.execute_synchronously(ro).status == ErrorStatus.INVALID_ARGUMENT


def test_reference_driver_reads_and_writes_at_offsets_in_a_memory():
    prepared = _prepared(_add_model())
    mem = Memory.create(4096)
    try:
        mem.array(np.float32, (1, 4), 64)[:] = [[1, 2, 3, 4]]
        mem.array(np.float32, (1, 4), 128)[:] = [[10, 20, 30, 40]]
        req = Request((RequestArgument(False, DataLocation(0, 64, 16)),
                       RequestArgument(False, DataLocation(0, 128, 16))),
                      (RequestArgument(False, DataLocation(0, 256, 32)),), (mem,))
        result = prepared.execute_synchronously(req)
        assert result.status == ErrorStatus.NONE
        np.testing.assert_array_equal(mem.array(np.float32, (1, 4), 256), [[11, 22, 33, 44]])
        # Bytes past the output's 16 are left alone.
        assert not mem.array(np.uint8, (16,), 272).any()
    finally:
        mem.close()


def test_output_too_small_reports_the_needed_shape():
    prepared = _prepared(_add_model())
    x = y = np.ones((1, 4), np.float32)
    out = np.zeros(2, np.float32)
    pools = tuple(a.reshape(-1).view(np.uint8) for a in (x, y, out))
    req = Request(tuple(RequestArgument(False, DataLocation(k, 0, 16)) for k in range(2)),
                  (RequestArgument(False, DataLocation(2, 0, 8)),), pools)
    result = prepared.execute_synchronously(req)
    assert result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    assert result.output_shapes[0].dimensions == (1, 4)
    assert not result.output_shapes[0].is_sufficient


def test_same_argument_objects_with_a_smaller_pool_are_checked_again():
    """The burst server passes the same argument tuples frame after frame;
    the pools behind them can still change size."""
    model = _add_model()
    validator = RequestValidator(model)
    x, y, out = (np.ones((1, 4), np.float32) for _ in range(3))
    good = _request(x, y, out)
    validator.check(good)
    validator.check(Request(good.inputs, good.outputs, good.pools))
    short = np.ones(2, np.float32).view(np.uint8)
    with pytest.raises(NnrtError, match="outside pool"):
        validator.check(Request(good.inputs, good.outputs, (short, *good.pools[1:])))


def _counting(monkeypatch, module, name):
    """Replace ``module.name`` with a wrapper that counts its calls."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_same_request_again_validates_nothing_and_binds_nothing(monkeypatch):
    """Issue 16: an execution like the last one reuses its binding; neither
    the model nor the request is validated again, and no view is made."""
    import nnrt.drivers.executor as executor
    import nnrt.drivers.reference as reference
    import nnrt.hal.validate as validate
    prepared = _prepared(_add_model())
    model_checks = _counting(monkeypatch, reference, "validate_model")
    request_checks = _counting(monkeypatch, validate, "_check_request")
    bindings = _counting(monkeypatch, executor, "Binding")
    x, y, out = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4), \
        np.zeros((1, 4), np.float32)
    request = _request(x, y, out)
    first = prepared.execute_synchronously(request)
    assert (len(model_checks), len(request_checks), len(bindings)) == (0, 1, 1)
    for k in range(3):
        x[:] = k                      # the pools are read anew at every execution
        again = prepared.execute_synchronously(request)
        assert again.status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, x + y)
    assert (len(model_checks), len(request_checks), len(bindings)) == (0, 1, 1)
    assert again.output_shapes == first.output_shapes
    # Equal arguments in new tuples over the same pools: still the binding.
    prepared.execute_synchronously(Request(tuple(request.inputs), tuple(request.outputs),
                                           tuple(request.pools)))
    assert len(bindings) == 1
    # Other pools of the same layout: bound again, not validated again.
    other = np.zeros((1, 4), np.float32)
    assert prepared.execute_synchronously(_request(x, y, other)).status == ErrorStatus.NONE
    np.testing.assert_array_equal(other, x + y)
    assert (len(request_checks), len(bindings)) == (1, 2)
    # A new layout is validated (and refused) without replacing the binding.
    assert prepared.execute_synchronously(_request(x, y, out, in_length=8)).status \
        == ErrorStatus.INVALID_ARGUMENT
    assert (len(request_checks), len(bindings)) == (2, 2)


def test_a_bound_memory_closed_since_is_refused():
    prepared = _prepared(_add_model())
    mem = Memory.create(4096)
    req = Request((RequestArgument(False, DataLocation(0, 0, 16)),
                   RequestArgument(False, DataLocation(0, 16, 16))),
                  (RequestArgument(False, DataLocation(0, 32, 16)),), (mem,))
    assert prepared.execute_synchronously(req).status == ErrorStatus.NONE
    mem.close()
    result = prepared.execute_synchronously(req)
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "closed" in result.message


def test_a_binding_keeps_no_memory_mapped():
    """The binding keeps the pools, not views into them: a Memory closed
    after an execution is unmapped at once (a burst's slots must be)."""
    import os
    prepared = _prepared(_add_model())
    probe = f"nnrt-binding-probe-{os.getpid()}"
    mem = Memory.create(4096, probe)
    req = Request((RequestArgument(False, DataLocation(0, 0, 16)),
                   RequestArgument(False, DataLocation(0, 16, 16))),
                  (RequestArgument(False, DataLocation(0, 32, 16)),), (mem.view(),))
    for _ in range(2):
        assert prepared.execute_synchronously(req).status == ErrorStatus.NONE
    with open("/proc/self/maps") as f:
        assert probe in f.read()
    del req
    mem.close()
    with open("/proc/self/maps") as f:
        assert probe not in f.read()


def test_a_scalar_input_is_read_at_every_execution_of_a_binding():
    prepared = _prepared(add_model_activation_input().hal_model)
    x = np.array([[-3, -1, 1, 3]], np.float32)
    y = np.zeros((1, 4), np.float32)
    activation = np.array([7, 0], np.int32)    # the scalar at byte 4 of an int32 pool
    result = np.zeros((1, 4), np.float32)
    pools = (x, y, activation, result)          # pools of any element type: bytes count
    request = Request((RequestArgument(False, DataLocation(0, 0, 16)),
                       RequestArgument(False, DataLocation(1, 0, 16)),
                       RequestArgument(False, DataLocation(2, 4, 4))),
                      (RequestArgument(False, DataLocation(3, 0, 16)),), pools)
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    np.testing.assert_array_equal(result, x)
    activation[1] = 3                     # RELU6 ... then RELU1
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    np.testing.assert_array_equal(result, [[0, 0, 1, 3]])
    activation[1] = 2
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    np.testing.assert_array_equal(result, [[-1, -1, 1, 1]])


def test_an_output_of_another_shape_than_declared_is_written_and_reported():
    """An output whose operand leaves its shape open: the binding has no
    declared shape to reuse, the executor's shape is reported and written."""
    prepared = _prepared(_rows_model())
    result = np.zeros(12, np.float32)
    for rows in (2, 3, 2):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        request = Request((RequestArgument(False, DataLocation(0, 0, x.nbytes), (rows, 4)),),
                          (RequestArgument(False, DataLocation(1, 0, result.nbytes)),),
                          (x.reshape(-1).view(np.uint8), result.view(np.uint8)))
        got = prepared.execute_synchronously(request)
        assert got.status == ErrorStatus.NONE
        assert got.output_shapes[0].dimensions == (rows, 4) and got.output_shapes[0].is_sufficient
        np.testing.assert_array_equal(result[:rows * 4].reshape(rows, 4), 2 * x)


def test_a_bound_pool_resized_since_is_checked_again():
    """A bytearray can shrink between two executions of one request."""
    prepared = _prepared(_add_model())
    pool = bytearray(48)
    req = Request((RequestArgument(False, DataLocation(0, 0, 16)),
                   RequestArgument(False, DataLocation(0, 16, 16))),
                  (RequestArgument(False, DataLocation(0, 32, 16)),), (pool,))
    assert prepared.execute_synchronously(req).status == ErrorStatus.NONE
    del pool[40:]
    result = prepared.execute_synchronously(req)
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "outside pool" in result.message
    pool.extend(bytes(8))
    assert prepared.execute_synchronously(req).status == ErrorStatus.NONE


def test_new_output_arrays_keep_the_layout_and_never_receive_another_calls_result(monkeypatch):
    """Issue 16: the runtime hands the driver fresh output arrays at every
    execution, with the same argument tuples. The layout is resolved once;
    each execution writes only its own output, and an earlier output is
    never written again."""
    import nnrt.drivers.executor as executor
    import nnrt.hal.validate as validate
    prepared = _prepared(_add_model())
    request_checks = _counting(monkeypatch, validate, "_check_request")
    layouts = _counting(monkeypatch, executor, "_Layout")
    x, y = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    template = _request(x, y, np.zeros((1, 4), np.float32))
    outs = []
    for k in range(4):
        x[:] = k
        out = np.full((1, 4), -1, np.float32)
        result = prepared.execute_synchronously(
            Request(template.inputs, template.outputs, (x, y, out)))
        assert result.status == ErrorStatus.NONE
        outs.append(out)
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out, k + y)
    assert (len(request_checks), len(layouts)) == (1, 1)
    # The binding holds the last request's pools only.
    assert prepared._plan._last._pools[2] is outs[-1]


def test_a_binding_moves_to_new_arrays_of_its_sizes_and_reads_the_new_inputs(monkeypatch):
    """Issue 16: the very argument tuples over new numpy pools of the sizes
    of the last ones move the binding without the validator; a new input
    array is read, not the old one's view; a pool of another size or kind
    goes through the validator again."""
    import nnrt.hal.validate as validate
    prepared = _prepared(_add_model())
    sizes = _counting(monkeypatch, validate, "pool_sizes")
    x, y = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    template = _request(x, y, np.zeros((1, 4), np.float32))
    inputs, outputs = template.inputs, template.outputs
    assert prepared.execute_synchronously(template).status == ErrorStatus.NONE
    assert len(sizes) == 1
    first = prepared._plan._last
    for k in range(3):
        x2, out = np.full((1, 4), k, np.float32), np.zeros((1, 4), np.float32)
        assert prepared.execute_synchronously(
            Request(inputs, outputs, (x2, y, out))).status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, x2 + y)
    assert len(sizes) == 1 and prepared._plan._last.layout is first.layout
    # The same input arrays: their views are the binding's, kept.
    bound = prepared._plan._last
    out = np.zeros((1, 4), np.float32)
    prepared.execute_synchronously(Request(inputs, outputs, (bound._pools[0], y, out)))
    assert prepared._plan._last._start is bound._start
    np.testing.assert_array_equal(out, bound._pools[0] + y)
    # Another size (bigger: valid), a bytearray, a non-contiguous array (not
    # a pool: refused as such, not a driver failure): the validator sees each.
    for pool, status in ((np.zeros((1, 8), np.float32), ErrorStatus.NONE),
                         (bytearray(16), ErrorStatus.NONE),
                         (np.zeros((1, 8), np.float32)[:, ::2], ErrorStatus.INVALID_ARGUMENT)):
        result = prepared.execute_synchronously(Request(inputs, outputs, (x, y, pool)))
        assert result.status == status, result
    assert "pool 2 is not a contiguous buffer" in result.message
    assert len(sizes) == 4
    # Equal arguments in other tuples: validated (the validator's fast path
    # recognises only its own tuples by identity).
    assert prepared.execute_synchronously(_request(x, y, out)).status == ErrorStatus.NONE
    np.testing.assert_array_equal(out, x + y)
    assert len(sizes) == 5


def test_a_new_shape_after_a_bound_layout_is_validated_and_resolved_again(monkeypatch):
    import nnrt.drivers.executor as executor
    import nnrt.hal.validate as validate
    prepared = _prepared(_rows_model())
    request_checks = _counting(monkeypatch, validate, "_check_request")
    layouts = _counting(monkeypatch, executor, "_Layout")

    def run(rows, result_rows=None):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        result = np.zeros((result_rows or rows, 4), np.float32)
        got = prepared.execute_synchronously(Request(
            (RequestArgument(False, DataLocation(0, 0, x.nbytes), (rows, 4)),),
            (RequestArgument(False, DataLocation(1, 0, result.nbytes), (rows, 4)),),
            (x, result)))
        return got, x, result
    for rows, checks in ((2, 1), (2, 1), (3, 2), (3, 2)):
        got, x, result = run(rows)
        assert got.status == ErrorStatus.NONE
        np.testing.assert_array_equal(result, 2 * x)
        assert (len(request_checks), len(layouts)) == (checks, checks)
    # An output region too small for the dimensions: the needed shape is reported.
    got, _, result = run(3, result_rows=2)
    assert got.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    assert got.output_shapes[0].dimensions == (3, 4) and not got.output_shapes[0].is_sufficient
    assert not result.any()


def test_a_bad_pool_after_a_good_one_with_the_same_arguments_is_refused():
    """The layout is kept across pools; what a pool brings (its size, whether
    it is writable) is checked for every new pool."""
    prepared = _prepared(_add_model())
    x, y = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    good = _request(x, y, np.zeros((1, 4), np.float32))
    assert prepared.execute_synchronously(good).status == ErrorStatus.NONE
    short = np.zeros(2, np.float32)
    result = prepared.execute_synchronously(Request(good.inputs, good.outputs, (x, y, short)))
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "outside pool" in result.message
    frozen = np.zeros((1, 4), np.float32)
    frozen.flags.writeable = False
    result = prepared.execute_synchronously(Request(good.inputs, good.outputs, (x, y, frozen)))
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "read-only" in result.message
    assert not frozen.any()
    out = np.zeros((1, 4), np.float32)
    assert prepared.execute_synchronously(
        Request(good.inputs, good.outputs, (x, y, out))).status == ErrorStatus.NONE
    np.testing.assert_array_equal(out, x + y)


def test_an_output_is_written_where_its_region_lies_in_any_numpy_pool():
    """An output whose region is the whole of a numpy pool of its shape and
    element type is written through the pool; any other numpy pool (another
    shape, element type, offset) gets the same bytes where the region says."""
    prepared = _prepared(_add_model())
    x, y = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    good = _request(x, y, np.zeros((1, 4), np.float32))
    expected = (x + y).reshape(-1)
    for pool, offset in [(np.zeros((1, 4), np.float32), 0), (np.zeros(4, np.float32), 0),
                         (np.zeros((2, 4), np.float32), 16), (np.zeros(2, np.float64), 0),
                         (np.zeros(24, np.uint8), 8)]:
        out = (RequestArgument(False, DataLocation(2, offset, 16)),)
        result = prepared.execute_synchronously(Request(good.inputs, out, (x, y, pool)))
        assert result.status == ErrorStatus.NONE, pool
        written = pool.reshape(-1).view(np.uint8)[offset:offset + 16].view(np.float32)
        np.testing.assert_array_equal(written, expected)
        assert not pool.reshape(-1).view(np.uint8)[:offset].any()
        assert not pool.reshape(-1).view(np.uint8)[offset + 16:].any()


def test_the_same_request_again_writes_each_result_and_sees_a_pool_made_read_only():
    """A request served again writes through the views its binding made, and
    still refuses a pool that became read-only since (a view made before
    keeps the flag it had then)."""
    prepared = _prepared(_add_model())
    x, y = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    out = np.zeros((1, 4), np.float32)
    req = _request(x, y, out)
    for k in range(3):
        x[...] = k
        assert prepared.execute_synchronously(req).status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, x + y)
    req.pools[2].flags.writeable = False
    x[...] = 7
    result = prepared.execute_synchronously(req)
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "read-only" in result.message
    np.testing.assert_array_equal(out, np.full((1, 4), 2, np.float32) + y)


def test_an_execution_ignores_the_calling_threads_fp_error_state():
    """Kernels give IEEE results (inf) whatever np.seterr the calling thread
    set -- an inline run executes on the app's thread -- and the caller's
    state is left as it was."""
    import warnings
    prepared = _prepared(_add_model())
    big = np.full((1, 4), np.finfo(np.float32).max, np.float32)
    out = np.zeros((1, 4), np.float32)
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepared.execute_synchronously(_request(big, big, out)).status == ErrorStatus.NONE
        assert np.geterr()["over"] == "raise"
    assert np.isinf(out).all()


def _constants_model():
    """((x + c) * c) + y with c a constant read by two operations, and a
    WHILE-free chain: every operation reads a fixed Arg made once per plan."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    y = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    c = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.set_operand_value(c, np.array([[0.5, -2, 3, 0]], np.float32))
    acts = []
    for value in (0, 0, 2):                  # NONE, NONE, RELU1
        act = m.add_operand(T.INT32)
        m.set_operand_value(act, value)
        acts.append(act)
    t1, t2, out = (m.add_operand(T.TENSOR_FLOAT32, [1, 4]) for _ in range(3))
    m.add_operation(Op.ADD, [x, c, acts[0]], [t1])
    m.add_operation(Op.MUL, [t1, c, acts[1]], [t2])
    m.add_operation(Op.ADD, [t2, y, acts[2]], [out])
    m.identify_inputs_and_outputs([x, y], [out])
    return m.finish().hal_model


def test_a_plan_reused_by_many_executions_computes_what_a_fresh_one_does():
    """One prepared model, one request object run again and again over pools
    whose contents change: each result equals a freshly prepared model's,
    and the constants' shared Args are left as they were made."""
    model = _constants_model()
    prepared = _prepared(model)
    x, y, out = (np.zeros((1, 4), np.float32) for _ in range(3))
    request = _request(x, y, out)
    rng = np.random.default_rng(16)
    fixed = [step.args for step in prepared.executor.main.steps]
    for _ in range(6):
        x[:] = rng.normal(size=(1, 4))
        y[:] = rng.normal(size=(1, 4))
        assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
        fresh_out = np.zeros((1, 4), np.float32)
        assert _prepared(model).execute_synchronously(
            _request(x.copy(), y.copy(), fresh_out)).status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, fresh_out)
        c = np.array([[0.5, -2, 3, 0]], np.float32)
        np.testing.assert_array_equal(out, np.clip((x + c) * c + y, -1, 1))
    assert [step.args for step in prepared.executor.main.steps] == fixed
    assert prepared._plan._last.serves(request)


def test_a_request_of_lists_is_not_recognised_by_identity():
    """A request whose arguments are in lists can change under the same
    object: it is compared and validated again at each execution."""
    prepared = _prepared(_add_model())
    x, y, out = np.ones((1, 4), np.float32), np.full((1, 4), 2, np.float32), \
        np.zeros((1, 4), np.float32)
    good = _request(x, y, out)
    inputs = list(good.inputs)
    request = Request(inputs, good.outputs, good.pools)
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    np.testing.assert_array_equal(out, x + y)
    inputs[1] = RequestArgument(False, DataLocation(1, 0, 8))    # too short for [1, 4]
    result = prepared.execute_synchronously(request)
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "needs 16 bytes" in result.message
    inputs[1] = good.inputs[1]
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE


def test_a_request_naming_a_driver_buffer_goes_through_the_registry_every_time():
    """Once a plain request is bound, a request naming a buffer by token --
    the same object at every execution -- is still bound by the registry:
    its output is kept in the buffer and read back as the next input."""
    import anyio
    from nnrt.hal import BufferDesc, BufferRole
    from nnrt.memory import DeviceToken

    async def main():
        device = ReferenceDevice()
        prepared = await device.prepare_model(_add_model())
        buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                              [BufferRole(0, 0)])
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        out = np.zeros((1, 4), np.float32)
        assert prepared.execute_synchronously(_request(x, x, out)).status == ErrorStatus.NONE
        with Memory.create(16) as mem:
            mem.array(np.float32, (1, 4))[:] = 0
            await buffer.copy_from(mem, (1, 4))
            # state = state + x, in the buffer
            request = Request((RequestArgument(False, DataLocation(0, 0, 0)),
                               RequestArgument(False, DataLocation(1, 0, 16))),
                              (RequestArgument(False, DataLocation(0, 0, 0)),),
                              (DeviceToken(token), x.reshape(-1).view(np.uint8)))
            for _ in range(3):
                result = prepared.execute_synchronously(request)
                assert result.status == ErrorStatus.NONE, result.message
            await buffer.copy_to(mem)
            np.testing.assert_array_equal(mem.array(np.float32, (1, 4)), 3 * x)
    anyio.run(main)
