"""Memory domains at the HAL (nnrt/hal/buffers.py): the reference driver
behind the QoS front allocates buffers for roles, checks the app and the
role on every use, refuses a never-written input, resizes a buffer whose
dimensions are unknown, and copies to and from shared memory."""
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import BufferDesc, BufferRole, Device, DeviceType, Request, RequestArgument
from nnrt.memory import DeviceToken, Memory
from nnrt.model.graph import DataLocation
from nnrt.qos import ScheduledDevice


def add_model(dims=(1, 4)):
    """out = a + b."""
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    b = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


def request(inputs, outputs):
    """A HAL request: each value an array (its own pool) or a DeviceToken."""
    pools, args = [], ([], [])
    for kind, values in enumerate((inputs, outputs)):
        for v in values:
            pools.append(v if isinstance(v, DeviceToken) else v.reshape(-1).view(np.uint8))
            length = 0 if isinstance(v, DeviceToken) else v.nbytes
            args[kind].append(RequestArgument(False, DataLocation(len(pools) - 1, 0, length)))
    return Request(tuple(args[0]), tuple(args[1]), tuple(pools))


@pytest.fixture
def device():
    return ScheduledDevice(ReferenceDevice(), app="app-a")


async def test_state_through_a_buffer_equals_numpy(device):
    prepared = await device.prepare_model(add_model())
    buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                          [BufferRole(0, 0)])
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    with Memory.create(16) as mem:
        mem.array(np.float32, (1, 4))[:] = 0
        await buffer.copy_from(mem, (1, 4))
        state = np.zeros((1, 4), np.float32)
        for _ in range(5):
            # out = state + x, written back into the same buffer
            result = await prepared.execute(request([DeviceToken(token), x], [DeviceToken(token)]))
            assert result.status == ErrorStatus.NONE, result.message
            assert result.output_shapes[0].dimensions == (1, 4)
            state = state + x
        await buffer.copy_to(mem)
        np.testing.assert_array_equal(mem.array(np.float32, (1, 4)), state)


async def test_undeclared_role_and_unwritten_input_are_refused(device):
    prepared = await device.prepare_model(add_model())
    buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 1)], [])
    x = np.ones((1, 4), np.float32)
    out = np.empty((1, 4), np.float32)
    result = await prepared.execute(request([x, DeviceToken(token)], [out]))
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    assert "never written" in result.message
    result = await prepared.execute(request([DeviceToken(token), x], [out]))   # input 0: no role
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    assert "not allocated for this use" in result.message
    result = await prepared.execute(request([x, x], [DeviceToken(token)]))     # output: no role
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    buffer.release()
    result = await prepared.execute(request([x, DeviceToken(token)], [out]))
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    assert "names no buffer" in result.message


async def test_another_apps_token_and_prepared_model_are_refused(device):
    mine = await device.prepare_model(add_model(), app="app-a")
    theirs = await device.prepare_model(add_model(), app="app-b")
    with pytest.raises(NnrtError) as e:
        await device.allocate(BufferDesc(), [theirs], [BufferRole(0, 0)], [], app="app-a")
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    buffer, token = await device.allocate(BufferDesc(), [mine], [BufferRole(0, 0)], [],
                                          app="app-a")
    with Memory.create(16) as mem:
        await buffer.copy_from(mem, (1, 4))
    x = np.ones((1, 4), np.float32)
    out = np.empty((1, 4), np.float32)
    result = await theirs.execute(request([DeviceToken(token), x], [out]))
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    assert "names no buffer of this app" in result.message
    result = await mine.execute(request([DeviceToken(token), x], [out]))
    assert result.status == ErrorStatus.NONE


async def test_allocate_checks_roles_and_dimensions(device):
    prepared = await device.prepare_model(add_model())
    other = await device.prepare_model(add_model((2, 4)))
    cases = [
        (BufferDesc(), [prepared], [], []),                               # no role
        (BufferDesc(), [prepared], [BufferRole(1, 0)], []),               # no such model
        (BufferDesc(), [prepared], [BufferRole(0, 2)], []),               # no such input
        (BufferDesc(), [prepared], [BufferRole(0, 0, 0.0)], []),          # frequency
        (BufferDesc((2, 4)), [prepared], [BufferRole(0, 0)], []),         # desc vs operand
        (BufferDesc(), [prepared, other], [BufferRole(0, 0), BufferRole(1, 0)], []),
        (BufferDesc(), [prepared], [BufferRole(0, 0), BufferRole(0, 0)], []),  # twice
    ]
    for desc, models, ins, outs in cases:
        with pytest.raises(NnrtError) as e:
            await device.allocate(desc, models, ins, outs)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT, (desc, ins, outs)


