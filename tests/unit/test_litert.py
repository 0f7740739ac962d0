"""The litert driver on hand-built NNAPI graphs, always compared with the
reference driver: conversion (float32, uint8, int8 per-channel, the 8-bit
twins), honest supported_operations and partitioning, dynamic output shapes,
segments and their checkpoints, interpreter reuse."""
from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

import nnrt  # noqa: E402
from nnrt import OperandType as T, OperationType as O  # noqa: E402
from nnrt.hal import Checkpoint, Request, RequestArgument  # noqa: E402
from nnrt.drivers.litert import LiteRTDevice  # noqa: E402
from nnrt.drivers.litert import segments as seg  # noqa: E402
from nnrt.drivers.reference import ReferenceDevice  # noqa: E402
from nnrt.errors import ErrorStatus, NnrtError  # noqa: E402
from nnrt.model.graph import DataLocation  # noqa: E402

RNG = np.random.default_rng(7)


# --- graph building ----------------------------------------------------------------

class Builder:
    """nnrt.Model with shorthands for constants."""

    def __init__(self, data: T = T.TENSOR_FLOAT32, relaxed: bool = False):
        self.m = nnrt.Model()
        self.data = data
        self.relaxed = relaxed

    def scalar(self, value, type=T.INT32):
        i = self.m.add_operand(type)
        self.m.set_operand_value(i, value)
        return i

    def tensor(self, dims, type=None, scale=0.0, zp=0, value=None, channel_quant=None):
        i = self.m.add_operand(type or self.data, dims, scale=scale, zero_point=zp,
                               channel_quant=channel_quant)
        if value is not None:
            self.m.set_operand_value(i, value)
        return i

    def op(self, type, inputs, out):
        self.m.add_operation(type, inputs, [out])
        return out

    def finish(self, inputs, outputs):
        self.m.identify_inputs_and_outputs(inputs, outputs)
        if self.relaxed:
            self.m.relax_computation_float32_to_float16(True)
        self.m.finish()
        return self.m


def mobilenet_like(relaxed: bool = False) -> nnrt.Model:
    """A MobileNet-shaped float32 stack: strided conv + ReLU6, depthwise
    (explicit padding equal to SAME), 1x1 conv, residual add, average pool,
    reshape, fully connected, softmax."""
    b = Builder(relaxed=relaxed)
    x = b.tensor([1, 16, 16, 3])
    w1 = b.tensor([8, 3, 3, 3], value=RNG.standard_normal((8, 3, 3, 3), np.float32) * 0.3)
    b1 = b.tensor([8], value=RNG.standard_normal(8).astype(np.float32) * 0.1)
    c1 = b.op(O.CONV_2D, [x, w1, b1, b.scalar(1), b.scalar(2), b.scalar(2), b.scalar(3)],
              b.tensor([1, 8, 8, 8]))
    wd = b.tensor([1, 3, 3, 8], value=RNG.standard_normal((1, 3, 3, 8), np.float32) * 0.3)
    bd = b.tensor([8], value=np.zeros(8, np.float32))
    dw = b.op(O.DEPTHWISE_CONV_2D, [c1, wd, bd, *(b.scalar(1) for _ in range(4)), b.scalar(1),
                                    b.scalar(1), b.scalar(1), b.scalar(3)],
              b.tensor([1, 8, 8, 8]))
    w2 = b.tensor([8, 1, 1, 8], value=RNG.standard_normal((8, 1, 1, 8), np.float32) * 0.3)
    b2 = b.tensor([8], value=np.zeros(8, np.float32))
    pw = b.op(O.CONV_2D, [dw, w2, b2, b.scalar(2), b.scalar(1), b.scalar(1), b.scalar(0)],
              b.tensor([1, 8, 8, 8]))
    res = b.op(O.ADD, [pw, c1, b.scalar(0)], b.tensor([1, 8, 8, 8]))
    pool = b.op(O.AVERAGE_POOL_2D, [res, b.scalar(2), b.scalar(8), b.scalar(8), b.scalar(8),
                                    b.scalar(8), b.scalar(0)], b.tensor([1, 1, 1, 8]))
    flat = b.op(O.RESHAPE, [pool, b.tensor([2], T.TENSOR_INT32, value=np.array([1, 8], np.int32))],
                b.tensor([1, 8]))
    wf = b.tensor([5, 8], value=RNG.standard_normal((5, 8), np.float32))
    bf = b.tensor([5], value=np.zeros(5, np.float32))
    fc = b.op(O.FULLY_CONNECTED, [flat, wf, bf, b.scalar(0)], b.tensor([1, 5]))
    out = b.op(O.SOFTMAX, [fc, b.scalar(1.0, T.FLOAT32)], b.tensor([1, 5]))
    return b.finish([x], [out, c1])


