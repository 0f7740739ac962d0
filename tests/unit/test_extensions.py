"""Vendor extensions and OEM operations: the model API, validation, the wire,
partitioning, the allowlist, and an in-process extension driver. The
mediapipe extension driver and services are in
tests/unit/test_extension_mediapipe.py and tests/integration/test_extension_service.py."""
import os
import struct
import sys

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service import protocol as p
from nnrt.hal import (Capabilities, Device, DeviceType, ExecutionPreference, ExecutionResult,
                      PerformanceInfo, PreparedModel, output_shapes, read_inputs, write_outputs)
from nnrt.hal.allowlist import Allowlist, check_current_app, check_peer
from nnrt.hal.validate import validate_model, validate_request
from nnrt.model.extensions import (Extension, ExtensionOperandTypeInfo, define_extension,
                                   uses_extensions)
from nnrt.model.graph import ExtensionPrefix
from nnrt.model.types import HalVersion
from nnrt.runtime import partition

SCALE = define_extension(Extension(
    "com.example.scale",
    operand_types=(ExtensionOperandTypeInfo(0, is_tensor=False, byte_size=4),),  # FACTOR
    operation_names=((0, "SCALE"),)))
OFFSET = define_extension(Extension(
    "com.example.offset",
    operand_types=(ExtensionOperandTypeInfo(3, is_tensor=True, byte_size=4),),   # OFFSETS
    operation_names=((7, "ADD_OFFSET"),)))


# --- helpers used by the integration tests too -----------------------------------------

