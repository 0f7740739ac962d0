"""The reference driver's request path: a request is validated and bound
once (``create_execution``, a :class:`nnrt.drivers.executor.Binding`), and
each computation of the binding reads the pools as they are then and writes
exactly what nnrt.hal.request would; a one-shot execution binds for its one
run."""
from __future__ import annotations

import numpy as np
import pytest

import nnrt
from nnrt import OperandType as T, OperationType as Op
from nnrt.drivers.reference import ReferenceDevice
from nnrt.errors import ErrorStatus, NnrtError
from nnrt.hal import Request, RequestArgument
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


def _counting(monkeypatch, module, name):
    """Replace ``module.name`` with a wrapper that counts its calls."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_reusable_execution_validates_and_binds_once_and_reads_the_pools_each_time(
        monkeypatch):
    import nnrt.drivers.executor as executor
    import nnrt.hal.validate as validate
    prepared = _prepared(_add_model())
    request_checks = _counting(monkeypatch, validate, "_check_request")
    layouts = _counting(monkeypatch, executor, "_Layout")
    x, y, out = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4), \
        np.zeros((1, 4), np.float32)
    execution = prepared.create_execution(_request(x, y, out))
    for k in range(4):
        x[:] = k                      # the pools are read anew at every computation
        result = execution.execute_synchronously()
        assert result.status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, x + y)
        assert result.output_shapes[0].dimensions == (1, 4)
    assert (len(request_checks), len(layouts)) == (1, 1)
    # One-shot executions bind for each run.
    for _ in range(2):
        assert prepared.execute_synchronously(_request(x, y, out)).status == ErrorStatus.NONE
    assert (len(request_checks), len(layouts)) == (3, 3)
    # A request the model cannot run is refused when it is bound.
    with pytest.raises(NnrtError) as e:
        prepared.create_execution(_request(x, y, out, in_length=8))
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT and "needs 16 bytes" in e.value.message
    execution.release()
    assert execution.execute_synchronously().status == ErrorStatus.INVALID_ARGUMENT


def test_a_bound_memory_closed_since_is_refused():
    prepared = _prepared(_add_model())
    mem = Memory.create(4096)
    req = Request((RequestArgument(False, DataLocation(0, 0, 16)),
                   RequestArgument(False, DataLocation(0, 16, 16))),
                  (RequestArgument(False, DataLocation(0, 32, 16)),), (mem,))
    execution = prepared.create_execution(req)
    assert execution.execute_synchronously().status == ErrorStatus.NONE
    mem.close()
    result = execution.execute_synchronously()
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
    execution = prepared.create_execution(req)
    for _ in range(2):
        assert execution.execute_synchronously().status == ErrorStatus.NONE
    with open("/proc/self/maps") as f:
        assert probe in f.read()
    del req, execution
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
    execution = prepared.create_execution(request)
    assert execution.execute_synchronously().status == ErrorStatus.NONE
    np.testing.assert_array_equal(result, x)
    activation[1] = 3                     # RELU6 ... then RELU1
    assert execution.execute_synchronously().status == ErrorStatus.NONE
    np.testing.assert_array_equal(result, [[0, 0, 1, 3]])
    activation[1] = 2
    assert execution.execute_synchronously().status == ErrorStatus.NONE
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
    """A bytearray can shrink between two computations of one binding."""
    prepared = _prepared(_add_model())
    pool = bytearray(48)
    req = Request((RequestArgument(False, DataLocation(0, 0, 16)),
                   RequestArgument(False, DataLocation(0, 16, 16))),
                  (RequestArgument(False, DataLocation(0, 32, 16)),), (pool,))
    execution = prepared.create_execution(req)
    assert execution.execute_synchronously().status == ErrorStatus.NONE
    del pool[40:]
    result = execution.execute_synchronously()
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "changed size" in result.message
    pool.extend(bytes(8))
    assert execution.execute_synchronously().status == ErrorStatus.NONE


def test_each_shape_of_an_open_input_gets_its_result_and_its_shape():
    prepared = _prepared(_rows_model())

    def run(rows, result_rows=None):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        result = np.zeros((result_rows or rows, 4), np.float32)
        got = prepared.execute_synchronously(Request(
            (RequestArgument(False, DataLocation(0, 0, x.nbytes), (rows, 4)),),
            (RequestArgument(False, DataLocation(1, 0, result.nbytes), (rows, 4)),),
            (x, result)))
        return got, x, result
    for rows in (2, 2, 3, 3):
        got, x, result = run(rows)
        assert got.status == ErrorStatus.NONE
        np.testing.assert_array_equal(result, 2 * x)
        assert got.output_shapes[0].dimensions == (rows, 4)
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
    """A binding computed again writes through the views it made, and still
    refuses a pool that became read-only since (a view made before keeps the
    flag it had then)."""
    prepared = _prepared(_add_model())
    x, y = np.ones((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    out = np.zeros((1, 4), np.float32)
    req = _request(x, y, out)
    execution = prepared.create_execution(req)
    for k in range(3):
        x[...] = k
        assert execution.execute_synchronously().status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, x + y)
    req.pools[2].flags.writeable = False
    x[...] = 7
    result = execution.execute_synchronously()
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
    """One prepared model, one binding computed again and again over pools
    whose contents change: each result equals a freshly prepared model's,
    and the constants' shared Args are left as they were made."""
    model = _constants_model()
    prepared = _prepared(model)
    x, y, out = (np.zeros((1, 4), np.float32) for _ in range(3))
    execution = prepared.create_execution(_request(x, y, out))
    rng = np.random.default_rng(16)
    fixed = [step.args for step in prepared.executor.main.steps]
    for _ in range(6):
        x[:] = rng.normal(size=(1, 4))
        y[:] = rng.normal(size=(1, 4))
        assert execution.execute_synchronously().status == ErrorStatus.NONE
        fresh_out = np.zeros((1, 4), np.float32)
        assert _prepared(model).execute_synchronously(
            _request(x.copy(), y.copy(), fresh_out)).status == ErrorStatus.NONE
        np.testing.assert_array_equal(out, fresh_out)
        c = np.array([[0.5, -2, 3, 0]], np.float32)
        np.testing.assert_array_equal(out, np.clip((x + c) * c + y, -1, 1))
    assert [step.args for step in prepared.executor.main.steps] == fixed


def test_a_request_naming_a_driver_buffer_goes_through_the_registry_every_time():
    """A request naming a buffer by token -- one-shot or reusable -- is bound
    by the registry at every execution: its output is kept in the buffer and
    read back as the next input."""
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
            execution = prepared.create_execution(request)
            for k in range(4):
                result = prepared.execute_synchronously(request) if k % 2 \
                    else execution.execute_synchronously()
                assert result.status == ErrorStatus.NONE, result.message
            await buffer.copy_to(mem)
            np.testing.assert_array_equal(mem.array(np.float32, (1, 4)), 4 * x)
    anyio.run(main)