def quant_conv(data: T, per_channel: bool, filter_zp: int = 0) -> nnrt.Model:
    """One 3x3 conv on 8-bit data, per-tensor or per-channel filter."""
    b = Builder(data)
    zp_x, zp_y = (3, 120) if data == T.TENSOR_QUANT8_ASYMM else (-5, -8)
    x = b.tensor([1, 6, 6, 4], scale=0.05, zp=zp_x)
    if per_channel:
        scales = [0.02, 0.03, 0.01, 0.04, 0.025]
        wv = RNG.integers(-100, 100, (5, 3, 3, 4)).astype(np.int8)
        w = b.tensor([5, 3, 3, 4], T.TENSOR_QUANT8_SYMM_PER_CHANNEL, value=wv,
                     channel_quant=(0, scales))
        bias = b.tensor([5], T.TENSOR_INT32, value=RNG.integers(-500, 500, 5).astype(np.int32))
    else:
        lo, hi = (0, 255) if data == T.TENSOR_QUANT8_ASYMM else (-128, 127)
        wv = RNG.integers(lo, hi, (5, 3, 3, 4)).astype(data.dtype)
        w = b.tensor([5, 3, 3, 4], data, scale=0.02, zp=filter_zp, value=wv)
        bias = b.tensor([5], T.TENSOR_INT32, scale=0.05 * 0.02,
                        value=RNG.integers(-500, 500, 5).astype(np.int32))
    y = b.op(O.CONV_2D, [x, w, bias, b.scalar(1), b.scalar(1), b.scalar(1), b.scalar(1)],
             b.tensor([1, 6, 6, 5], scale=0.3, zp=zp_y))
    return b.finish([x], [y])


def random_input(model: nnrt.Model, k: int = 0) -> np.ndarray:
    hal = model.hal_model
    o = hal.main.operands[hal.main.input_indexes[k]]
    if o.type == T.TENSOR_FLOAT32:
        return RNG.standard_normal(o.dimensions).astype(np.float32)
    info = np.iinfo(o.type.dtype)
    return RNG.integers(info.min, info.max, o.dimensions, endpoint=True).astype(o.type.dtype)


async def run_on(devices, model, inputs):
    async with nnrt.Runtime(devices=devices) as rt:
        compiled = await rt.compile(model)
        result = await compiled.execute(inputs)
        return result, [d.name for d in compiled.devices]


def request_for(inputs: list[np.ndarray], outputs: list[np.ndarray]) -> Request:
    arrays = [*inputs, *outputs]
    pools = tuple(a.reshape(-1).view(np.uint8) for a in arrays)
    args = [RequestArgument(False, DataLocation(k, 0, a.nbytes)) for k, a in enumerate(arrays)]
    return Request(tuple(args[:len(inputs)]), tuple(args[len(inputs):]), pools)


# --- conversion, compared with the reference -----------------------------------------

@pytest.mark.parametrize("relaxed", [False, True])
def test_mobilenet_like_float32_matches_the_reference(relaxed):
    model = mobilenet_like(relaxed)
    litert = LiteRTDevice()
    assert all(anyio.run(litert.supported_operations, model.hal_model))
    x = random_input(model)
    got, devices = anyio.run(run_on, [litert], model, [x])
    want, _ = anyio.run(run_on, [ReferenceDevice()], model, [x])
    assert devices == ["litert"]
    for g, w in zip(got.outputs, want.outputs):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("data,per_channel,filter_zp", [
    (T.TENSOR_QUANT8_ASYMM, False, 128),
    (T.TENSOR_QUANT8_ASYMM_SIGNED, True, 0),
    (T.TENSOR_QUANT8_ASYMM_SIGNED, False, 0),
    (T.TENSOR_QUANT8_ASYMM_SIGNED, False, 7),    # asymmetric int8 filter: runs as uint8
    (T.TENSOR_QUANT8_ASYMM, True, 0),            # uint8 data, per-channel filter: runs as int8
])
def test_quantized_conv_within_one_unit_of_the_reference(data, per_channel, filter_zp):
    model = quant_conv(data, per_channel, filter_zp)
    litert = LiteRTDevice()
    assert anyio.run(litert.supported_operations, model.hal_model) == [True]
    x = random_input(model)
    got, devices = anyio.run(run_on, [litert], model, [x])
    want, _ = anyio.run(run_on, [ReferenceDevice()], model, [x])
    assert devices == ["litert"]
    diff = np.abs(got.outputs[0].astype(np.int32) - want.outputs[0].astype(np.int32))
    assert diff.max() <= 1
    assert np.unique(want.outputs[0]).size > 10   # not a saturated, trivial output


