"""The com.nnrt.mediapipe extension: its driver against an independent numpy
transposed convolution, its validation of malformed input, and the TFLite
importer's mapping of mediapipe's Convolution2DTransposeBias."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, NnrtError, OperandType as T
from nnrt.drivers.mediapipe import MediapipeDevice
from nnrt.drivers.reference import ReferenceDevice
from nnrt.drivers.sample import DRIVERS
from nnrt.extensions import mediapipe as mp
from nnrt.hal import Request, RequestArgument
from nnrt.model.graph import DataLocation
from nnrt.model.types import OperandLifeTime as L
from nnrt.tflite import load_operators
from nnrt.tflite.reader import read
from tests.conftest import MODELS

SELFIE = MODELS / "mediapipe" / "selfie_segmentation.tflite"


def transpose_conv_bias_f64(x, w, b, padding, stride_w, stride_h):
    """Scatter every input pixel through the kernel, in float64: output
    (y*sh + i - top, x*sw + j - left) += w[:, i, j, :] @ x[y, x]."""
    n, h, wd, _ = x.shape
    o, kh, kw, _ = w.shape
    if padding == 1:
        out_h, out_w = h * stride_h, wd * stride_w
    else:
        out_h, out_w = (h - 1) * stride_h + kh, (wd - 1) * stride_w + kw
    top = max((h - 1) * stride_h + kh - out_h, 0) // 2
    left = max((wd - 1) * stride_w + kw - out_w, 0) // 2
    full = np.zeros((n, (h - 1) * stride_h + kh, (wd - 1) * stride_w + kw, o))
    for yy in range(h):
        for xx in range(wd):
            full[:, yy * stride_h:yy * stride_h + kh, xx * stride_w:xx * stride_w + kw, :] += \
                np.einsum("nc,oijc->nijo", x[:, yy, xx, :].astype(np.float64), w.astype(np.float64))
    return full[:, top:top + out_h, left:left + out_w, :] + b


def mediapipe_model(x_dims, w, b, params: bytes, out_dims=None):
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, x_dims)
    wo = m.add_operand(T.TENSOR_FLOAT32, w.shape)
    m.set_operand_value(wo, w)
    bo = m.add_operand(T.TENSOR_FLOAT32, b.shape)
    m.set_operand_value(bo, b)
    po = m.add_operand(m.get_extension_operand_type(mp.NAME, mp.TRANSPOSE_CONV_PARAMS))
    m.set_operand_value(po, params)
    out = m.add_operand(T.TENSOR_FLOAT32, out_dims or [])
    m.add_operation(m.get_extension_operation_type(mp.NAME, mp.CONVOLUTION_2D_TRANSPOSE_BIAS),
                    [x, wo, bo, po], [out])
    m.identify_inputs_and_outputs([x], [out])
    return m.finish()


@pytest.mark.parametrize("padding,sw,sh,k", [(1, 2, 2, 2), (2, 2, 2, 3), (1, 1, 2, 3), (2, 3, 1, 2)])
async def test_the_driver_computes_the_custom_op(allow_this_app, padding, sw, sh, k):
    rng = np.random.default_rng(padding * 100 + sw * 10 + sh + k)
    x = rng.standard_normal((2, 5, 4, 3)).astype(np.float32)
    w = rng.standard_normal((4, k, k, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    model = mediapipe_model(list(x.shape), w, b, mp.PARAMS_FORMAT.pack(padding, sw, sh))
    async with nnrt.Runtime(devices=[ReferenceDevice(), MediapipeDevice()]) as rt:
        compiled = await rt.compile(model)
        assert [d.name for d in compiled.devices] == ["mediapipe"]
        got = (await compiled.execute([x])).outputs[0]
    want = transpose_conv_bias_f64(x, w, b, padding, sw, sh)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_driver_is_served_by_name():
    assert isinstance(DRIVERS["mediapipe"]("mp"), MediapipeDevice)
    assert [e.name for e in MediapipeDevice().supported_extensions()] == [mp.NAME]


def _bad_models():
    w = np.ones((2, 2, 2, 3), np.float32)
    b = np.zeros(2, np.float32)
    good = mediapipe_model([1, 4, 4, 3], w, b, mp.PARAMS_FORMAT.pack(1, 2, 2)).hal_model
    op = good.main.operations[0]
    params = good.main.operands[op.inputs[3]]
    yield "padding 9", mediapipe_model([1, 4, 4, 3], w, b, mp.PARAMS_FORMAT.pack(9, 2, 2)).hal_model
    yield "stride 0", mediapipe_model([1, 4, 4, 3], w, b, mp.PARAMS_FORMAT.pack(1, 0, 2)).hal_model
    yield "bias length", mediapipe_model([1, 4, 4, 3], w, np.zeros(3, np.float32),
                                         mp.PARAMS_FORMAT.pack(1, 2, 2)).hal_model
    yield "depth", mediapipe_model([1, 4, 4, 5], w, b, mp.PARAMS_FORMAT.pack(1, 2, 2)).hal_model
    yield "declared output", mediapipe_model([1, 4, 4, 3], w, b, mp.PARAMS_FORMAT.pack(1, 2, 2),
                                             [1, 9, 8, 2]).hal_model
    yield "three inputs", replace(good, main=replace(good.main, operations=(
        replace(op, inputs=op.inputs[:3]),)))
    # The parameters as a plain INT32 tensor, then as a model input (not constant).
    as_int = replace(params, type=T.TENSOR_INT32, dimensions=(3,))
    yield "params type", replace(good, main=replace(good.main, operands=tuple(
        as_int if k == op.inputs[3] else o for k, o in enumerate(good.main.operands))))
    # A value of 8 bytes for a 12-byte extension scalar (a hostile client).
    short = replace(params, location=DataLocation(params.location.pool_index,
                                                  params.location.offset, 8))
    yield "params size", replace(good, main=replace(good.main, operands=tuple(
        short if k == op.inputs[3] else o for k, o in enumerate(good.main.operands))))
    as_input = replace(params, lifetime=L.SUBGRAPH_INPUT, location=None)
    yield "params not constant", replace(good, main=replace(
        good.main, operands=tuple(as_input if k == op.inputs[3] else o
                                  for k, o in enumerate(good.main.operands)),
        input_indexes=good.main.input_indexes + (op.inputs[3],)))


@pytest.mark.parametrize("what,model", list(_bad_models()), ids=[w for w, _ in _bad_models()])
async def test_malformed_extension_input_is_invalid_argument(what, model):
    dev = MediapipeDevice()
    assert await dev.supported_operations(model) == [False]
    with pytest.raises(NnrtError) as e:
        await dev.prepare_model(model)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT, e.value.message


async def test_an_input_that_does_not_fit_the_weights_is_invalid_argument():
    w = np.ones((2, 2, 2, 3), np.float32)
    model = mediapipe_model([1, 0, 0, 0], w, np.zeros(2, np.float32),
                            mp.PARAMS_FORMAT.pack(1, 2, 2)).hal_model
    prepared = await MediapipeDevice().prepare_model(model)
    x = np.ones((1, 2, 2, 4), np.float32)
    out = np.zeros((1, 4, 4, 2), np.float32)
    request = Request((RequestArgument(False, DataLocation(0, 0, x.nbytes), x.shape),),
                      (RequestArgument(False, DataLocation(1, 0, out.nbytes)),),
                      (x.view(np.uint8).reshape(-1), out.view(np.uint8).reshape(-1)))
    result = prepared.execute_synchronously(request)
    assert result.status == ErrorStatus.INVALID_ARGUMENT, result.message
    x = np.ones((1, 2, 2, 3), np.float32)
    request = replace(request, pools=(x.view(np.uint8).reshape(-1), request.pools[1]),
                      inputs=(RequestArgument(False, DataLocation(0, 0, x.nbytes), x.shape),))
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    np.testing.assert_array_equal(out, np.full((1, 4, 4, 2), 3, np.float32))


# --- the importer ---------------------------------------------------------------------------

def test_the_importer_maps_convolution_2d_transpose_bias():
    hal = nnrt.tflite.load(SELFIE).hal_model
    ext = [op for op in hal.main.operations if op.type.is_extension]
    assert [op.type.name for op in ext] == [f"{mp.NAME}:CONVOLUTION_2D_TRANSPOSE_BIAS"]
    params = hal.main.operands[ext[0].inputs[3]]
    assert mp.PARAMS_FORMAT.unpack(bytes(hal.constant_bytes(params))) == (1, 2, 2)
    assert hal.main.operands[ext[0].outputs[0]].dimensions == (1, 256, 256, 1)


def test_an_unknown_custom_op_is_refused_by_name():
    data = SELFIE.read_bytes().replace(b"Convolution2DTransposeBias",
                                       b"Convolution2DTransposeBiaZ")
    with pytest.raises(NnrtError, match="custom op 'Convolution2DTransposeBiaZ'") as e:
        nnrt.tflite.load(data)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


async def test_selfie_custom_op_alone_matches_float64(allow_this_app):
    """The op with the file's own weights, bias and options, on a random input."""
    file = read(SELFIE.read_bytes(), SELFIE.name)
    graph = file.graphs[0]
    (k,) = [k for k, op in enumerate(graph.operators) if op.name.startswith("CUSTOM:")]
    custom = graph.operators[k]
    producers = [j for j, op in enumerate(graph.operators)
                 if set(op.outputs) & set(custom.inputs[1:])]
    model = load_operators(file, 0, producers + [k])
    x = np.random.default_rng(3).uniform(0, 4, (1, 128, 128, 16)).astype(np.float32)
    async with nnrt.Runtime(devices=[ReferenceDevice(), MediapipeDevice()]) as rt:
        compiled = await rt.compile(model)
        assert "mediapipe" in [d.name for d in compiled.devices]
        got = (await compiled.execute([x])).outputs[-1]   # the others are the folded weights
    hal = model.hal_model
    (op,) = [op for op in hal.main.operations if op.type.is_extension]
    w, b = (hal.constant_value(hal.main.operands[i]) for i in op.inputs[1:3])
    want = transpose_conv_bias_f64(x, w, b, 1, 2, 2)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