def example_model(factor=3.0, data=b"negate", offsets=(1.0, 2.0, 3.0, 4.0)):
    """x -> com.example.scale SCALE (factor, with extension data) ->
    com.example.offset ADD_OFFSET (a constant extension tensor) -> RELU."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    f = m.add_operand(m.get_extension_operand_type("com.example.scale", 0))
    m.set_operand_value(f, np.float32(factor).tobytes())
    if data is not None:
        m.set_operand_extension_data(f, data)
    scaled = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(m.get_extension_operation_type("com.example.scale", 0), [x, f], [scaled])
    off = m.add_operand(m.get_extension_operand_type("com.example.offset", 3), [4])
    m.set_operand_value(off, np.asarray(offsets, np.float32).tobytes())
    shifted = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(m.get_extension_operation_type("com.example.offset", 7), [scaled, off],
                    [shifted])
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.RELU, [shifted], [out])
    m.identify_inputs_and_outputs([x], [out])
    return m.finish()


def example_expected(x, factor=3.0, data=b"negate", offsets=(1.0, 2.0, 3.0, 4.0)):
    y = x * np.float32(factor)
    if data == b"negate":
        y = -y
    return np.maximum(y + np.asarray(offsets, np.float32), 0)


class ExampleDevice(Device):
    """Implements com.example.scale and/or com.example.offset with numpy."""

    type, version_string, feature_level = DeviceType.ACCELERATOR, "example-1", 30

    def __init__(self, name="example", extensions=(SCALE, OFFSET)):
        self.name = name
        self.extensions = list(extensions)
        self.prepared = []

    def capabilities(self):
        fast = PerformanceInfo(0.5, 0.5)
        return Capabilities(fast, fast, {T.TENSOR_FLOAT32: fast}, fast, fast)

    def supported_extensions(self):
        return self.extensions

    def _check(self, model, op):
        names = {e.name for e in self.extensions}
        operands = model.main.operands
        if not (op.type.is_extension and op.type.extension in names):
            raise nnrt.NnrtError(ErrorStatus.INVALID_ARGUMENT, f"{op.type.name} is not ours")
        if len(op.inputs) != 2 or len(op.outputs) != 1:
            raise nnrt.NnrtError(ErrorStatus.INVALID_ARGUMENT, f"{op.type.name}: 2 inputs")
        second = operands[op.inputs[1]]
        if op.type.extension == "com.example.scale":
            if not (second.type.is_extension and second.type.extension == "com.example.scale"
                    and second.extra_params in (None, b"", b"negate")):
                raise nnrt.NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                     f"SCALE: bad factor operand {second}")
        elif not (second.type.is_extension and second.type.extension == "com.example.offset"):
            raise nnrt.NnrtError(ErrorStatus.INVALID_ARGUMENT, "ADD_OFFSET: bad offsets")

    async def supported_operations(self, model):
        flags = []
        for op in model.main.operations:
            try:
                self._check(model, op)
                flags.append(True)
            except NnrtError:
                flags.append(False)
        return flags

    async def prepare_model(self, model, preference=None, priority=None, deadline=None,
                            cache=None, *, app=None):
        validate_model(model)
        for op in model.main.operations:
            self._check(model, op)
        self.prepared.append([op.type.name for op in model.main.operations])
        return ExamplePrepared(model)


class ExamplePrepared(PreparedModel):
    def __init__(self, model):
        self.model = model

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None,
                              *, checkpoint=None):
        validate_request(self.model, request)
        main = self.model.main
        values = dict(zip(main.input_indexes, read_inputs(self.model, request)))
        for op in main.operations:
            x = values[op.inputs[0]]
            operand = main.operands[op.inputs[1]]
            raw = bytes(self.model.constant_bytes(operand))
            if op.type.extension == "com.example.scale":
                y = x * np.frombuffer(raw, np.float32)[0]
                if operand.extra_params == b"negate":
                    y = -y
            else:
                y = x + np.frombuffer(raw, np.float32)
            values[op.outputs[0]] = y.astype(np.float32)
        outputs = [values[i] for i in main.output_indexes]
        shapes = output_shapes(request, outputs)
        write_outputs(self.model, request, outputs)
        return ExecutionResult(ErrorStatus.NONE, shapes)


class ClaimsEverything(ReferenceDevice):
    """A device that says yes to every operation, offers no extension and
    is the fastest: the partitioner must still not give it an extension op."""

    type = DeviceType.ACCELERATOR

    def capabilities(self):
        fast = PerformanceInfo(0.01, 0.01)
        return Capabilities(fast, fast, {t: fast for t in T}, fast, fast)

    async def supported_operations(self, model):
        return [True] * len(model.main.operations)


# --- the model API ---------------------------------------------------------------------

def test_extension_types_carry_prefix_and_type_within():
    m = nnrt.Model()
    t_scale = m.get_extension_operand_type("com.example.scale", 0)
    t_off = m.get_extension_operand_type("com.example.offset", 3)
    op = m.get_extension_operation_type("com.example.offset", 7)
    assert (t_scale.prefix, t_scale.type_within) == (1, 0)
    assert (t_off.prefix, t_off.type_within) == (2, 3)
    assert int(op) == (2 << 16) | 7 and op.extension == "com.example.offset"
    assert op.name == "com.example.offset:ADD_OFFSET"
    assert t_scale.is_scalar and t_off.is_tensor and t_off.element_size == 4


def test_two_extensions_round_trip_through_the_model():
    hal = example_model().hal_model
    assert set(hal.extension_prefixes) == {ExtensionPrefix("com.example.scale", 1),
                                           ExtensionPrefix("com.example.offset", 2)}
    ops = hal.main.operations
    assert [op.type.name for op in ops] == ["com.example.scale:SCALE",
                                            "com.example.offset:ADD_OFFSET", "RELU"]
    factor = hal.main.operands[ops[0].inputs[1]]
    assert factor.extra_params == b"negate"
    assert np.frombuffer(bytes(hal.constant_bytes(factor)), np.float32)[0] == 3.0
    assert uses_extensions(hal) == {"com.example.scale", "com.example.offset"}
    assert validate_model(hal).version >= HalVersion.V1_2


@pytest.mark.parametrize("name", ["", "example", "Com.Example.x", "com..x", "com.example.", 7,
                                  "com.example.my-ext"])
def test_malformed_extension_names_are_refused(name):
    with pytest.raises(NnrtError) as e:
        nnrt.Model().get_extension_operation_type(name, 0)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_unknown_extension_prefix_and_type_are_refused():
    m = nnrt.Model()
    with pytest.raises(NnrtError, match="does not map"):
        m.add_operand((5 << 16) | 1, [2])
    with pytest.raises(NnrtError, match="does not map"):
        m.add_operation((5 << 16) | 1, [], [])
    with pytest.raises(NnrtError, match="not known"):
        m.get_extension_operand_type("com.example.never_defined", 0)
    with pytest.raises(NnrtError, match="no operand type 9"):
        m.get_extension_operand_type("com.example.scale", 9)
    with pytest.raises(NnrtError):
        m.get_extension_operation_type("com.example.scale", 1 << 16)


def test_a_type_of_another_model_and_data_on_a_plain_operand_are_refused():
    a, b = nnrt.Model(), nnrt.Model()
    b.get_extension_operand_type("com.example.offset", 3)       # prefix 1 in b
    t = a.get_extension_operand_type("com.example.scale", 0)    # prefix 1 in a
    with pytest.raises(NnrtError, match="another model"):
        b.add_operand(t)
    x = a.add_operand(T.TENSOR_FLOAT32, [2])
    with pytest.raises(NnrtError, match="not an extension operand"):
        a.set_operand_extension_data(x, b"x")


def test_the_byte_size_of_an_extension_scalar_is_checked():
    m = nnrt.Model()
    f = m.add_operand(m.get_extension_operand_type("com.example.scale", 0))
    with pytest.raises(NnrtError, match="needs 4 bytes"):
        m.set_operand_value(f, b"\0" * 3)


def test_validation_checks_the_prefix_map():
    from dataclasses import replace
    hal = example_model().hal_model
    twice = replace(hal, extension_prefixes=(ExtensionPrefix("com.example.scale", 1),
                                             ExtensionPrefix("com.example.scale", 2)))
    with pytest.raises(NnrtError, match="appears twice"):
        validate_model(twice)
    swapped = replace(hal, extension_prefixes=(ExtensionPrefix("com.example.scale", 2),
                                               ExtensionPrefix("com.example.offset", 1)))
    with pytest.raises(NnrtError, match="maps"):
        validate_model(swapped)
    x = hal.main.operands[0]
    operands = (replace(x, extra_params=b"?"),) + hal.main.operands[1:]
    with pytest.raises(NnrtError, match="extension data"):
        validate_model(replace(hal, main=replace(hal.main, operands=operands)))


# --- the wire ----------------------------------------------------------------------------

def test_extension_types_prefixes_and_data_round_trip_through_the_protocol():
    hal = example_model().hal_model
    frame, fds = p.encode(p.PrepareModel(1, hal, ExecutionPreference.FAST_SINGLE_ANSWER,
                                         nnrt.Priority.MEDIUM, None))
    back = p.decode_body(frame[p.FRAME_HEADER_SIZE:], fds).model
    assert back.extension_prefixes == hal.extension_prefixes
    for a, b in zip(hal.main.operands, back.main.operands):
        assert (int(a.type), a.type.name, a.type.is_tensor, a.extra_params) == \
               (int(b.type), b.type.name, b.type.is_tensor, b.extra_params)
    assert [op.type.name for op in back.main.operations] == \
           [op.type.name for op in hal.main.operations]
    validate_model(back)


def test_a_model_naming_an_unmapped_or_unknown_extension_does_not_decode():
    from dataclasses import replace
    hal = example_model().hal_model
    for prefixes in ((ExtensionPrefix("com.example.scale", 1),),          # offset unmapped
                     (ExtensionPrefix("com.example.scale", 1),
                      ExtensionPrefix("com.example.unheard_of", 2))):      # not defined here
        frame, fds = p.encode(p.SupportedOperations(1, replace(hal, extension_prefixes=prefixes)))
        with pytest.raises(p.ProtocolError):
            p.decode_body(frame[p.FRAME_HEADER_SIZE:], fds)


def test_supported_extensions_round_trip_through_the_protocol():
    frame, fds = p.encode(p.Reply(3, p.Method.SUPPORTED_EXTENSIONS, value=[SCALE, OFFSET]))
    assert p.decode_body(frame[p.FRAME_HEADER_SIZE:], fds).value == [SCALE, OFFSET]


# --- partitioning and running ----------------------------------------------------------------

def test_a_device_without_the_extension_is_never_chosen(allow_this_app):
    hal = example_model().hal_model
    liar, cpu = ClaimsEverything("liar"), ReferenceDevice()
    only_scale = ExampleDevice("only-scale", [SCALE])
    both = ExampleDevice("both")
    devices = [liar, only_scale, both, cpu]
    import anyio

    async def flags():
        return [await d.supported_operations(hal) for d in devices]
    chosen = partition.assign_devices(hal, devices, anyio.run(flags),
                                      ExecutionPreference.FAST_SINGLE_ANSWER)
    # SCALE: only-scale and both qualify (equal speed, first listed wins);
    # ADD_OFFSET needs com.example.offset: only `both`; RELU: the liar is fastest.
    assert [d.name for d in chosen] == ["only-scale", "both", "liar"]


def test_no_device_with_the_extension_fails_naming_it(allow_this_app):
    hal = example_model().hal_model
    devices = [ClaimsEverything("liar"), ExampleDevice("only-scale", [SCALE]), ReferenceDevice()]
    import anyio

    async def flags():
        return [await d.supported_operations(hal) for d in devices]
    with pytest.raises(NnrtError, match="needs the extension com.example.offset") as e:
        partition.assign_devices(hal, devices, anyio.run(flags),
                                 ExecutionPreference.FAST_SINGLE_ANSWER)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


async def test_two_extensions_run_end_to_end_in_process(allow_this_app):
    model = example_model()
    dev = ExampleDevice()
    x = np.array([[1, -2, 0.5, -1]], np.float32)
    async with nnrt.Runtime(devices=[ClaimsEverything("liar"), dev, ReferenceDevice()]) as rt:
        compiled = await rt.compile(model)
        assert [d.name for d in compiled.devices] == ["example", "liar"]
        result = await compiled.execute([x])
    np.testing.assert_array_equal(result.outputs[0], example_expected(x))
    assert dev.prepared == [["com.example.scale:SCALE", "com.example.offset:ADD_OFFSET"]]


async def test_extension_data_reaches_the_driver(allow_this_app):
    x = np.array([[1, -2, 0.5, -1]], np.float32)
    async with nnrt.Runtime(devices=[ExampleDevice(), ReferenceDevice()]) as rt:
        for data in (b"negate", None):
            result = await (await rt.compile(example_model(data=data))).execute([x])
            np.testing.assert_array_equal(result.outputs[0], example_expected(x, data=data))
        with pytest.raises(NnrtError):   # data the driver does not understand
            await rt.compile(example_model(data=b"garbage"))


async def test_no_cpu_fallback_for_an_extension(allow_this_app):
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        with pytest.raises(NnrtError, match="com.example.scale") as e:
            await rt.compile(example_model())
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


# --- the allowlist ------------------------------------------------------------------------

def test_allowlist_file_format():
    a = Allowlist.parse("# comment\n\n  /usr/bin/true  \ncamera-app\n")
    assert a.allows("/usr/bin/true")
    assert a.allows("/opt/x/camera-app")             # a name matches the executable's file name
    assert a.allows(None, ("camera-app",))
    assert not a.allows("/usr/bin/false", ("other",))


async def test_an_app_not_on_the_allowlist_is_refused_in_process(allow_nobody):
    with pytest.raises(NnrtError, match="not allowed to use vendor extensions") as e:
        check_current_app({"com.example.scale"})
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    async with nnrt.Runtime(devices=[ExampleDevice(), ReferenceDevice()]) as rt:
        with pytest.raises(NnrtError, match="com.example.offset, com.example.scale"):
            await rt.compile(example_model())
        # A model without extensions is not affected.
        m = nnrt.Model()
        a = m.add_operand(T.TENSOR_FLOAT32, [2])
        b = m.add_operand(T.TENSOR_FLOAT32, [2])
        m.add_operation(Op.RELU, [a], [b])
        m.identify_inputs_and_outputs([a], [b])
        await rt.compile(m.finish())


def test_allowlist_by_app_name_and_peer_executable(allow_nobody, monkeypatch):
    monkeypatch.setenv("NNRT_APP_NAME", "some-app")
    check_current_app({"OEM"})                      # in process, the app's name counts
    with pytest.raises(NnrtError):
        check_peer(os.getpid(), {"OEM"})            # a service looks at the executable only
    (allow_nobody / "nnrt" / "extensions-allowlist").write_text(
        os.path.realpath(sys.executable) + "\n")
    check_peer(os.getpid(), {"OEM"})


# --- OEM -------------------------------------------------------------------------------------

def oem_model():
    """y = OEM_OPERATION(x: TENSOR_OEM_BYTE [4], key: OEM scalar)."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_OEM_BYTE, [4])
    key = m.add_operand(T.OEM)
    m.set_operand_value(key, b"\x5a")
    y = m.add_operand(T.TENSOR_OEM_BYTE, [4])
    m.add_operation(Op.OEM_OPERATION, [x, key], [y])
    m.identify_inputs_and_outputs([x], [y])
    return m.finish()