def test_the_8bit_twin_is_the_other_type_shifted_exactly():
    """An int8 conv with an asymmetric filter runs as uint8: its result is the
    uint8 model's shifted by 128, bit for bit."""
    unsigned = quant_conv(T.TENSOR_QUANT8_ASYMM, False, 130)
    hal = unsigned.hal_model
    b = Builder(T.TENSOR_QUANT8_ASYMM_SIGNED)
    ops = hal.main.operands
    w_op, bias_op = ops[1], ops[2]
    x = b.tensor([1, 6, 6, 4], scale=0.05, zp=3 - 128)
    w = b.tensor([5, 3, 3, 4], scale=w_op.scale, zp=2,
                 value=(hal.constant_value(w_op).astype(np.int16) - 128).astype(np.int8))
    bias = b.tensor([5], T.TENSOR_INT32, scale=bias_op.scale, value=hal.constant_value(bias_op))
    y = b.op(O.CONV_2D, [x, w, bias, b.scalar(1), b.scalar(1), b.scalar(1), b.scalar(1)],
             b.tensor([1, 6, 6, 5], scale=0.3, zp=120 - 128))
    signed = b.finish([x], [y])
    xu = random_input(unsigned)
    u, _ = anyio.run(run_on, [LiteRTDevice()], unsigned, [xu])
    s, devices = anyio.run(run_on, [LiteRTDevice()], signed,
                           [(xu.astype(np.int16) - 128).astype(np.int8)])
    assert devices == ["litert"]
    np.testing.assert_array_equal(s.outputs[0].astype(np.int16),
                                  u.outputs[0].astype(np.int16) - 128)


def test_the_converted_model_is_a_tflite_flatbuffer_with_the_options():
    import tflite
    model = mobilenet_like()
    hal = model.hal_model
    prepared = LiteRTDevice(segment_time=None).prepare_model_synchronously(hal)
    (segment,) = prepared.runner.segments
    fb = tflite.Model.GetRootAsModel(segment.model, 0)
    assert fb.Version() == 3 and fb.SubgraphsLength() == 1
    codes = [fb.OperatorCodes(k).BuiltinCode() for k in range(fb.OperatorCodesLength())]
    graph = fb.Subgraphs(0)
    ops = [codes[graph.Operators(k).OpcodeIndex()] for k in range(graph.OperatorsLength())]
    B = tflite.BuiltinOperator
    assert ops == [B.CONV_2D, B.DEPTHWISE_CONV_2D, B.CONV_2D, B.ADD, B.AVERAGE_POOL_2D,
                   B.RESHAPE, B.FULLY_CONNECTED, B.SOFTMAX]
    first = graph.Operators(0)
    assert first.BuiltinOptionsType() == tflite.BuiltinOptions.Conv2DOptions
    options = tflite.Conv2DOptions()
    options.Init(first.BuiltinOptions().Bytes, first.BuiltinOptions().Pos)
    assert (options.Padding(), options.StrideW(), options.StrideH(),
            options.FusedActivationFunction()) == (tflite.Padding.SAME, 2, 2,
                                                   tflite.ActivationFunctionType.RELU6)
    # The explicit padding (1, 1, 1, 1) of the 3x3 stride-1 depthwise is SAME.
    dw = tflite.DepthwiseConv2DOptions()
    opts = graph.Operators(1).BuiltinOptions()
    dw.Init(opts.Bytes, opts.Pos)
    assert dw.Padding() == tflite.Padding.SAME
    assert graph.InputsLength() == 1 and graph.OutputsLength() == 2