async def test_unknown_dimensions_are_resized_across_executions(device):
    prepared = await device.prepare_model(add_model((0, 4)))
    buffer, token = await device.allocate(BufferDesc(), [prepared], [], [BufferRole(0, 0)])
    assert buffer.dimensions == (0, 4)
    for rows in (1, 3, 2):
        x = np.full((rows, 4), rows, np.float32)
        req = request([x, x], [DeviceToken(token)])
        req = Request(tuple(RequestArgument(False, a.location, (rows, 4)) for a in req.inputs),
                      req.outputs, req.pools)
        result = await prepared.execute(req)
        assert result.status == ErrorStatus.NONE, result.message
        assert result.output_shapes[0].dimensions == (rows, 4)
        assert buffer.dimensions == (rows, 4)
        with Memory.create(rows * 16) as mem:
            await buffer.copy_to(mem)
            np.testing.assert_array_equal(mem.array(np.float32, (rows, 4)), x + x)


async def test_copies_check_sizes_and_dimensions(device):
    prepared = await device.prepare_model(add_model())
    buffer, _token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)], [])
    with Memory.create(16) as mem, Memory.create(32) as big:
        with pytest.raises(NnrtError, match="never written"):
            await buffer.copy_to(mem)
        with pytest.raises(NnrtError, match="takes 16 bytes"):
            await buffer.copy_from(big, (1, 4))
        with pytest.raises(NnrtError, match="differ"):
            await buffer.copy_from(big, (2, 4))
        await buffer.copy_from(mem, ())
        with pytest.raises(NnrtError, match="holds 16 bytes"):
            await buffer.copy_to(big)


class NoBuffers(Device):
    """A driver that writes only the required methods (no memory domains)."""

    name, type, version_string, feature_level = "no-buffers", DeviceType.CPU, "1", 30

    def __init__(self):
        self._ref = ReferenceDevice()

    def capabilities(self):
        return self._ref.capabilities()

    async def supported_operations(self, model):
        return await self._ref.supported_operations(model)

    async def prepare_model(self, model, *args, app=None):
        return await self._ref.prepare_model(model, *args, app=app)


async def test_a_driver_without_memory_domains_declines():
    device = ScheduledDevice(NoBuffers())
    prepared = await device.prepare_model(add_model())
    with pytest.raises(NnrtError) as e:
        await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)], [])
    assert e.value.status == ErrorStatus.GENERAL_FAILURE


async def test_the_litert_driver_keeps_buffers_too():
    """The LiteRT driver uses the same registry: state through a buffer
    equals numpy, and a role not declared is refused."""
    litert = pytest.importorskip("nnrt.drivers.litert")
    if not litert.available():
        pytest.skip("LiteRT is not installed")
    device = ScheduledDevice(litert.LiteRTDevice(), app="app-a")
    prepared = await device.prepare_model(add_model())
    buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                          [BufferRole(0, 0)])
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    with Memory.create(16) as mem:
        await buffer.copy_from(mem, (1, 4))
        for _ in range(3):
            result = await prepared.execute(request([DeviceToken(token), x], [DeviceToken(token)]))
            assert result.status == ErrorStatus.NONE, result.message
        await buffer.copy_to(mem)
        np.testing.assert_array_equal(mem.array(np.float32, (1, 4)), 3 * x)
    result = await prepared.execute(request([x, DeviceToken(token)], [np.empty((1, 4), np.float32)]))
    assert result.status == ErrorStatus.INVALID_ARGUMENT and "not allocated" in result.message
    reference = await ScheduledDevice(ReferenceDevice(), app="app-a").prepare_model(add_model())
    with pytest.raises(NnrtError, match="not prepared on"):
        await device.allocate(BufferDesc(), [reference], [BufferRole(0, 0)], [])