class OemDevice(ReferenceDevice):
    """Claims OEM_OPERATION: XORs the bytes with the key."""

    type = DeviceType.ACCELERATOR

    async def supported_operations(self, model):
        return [op.type == Op.OEM_OPERATION for op in model.main.operations]

    async def prepare_model(self, model, *args, **kwargs):
        validate_model(model)
        return OemPrepared(model)


class OemPrepared(PreparedModel):
    def __init__(self, model):
        self.model = model

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None,
                              *, checkpoint=None):
        validate_request(self.model, request)
        (x,) = read_inputs(self.model, request)
        op = self.model.main.operations[0]
        key = self.model.constant_value(self.model.main.operands[op.inputs[1]])
        outputs = [np.bitwise_xor(x, np.uint8(key))]
        write_outputs(self.model, request, outputs)
        return ExecutionResult(ErrorStatus.NONE, output_shapes(request, outputs))


async def test_oem_operation_passes_through_to_a_driver_that_claims_it(allow_this_app):
    x = np.array([0, 1, 0x5a, 0xff], np.uint8)
    async with nnrt.Runtime(devices=[ReferenceDevice(), OemDevice("oem")]) as rt:
        compiled = await rt.compile(oem_model())
        assert [d.name for d in compiled.devices] == ["oem"]
        result = await compiled.execute([x])
    np.testing.assert_array_equal(result.outputs[0], x ^ 0x5a)
    hal = oem_model().hal_model
    frame, fds = p.encode(p.SupportedOperations(1, hal))
    back = p.decode_body(frame[p.FRAME_HEADER_SIZE:], fds).model
    assert back.main.operations[0].type == Op.OEM_OPERATION
    assert back.main.operands[0].type == T.TENSOR_OEM_BYTE


async def test_oem_is_under_the_allowlist_and_never_on_the_cpu(allow_nobody, tmp_path):
    async with nnrt.Runtime(devices=[ReferenceDevice(), OemDevice("oem")]) as rt:
        with pytest.raises(NnrtError, match=r"not allowed to use vendor extensions \(OEM\)"):
            await rt.compile(oem_model())
    (allow_nobody / "nnrt" / "extensions-allowlist").write_text(
        os.path.realpath(sys.executable) + "\n")
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        with pytest.raises(NnrtError, match="no device supports operation 0 .OEM_OPERATION."):
            await rt.compile(oem_model())