def test_per_channel_filter_keeps_its_scales_and_the_bias_gets_them_spelled_out():
    import tflite
    model = quant_conv(T.TENSOR_QUANT8_ASYMM_SIGNED, True)
    prepared = LiteRTDevice().prepare_model_synchronously(model.hal_model)
    graph = tflite.Model.GetRootAsModel(prepared.runner.segments[0].model, 0).Subgraphs(0)
    op = graph.Operators(0)
    w = graph.Tensors(op.Inputs(1)).Quantization()
    bias = graph.Tensors(op.Inputs(2)).Quantization()
    np.testing.assert_allclose(w.ScaleAsNumpy(), [0.02, 0.03, 0.01, 0.04, 0.025])
    assert w.QuantizedDimension() == 0 and not w.ZeroPointAsNumpy().any()
    np.testing.assert_allclose(bias.ScaleAsNumpy(), 0.05 * np.array([0.02, 0.03, 0.01, 0.04, 0.025]),
                               rtol=1e-6)


# --- honest claims, partitioning ------------------------------------------------------

def _conv_with(padding: list[int], layout: bool | None = None, data=T.TENSOR_FLOAT32):
    b = Builder(data)
    x = b.tensor([1, 5, 5, 2] if not layout else [1, 2, 5, 5])
    w = b.tensor([3, 3, 3, 2], value=np.ones((3, 3, 3, 2), data.dtype))
    bias = b.tensor([3], value=np.zeros(3, data.dtype))
    args = [x, w, bias, *(b.scalar(p) for p in padding), b.scalar(1), b.scalar(1), b.scalar(0)]
    if layout is not None:
        args.append(b.scalar(layout, T.BOOL))
    y = b.op(O.CONV_2D, args, b.tensor([]))
    return b.finish([x], [y]).hal_model


def test_supported_operations_refuses_what_litert_cannot_run_as_nnapi_defines_it():
    litert = LiteRTDevice()

    def supported(hal):
        return anyio.run(litert.supported_operations, hal)

    assert supported(_conv_with([1, 1, 1, 1])) == [True]    # = SAME
    assert supported(_conv_with([0, 0, 0, 0])) == [True]    # = VALID
    assert supported(_conv_with([2, 0, 1, 1])) == [False]   # neither
    assert supported(_conv_with([1, 1, 1, 1], data=T.TENSOR_FLOAT16)) == [True]  # in float32
    reasons = litert.unsupported_reasons(_conv_with([2, 0, 1, 1]))
    assert "neither SAME nor VALID" in reasons[0]


@pytest.mark.parametrize("data", [T.TENSOR_FLOAT32, T.TENSOR_QUANT8_ASYMM])
def test_nchw_runs_as_the_nhwc_twin_between_two_transposes(data):
    import tflite
    b = Builder(data)
    q = {"scale": 0.1, "zp": 3} if data != T.TENSOR_FLOAT32 else {}
    x = b.tensor([1, 3, 6, 5], **q)     # NCHW: 3 channels, 6 x 5
    wv = RNG.integers(0, 255, (4, 3, 3, 3)) if q else RNG.standard_normal((4, 3, 3, 3))
    w = b.tensor([4, 3, 3, 3], value=wv.astype(data.dtype), **({"scale": 0.05, "zp": 120} if q
                                                                else {}))
    bias_type = T.TENSOR_INT32 if q else T.TENSOR_FLOAT32
    bias = b.tensor([4], bias_type, scale=0.1 * 0.05 if q else 0.0,
                    value=np.arange(4).astype(bias_type.dtype))
    y = b.op(O.CONV_2D, [x, w, bias, b.scalar(1), b.scalar(2), b.scalar(1), b.scalar(0),
                         b.scalar(True, T.BOOL)],
             b.tensor([1, 4, 6, 3], **({"scale": 0.5, "zp": 100} if q else {})))
    model = b.finish([x], [y])
    litert = LiteRTDevice()
    assert anyio.run(litert.supported_operations, model.hal_model) == [True]
    prepared = litert.prepare_model_synchronously(model.hal_model)
    graph = tflite.Model.GetRootAsModel(prepared.runner.segments[0].model, 0)
    codes = [graph.OperatorCodes(k).BuiltinCode() for k in range(graph.OperatorCodesLength())]
    ops = [codes[graph.Subgraphs(0).Operators(k).OpcodeIndex()]
           for k in range(graph.Subgraphs(0).OperatorsLength())]
    B = tflite.BuiltinOperator
    assert ops == [B.TRANSPOSE, B.CONV_2D, B.TRANSPOSE]
    data_in = random_input(model)
    got, devices = anyio.run(run_on, [litert], model, [data_in])
    want, _ = anyio.run(run_on, [ReferenceDevice()], model, [data_in])
    assert devices == ["litert"] and got.output_shapes == [(1, 4, 6, 3)]
    if q:
        assert np.abs(got.outputs[0].astype(int) - want.outputs[0].astype(int)).max() <= 1
    else:
        np.testing.assert_allclose(got.outputs[0], want.outputs[0], rtol=1e-5, atol=1e-5)


def test_float16_runs_as_the_float32_twin_widened_and_rounded():
    import tflite
    b = Builder(T.TENSOR_FLOAT16)
    x = b.tensor([1, 5, 5, 2])
    w = b.tensor([3, 3, 3, 2], value=RNG.standard_normal((3, 3, 3, 2)).astype(np.float16))
    bias = b.tensor([3], value=np.ones(3, np.float16))
    y = b.op(O.CONV_2D, [x, w, bias, b.scalar(1), b.scalar(1), b.scalar(1), b.scalar(1)],
             b.tensor([1, 5, 5, 3]))
    model = b.finish([x], [y])
    litert = LiteRTDevice()
    prepared = litert.prepare_model_synchronously(model.hal_model)
    graph = tflite.Model.GetRootAsModel(prepared.runner.segments[0].model, 0)
    codes = [graph.OperatorCodes(k).BuiltinCode() for k in range(graph.OperatorCodesLength())]
    ops = [codes[graph.Subgraphs(0).Operators(k).OpcodeIndex()]
           for k in range(graph.Subgraphs(0).OperatorsLength())]
    B = tflite.BuiltinOperator
    # input, filter, bias widened; the result rounded
    assert ops == [B.DEQUANTIZE, B.DEQUANTIZE, B.DEQUANTIZE, B.CONV_2D, B.CAST]
    data = RNG.standard_normal((1, 5, 5, 2)).astype(np.float16)
    got, devices = anyio.run(run_on, [litert], model, [data])
    want, _ = anyio.run(run_on, [ReferenceDevice()], model, [data])
    assert devices == ["litert"] and got.outputs[0].dtype == np.float16
    tolerance = 5 * 2.0 ** -10    # the CTS's float16 tolerance
    np.testing.assert_allclose(got.outputs[0].astype(np.float32),
                               want.outputs[0].astype(np.float32),
                               atol=tolerance, rtol=tolerance)


def test_quantize_is_left_to_the_reference_unless_it_meets_no_ties():
    """LiteRT rounds x / scale = k + 0.5 to even, NNAPI away from zero; a
    QUANTIZE of arbitrary floats goes to the reference driver, one undoing a
    same-scale DEQUANTIZE (no ties possible) stays on litert."""
    b = Builder()
    x = b.tensor([4])
    y = b.op(O.QUANTIZE, [x], b.tensor([4], T.TENSOR_QUANT8_ASYMM_SIGNED, scale=0.5, zp=0))
    model = b.finish([x], [y])
    litert = LiteRTDevice()
    assert anyio.run(litert.supported_operations, model.hal_model) == [False]
    ties = np.array([0.25, 0.75, 1.25, -0.25], np.float32)
    got, devices = anyio.run(run_on, [litert, ReferenceDevice()], model, [ties])
    assert devices == ["nnrt-reference"]
    assert got.outputs[0].tolist() == [1, 2, 3, -1]

    b = Builder(T.TENSOR_QUANT8_ASYMM)
    u = b.tensor([4], scale=0.5, zp=128)
    f = b.op(O.DEQUANTIZE, [u], b.tensor([4], T.TENSOR_FLOAT32))
    s8 = b.op(O.QUANTIZE, [f], b.tensor([4], T.TENSOR_QUANT8_ASYMM_SIGNED, scale=0.5, zp=0))
    requantize = b.finish([u], [s8])
    assert anyio.run(litert.supported_operations, requantize.hal_model) == [True, True]
    data = np.array([0, 127, 128, 255], np.uint8)
    got, devices = anyio.run(run_on, [litert], requantize, [data])
    assert devices == ["litert"] and got.outputs[0].tolist() == [-128, -1, 0, 127]


def test_an_unsupported_operation_is_partitioned_to_the_reference_device():
    b = Builder()
    x = b.tensor([2, 6])
    y = b.op(O.RELU, [x], b.tensor([2, 6]))
    # CHANNEL_SHUFFLE has no TFLite builtin.
    z = b.op(O.CHANNEL_SHUFFLE, [y, b.scalar(2), b.scalar(1)], b.tensor([2, 6]))
    out = b.op(O.LOGISTIC, [z], b.tensor([2, 6]))
    model = b.finish([x], [out])
    litert = LiteRTDevice()
    assert anyio.run(litert.supported_operations, model.hal_model) == [True, False, True]
    data = RNG.standard_normal((2, 6)).astype(np.float32)
    got, devices = anyio.run(run_on, [litert, ReferenceDevice()], model, [data])
    want, _ = anyio.run(run_on, [ReferenceDevice()], model, [data])
    assert devices == ["litert", "nnrt-reference", "litert"]
    np.testing.assert_allclose(got.outputs[0], want.outputs[0], rtol=1e-6, atol=1e-6)


def test_around_a_while_loop_the_main_graph_runs_on_litert():
    """WHILE (and its subgraphs) stays with the reference driver; the
    operations around it in the main graph run on litert."""
    from .test_control_flow import fibonacci_model
    loop = fibonacci_model().hal_model
    b = Builder()
    fib, i, n = b.tensor([1, 2]), b.tensor([1]), b.tensor([1])
    fib2 = b.op(O.RELU, [fib], b.tensor([1, 2]))
    cond_ref, body_ref = b.m.add_operand(T.SUBGRAPH), b.m.add_operand(T.SUBGRAPH)
    b.m.set_operand_value_from_model(cond_ref, _submodel(loop, 0))
    b.m.set_operand_value_from_model(body_ref, _submodel(loop, 1))
    looped = b.op(O.WHILE, [cond_ref, body_ref, fib2, i, n], b.tensor([1, 2]))
    out = b.op(O.MUL, [looped, b.tensor([1], value=np.full(1, 2, np.float32)), b.scalar(0)],
               b.tensor([1, 2]))
    model = b.finish([fib, i, n], [out])
    litert = LiteRTDevice()
    assert anyio.run(litert.supported_operations, model.hal_model) == [True, False, True]
    inputs = [np.array([[0, 1]], np.float32), np.zeros(1, np.float32), np.full(1, 6, np.float32)]
    got, devices = anyio.run(run_on, [litert, ReferenceDevice()], model, inputs)
    assert devices == ["litert", "nnrt-reference", "litert"]
    np.testing.assert_array_equal(got.outputs[0], [[16.0, 26.0]])   # fib(6), fib(7) doubled


def _submodel(hal, index: int) -> nnrt.Model:
    """Rebuild referenced subgraph ``index`` of ``hal`` as a finished nnrt.Model."""
    sub = hal.referenced[index]
    m = nnrt.Model()
    for o in sub.operands:
        m.add_operand(o.type, list(o.dimensions) if o.type.is_tensor else None)
    for k, o in enumerate(sub.operands):
        if o.location is not None and o.lifetime.name.startswith("CONSTANT"):
            m.set_operand_value(k, np.array(hal.constant_value(o)))
    for op in sub.operations:
        m.add_operation(op.type, list(op.inputs), list(op.outputs))
    m.identify_inputs_and_outputs(list(sub.input_indexes), list(sub.output_indexes))
    return m.finish()


def test_preparing_an_unsupported_operation_is_refused():
    with pytest.raises(NnrtError) as e:
        LiteRTDevice().prepare_model_synchronously(_conv_with([2, 0, 1, 1]))
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_dynamic_output_shape_is_reported_and_the_runtime_retries():
    model = mobilenet_like()
    hal = model.hal_model
    prepared = LiteRTDevice().prepare_model_synchronously(hal)
    x = random_input(model)
    too_small = [np.empty(2, np.float32), np.empty((1, 8, 8, 8), np.float32)]
    result = prepared.execute_synchronously(request_for([x], too_small))
    assert result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    assert [s.dimensions for s in result.output_shapes] == [(1, 5), (1, 8, 8, 8)]
    assert [s.is_sufficient for s in result.output_shapes] == [False, True]

    b = Builder()
    a = b.tensor([3, 4])
    out = b.op(O.RELU6, [a], b.tensor([0, 0]))     # output declared with unknown extents
    dynamic = b.finish([a], [out])
    data = RNG.standard_normal((3, 4)).astype(np.float32) * 5
    got, devices = anyio.run(run_on, [LiteRTDevice()], dynamic, [data])
    assert devices == ["litert"] and got.output_shapes == [(3, 4)]
    np.testing.assert_array_equal(got.outputs[0], np.clip(data, 0, 6))


# --- segments -----------------------------------------------------------------------------

def test_cut_bounds_each_segment_by_the_budget_or_makes_the_count_asked_for():
    costs = [1.0, 1.0, 2.0, 4.0, 1.0, 1.0]     # estimated 10 ms in all
    groups = seg.cut(costs, 0.010, 0.002)
    assert [list(g) for g in groups] == [[0, 1], [2], [3], [4, 5]]
    assert [list(g) for g in seg.cut(costs, 0.010, None)] == [[0, 1, 2, 3, 4, 5]]
    assert len(seg.cut(costs, 0.010, None, count=3)) == 3
    assert len(seg.cut(costs, 0.010, None, count=99)) == 6
    for count in (1, 2, 4):
        groups = seg.cut(costs, 0.010, None, count=count)
        assert [k for g in groups for k in g] == list(range(6))


def _execute(prepared, x, checkpoint=None, contended=None):
    """Execute with ``checkpoint`` (a function) at the boundaries, as a
    scheduler's checkpoint that says whether a job waits (``contended``,
    default: always)."""
    outs = [np.empty((1, 5), np.float32), np.empty((1, 8, 8, 8), np.float32)]
    result = prepared.execute_synchronously(
        request_for([x], outs),
        checkpoint=None if checkpoint is None else Checkpoint(checkpoint, contended))
    return result, outs


def test_segments_compute_what_one_interpreter_computes_with_a_checkpoint_between_two():
    model = mobilenet_like()
    hal = model.hal_model
    one = LiteRTDevice(segment_time=None).prepare_model_synchronously(hal)
    four = LiteRTDevice(segments=4).prepare_model_synchronously(hal)
    assert one.segment_count == 1 and four.segment_count == 4
    x = random_input(model)
    calls = []
    r1, o1 = _execute(one, x, lambda: calls.append("one"))
    r4, o4 = _execute(four, x, lambda: calls.append("four"))
    assert r1.status == r4.status == ErrorStatus.NONE
    assert calls == ["four"] * 3
    for a, b in zip(o1, o4):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_pool_that_is_not_a_contiguous_buffer_is_refused_not_raised():
    """On main before 2026-11-27 execute_synchronously raised the TypeError
    of ``memoryview(pool).cast`` out of the HAL call."""
    model = mobilenet_like()
    prepared = LiteRTDevice().prepare_model_synchronously(model.hal_model)
    x = random_input(model)
    arrays = [x, np.empty((1, 10), np.float32)[:, ::2], np.empty((1, 8, 8, 8), np.float32)]
    args = tuple(RequestArgument(False, DataLocation(k, 0, a.nbytes)) for k, a in enumerate(arrays))
    result = prepared.execute_synchronously(Request(args[:1], args[1:], tuple(arrays)))
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    assert "pool 1 is not a contiguous buffer" in result.message
    assert _execute(prepared, x)[0].status == ErrorStatus.NONE


def test_a_cut_model_runs_uncut_while_nobody_waits_and_in_segments_while_a_job_does():
    model = mobilenet_like()
    prepared = LiteRTDevice(segments=4).prepare_model_synchronously(model.hal_model)
    assert prepared.segment_count == 4 and prepared.uncut is not None
    x = random_input(model)
    calls = []
    contended = [False]
    free, free_outs = _execute(prepared, x, lambda: calls.append(1), lambda: contended[0])
    assert free.status == ErrorStatus.NONE and calls == []      # uncut: no boundary
    contended[0] = True
    busy, busy_outs = _execute(prepared, x, lambda: calls.append(1), lambda: contended[0])
    assert busy.status == ErrorStatus.NONE and calls == [1, 1, 1]   # between 4 segments
    for a, b in zip(free_outs, busy_outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Without a checkpoint (nobody could stop it): uncut too.
    assert _execute(prepared, x)[0].status == ErrorStatus.NONE
    one = LiteRTDevice(segment_time=None).prepare_model_synchronously(model.hal_model)
    assert one.segment_count == 1 and one.uncut is None


def test_a_checkpoint_that_raises_stops_the_execution_with_its_status():
    model = mobilenet_like()
    prepared = LiteRTDevice(segments=3).prepare_model_synchronously(model.hal_model)
    calls = []

    def checkpoint():
        calls.append(1)
        raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT, "deadline missed at a boundary")

    result, _ = _execute(prepared, random_input(model), checkpoint)
    assert result.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert result.message == "deadline missed at a boundary"
    assert calls == [1]


def test_an_execution_parked_at_a_checkpoint_keeps_its_state_while_another_runs():
    """Preemption by an execution of the same prepared model: the parked one
    keeps its intermediates (its own interpreter set) and both are right."""
    model = mobilenet_like()
    prepared = LiteRTDevice(segments=4).prepare_model_synchronously(model.hal_model)
    x1, x2 = random_input(model), random_input(model)
    _, alone1 = _execute(prepared, x1)
    _, alone2 = _execute(prepared, x2)
    nested = []

    def checkpoint():
        if not nested:   # preempted once, at the first boundary
            nested.append(_execute(prepared, x2))

    result, outs = _execute(prepared, x1, checkpoint)
    assert result.status == ErrorStatus.NONE and nested[0][0].status == ErrorStatus.NONE
    for a, b in zip(outs, alone1):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(nested[0][1], alone2):
        np.testing.assert_array_equal(a, b)


def test_interpreters_are_made_at_preparation_not_per_execution(monkeypatch):
    model = mobilenet_like()
    prepared = LiteRTDevice(segments=2).prepare_model_synchronously(model.hal_model)
    made = []
    real = seg.new_interpreter
    monkeypatch.setattr(seg, "new_interpreter", lambda *a: made.append(1) or real(*a))
    for _ in range(3):
        result, _ = _execute(prepared, random_input(model))
        assert result.status == ErrorStatus.NONE
    assert made == []


def test_invoke_runs_without_the_gil_so_two_executions_overlap():
    """Two threads executing at once take less than twice one's time only if
    invoke releases the GIL; at least they must both finish correctly."""
    model = mobilenet_like()
    prepared = LiteRTDevice().prepare_model_synchronously(model.hal_model)
    x = random_input(model)
    _, want = _execute(prepared, x)
    results = []

    def worker():
        for _ in range(20):
            results.append(_execute(prepared, x))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 40
    for result, outs in results:
        assert result.status == ErrorStatus.NONE
        np.testing.assert_array_equal(outs[0], want[0])


def test_num_threads_and_settings_are_checked():
    with pytest.raises(NnrtError):
        LiteRTDevice(num_threads=0)
    with pytest.raises(NnrtError):
        LiteRTDevice(segment_time=0)
    from nnrt.hal import Boundaries
    assert LiteRTDevice().scheduling().boundaries is Boundaries.SEGMENT


def test_timing_is_measured_when_asked():
    model = mobilenet_like()
    prepared = LiteRTDevice(segments=2).prepare_model_synchronously(model.hal_model)
    outs = [np.empty((1, 5), np.float32), np.empty((1, 8, 8, 8), np.float32)]
    result = prepared.execute_synchronously(request_for([random_input(model)], outs), measure=True)
    assert 0 < result.timing.on_device <= result.timing.in_driver < 10_000_000


def test_without_litert_the_runtime_lists_only_the_reference_device(monkeypatch):
    from nnrt.drivers import litert
    from nnrt.runtime import runtime
    monkeypatch.setattr(litert, "available", lambda: False)
    assert [d.name for d in runtime.in_process_devices()] == ["nnrt-reference"]
    monkeypatch.undo()
    assert [d.name for d in runtime.in_process_devices()] == ["litert", "nnrt-reference"]
