"""com.nnrt.mediapipe's landmark operations (LANDMARKS_TO_TRANSFORM_MATRIX,
TRANSFORM_TENSOR_BILINEAR, TRANSFORM_LANDMARKS): the driver on cases worked
out by hand from mediapipe's definition, its refusal of malformed operations,
the importer's mapping of face_landmark_with_attention's custom ops, and each
of its 11 custom ops against mediapipe's own kernels on the values they saw
(recorded by scripts/record_face_landmark_attention.py). The whole model is
in tests/integration/test_extension_service.py."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flatbuffers import flexbuffers

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, NnrtError, OperandType as T
from nnrt.drivers.mediapipe import MediapipeDevice
from nnrt.extensions import mediapipe as mp
from nnrt.model.graph import HalModel
from nnrt.model.types import OperandLifeTime as L
from nnrt.tflite import load_operators
from nnrt.tflite.reader import read

DATA = Path(__file__).resolve().parents[1] / "data" / "mediapipe"
FACE = DATA / "face_landmark_with_attention.tflite"
EPS = np.finfo(np.float32).eps


def op_model(type_within, inputs, params, out_dims=(), dynamic=(), constant=()):
    """One com.nnrt.mediapipe operation: ``inputs`` (arrays) are model inputs
    of their shapes (0 where ``dynamic`` lists their position; constants
    where ``constant`` does), ``params`` constants given as (OperandType, value)."""
    m = nnrt.Model()
    ins, operands = [], []
    for k, x in enumerate(inputs):
        dims = [0] * x.ndim if k in dynamic else list(x.shape)
        operands.append(m.add_operand(T.TENSOR_FLOAT32, dims))
        if k in constant:
            m.set_operand_value(operands[-1], x)
        else:
            ins.append(operands[-1])
    for kind, value in params:
        value = np.asarray(value, np.int32 if kind in (T.INT32, T.TENSOR_INT32) else np.float32)
        index = m.add_operand(kind, list(value.shape) if kind.name.startswith("TENSOR") else [])
        m.set_operand_value(index, value)
        operands.append(index)
    out = m.add_operand(T.TENSOR_FLOAT32, list(out_dims))
    m.add_operation(m.get_extension_operation_type(mp.NAME, type_within), operands, [out])
    m.identify_inputs_and_outputs(ins, [out])
    return m.finish()


async def run(model, inputs):
    async with nnrt.Runtime(devices=[MediapipeDevice()]) as rt:
        compiled = await rt.compile(model)
        return (await compiled.execute(inputs)).outputs[0]


def l2tm_params(subset, left, right, target=0.0, height=16, width=16, sx=1.5, sy=1.5):
    return [(T.TENSOR_INT32, subset), (T.INT32, left), (T.INT32, right), (T.FLOAT32, target),
            (T.INT32, height), (T.INT32, width), (T.FLOAT32, sx), (T.FLOAT32, sy)]


def landmarks(points):
    """[1, n, 3] landmarks at ``points`` (x, y), z = 7."""
    points = np.asarray(points, np.float32)
    return np.concatenate([points, np.full((len(points), 1), 7, np.float32)], 1)[None]


# --- LANDMARKS_TO_TRANSFORM_MATRIX, by hand ------------------------------------------------

async def test_the_matrix_of_an_upright_box():
    # Left (10, 40) to right (30, 40) is level: rotation 0. The subset's box is
    # x 10..30, y 20..60: centre (20, 40), 20 x 40; scaled by 1.5 onto a 16 x 16
    # crop, a crop pixel is 1.5 * 20 / 16 = 1.875 by 1.5 * 40 / 16 = 3.75, and
    # the crop's centre (8, 8) is the box's centre: translation 20 - 8 * 1.875,
    # 40 - 8 * 3.75. Landmark 4 is outside the subset and moves nothing.
    x = landmarks([(10, 20), (30, 20), (10, 60), (30, 60), (500, -500), (10, 40), (30, 40)])
    got = await run(op_model(mp.LANDMARKS_TO_TRANSFORM_MATRIX, [x],
                             l2tm_params([0, 1, 2, 3, 5, 6], 5, 6)), [x])
    want = np.array([[1.875, 0, 0, 5], [0, 3.75, 0, 10], [0, 0, 1, 0], [0, 0, 0, 1]], np.float32)
    np.testing.assert_array_equal(got, want[None])


async def test_the_matrix_follows_the_line_from_left_to_right():
    # Left (0, 0), right (0, 10): the line points down (+y), rotation
    # 0 - pi/2. Rotated by it the subset (0,0) (0,10) (4,0) (4,10) is
    # x 0..10, y -4..0: 10 x 4, centre (5, -2), which rotated back is (2, 5).
    # On a 10 x 10 crop at scale 1 a crop pixel is 1 by 0.4; the crop's x axis
    # runs along the line (+y of the input), its y axis along -x:
    # [[0, -0.4, 0, 2 + 2], [1, 0, 0, 5 - 5]].
    x = landmarks([(0, 0), (0, 10), (4, 0), (4, 10)])
    got = await run(op_model(mp.LANDMARKS_TO_TRANSFORM_MATRIX, [x],
                             l2tm_params([0, 1, 2, 3], 0, 1, height=10, width=10, sx=1, sy=1)),
                    [x])
    want = np.array([[0, -0.4, 0, 4], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], np.float32)
    np.testing.assert_allclose(got[0], want, atol=1e-6)   # cos(pi/2) in float32 is -4.4e-8
    # The target rotation turns the crop with it: a target of pi/2 makes the
    # rotation 0, the box the plain one (4 x 10 around (2, 5)).
    got = await run(op_model(mp.LANDMARKS_TO_TRANSFORM_MATRIX, [x],
                             l2tm_params([0, 1, 2, 3], 0, 1, np.pi / 2, 10, 10, 1, 1)), [x])
    want = np.array([[0.4, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], np.float32)
    np.testing.assert_allclose(got[0], want, atol=1e-6)


# --- TRANSFORM_TENSOR_BILINEAR, by hand ----------------------------------------------------

def ramp(h=3, w=4, c=2):
    """[1, h, w, c]: 10 * y + x in channel 0, its negative in channel 1 --
    a linear function, which bilinear sampling reproduces exactly."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    return np.stack([10 * y + x, -(10 * y + x)], -1)[None][..., :c]


def matrix(x_row, y_row):
    m = np.eye(4, dtype=np.float32)
    m[0], m[1] = x_row, y_row
    return m[None]


async def test_the_identity_crop_copies_and_what_falls_outside_is_zero():
    # Pixel centres map to themselves (the align-corners shift cancels): the
    # crop reads input pixels; its column 4 and row 3 lie past the input's
    # last pixel (3, 2) and are 0. A point exactly on the last pixel is inside.
    data, m = ramp(), matrix([1, 0, 0, 0], [0, 1, 0, 0])
    got = await run(op_model(mp.TRANSFORM_TENSOR_BILINEAR, [data, m],
                             [(T.INT32, 4), (T.INT32, 5)], [1, 4, 5, 2]), [data, m])
    want = np.zeros((1, 4, 5, 2), np.float32)
    want[:, :3, :4] = data
    np.testing.assert_array_equal(got, want)


async def test_a_scaled_and_shifted_crop_samples_between_pixels():
    # x = 0.5 * (ox + 0.5) - 0.5 + 0.5 = 0.5 * ox + 0.25, y = oy + 1 (rows 1..2):
    # the ramp there is 10 * (oy + 1) + 0.5 * ox + 0.25; ox 6 and 7 (x 3.25,
    # 3.75) and oy 2 (y 3) lie past the last column and row: 0.
    data = ramp()
    m = matrix([0.5, 0, 0, 0.5], [0, 1, 0, 1])
    got = await run(op_model(mp.TRANSFORM_TENSOR_BILINEAR, [data, m],
                             [(T.INT32, 3), (T.INT32, 8)]), [data, m])
    oy, ox = np.mgrid[0:3, 0:8].astype(np.float32)
    want = 10 * (oy + 1) + 0.5 * ox + 0.25
    want[(ox > 5) | (oy > 1)] = 0
    np.testing.assert_array_equal(got[0, ..., 0], want)
    np.testing.assert_array_equal(got[0, ..., 1], -want)


# --- TRANSFORM_LANDMARKS, by hand ----------------------------------------------------------

@pytest.mark.parametrize("d,matrix_constant", [(2, False), (3, False), (3, True)])
async def test_landmarks_are_mapped_and_z_is_kept(d, matrix_constant):
    x = np.array([[[1, 2, 5], [3, 4, -6]]], np.float32)[..., :d]
    m = matrix([2, 0.5, 100, 1], [0, 3, 100, -1])    # column 2 multiplies z = 0: no effect
    model = op_model(mp.TRANSFORM_LANDMARKS, [x, m], [], dynamic=(0,),
                     constant=(1,) if matrix_constant else ())
    got = await run(model, [x] if matrix_constant else [x, m])
    want = np.array([[[2 + 1 + 1, 6 - 1, 5], [6 + 2 + 1, 12 - 1, -6]]], np.float32)[..., :d]
    np.testing.assert_array_equal(got, want)


# --- malformed operations ------------------------------------------------------------------

def _bad_models():
    """(what, model, what the refusal says)."""
    x = landmarks([(0, 0), (0, 10), (4, 0), (4, 10)])
    data, m = ramp(), matrix([1, 0, 0, 0], [0, 1, 0, 0])
    l2tm, ttb, tl = (mp.LANDMARKS_TO_TRANSFORM_MATRIX, mp.TRANSFORM_TENSOR_BILINEAR,
                     mp.TRANSFORM_LANDMARKS)
    size = [(T.INT32, 4), (T.INT32, 5)]
    yield ("subset index past the landmarks", op_model(l2tm, [x], l2tm_params([0, 4], 0, 1)),
           "landmark index 4 is outside the 4 landmarks")
    yield ("negative rotation index", op_model(l2tm, [x], l2tm_params([0, 1], -1, 1),
                                               dynamic=(0,)),
           "left_rotation_idx landmark index -1")
    yield ("zero output height", op_model(l2tm, [x], l2tm_params([0, 1], 0, 1, height=0)),
           "input 5 (output_height) must be > 0, got 0")
    yield ("negative scale", op_model(l2tm, [x], l2tm_params([0, 1], 0, 1, sx=-1)),
           "input 7 (scale_x) must be > 0")
    yield ("2D landmarks", op_model(l2tm, [x[..., :2]], l2tm_params([0, 1], 0, 1)),
           "input 0 (the landmarks) must have shape [1, n, 3]")
    yield ("eight parameters", op_model(l2tm, [x], l2tm_params([0, 1], 0, 1)[:-1]),
           "takes 9 inputs and 1 output, got 8")
    yield ("3x3 matrix", op_model(ttb, [data, m[:, :3, :3]], size),
           "input 1 (the matrix) must have shape [1, 4, 4]")
    yield ("declared crop size", op_model(ttb, [data, m], size, [1, 5, 4, 2]),
           "output declared [1, 5, 4, 2], the operation produces [1, 4, 5, 2]")
    yield ("rank-3 data", op_model(ttb, [data[0], m], size), "input 0 must have rank 4")
    yield ("output size as float", op_model(ttb, [data, m], [(T.FLOAT32, 4), (T.INT32, 5)]),
           "input 2 must be INT32, got FLOAT32")
    yield ("4D landmarks", op_model(tl, [np.zeros((1, 5, 4), np.float32), m], []),
           "landmarks of 4 coordinates")
    yield ("batch of 2", op_model(tl, [np.zeros((2, 5, 2), np.float32), m], []),
           "input 0 (the landmarks) must have shape [1, n, d]")
    hal = op_model(tl, [x, m], []).hal_model
    op = hal.main.operations[0]
    omitted = replace(hal.main.operands[op.inputs[1]], lifetime=L.NO_VALUE, location=None)
    yield ("omitted matrix", replace(hal, main=replace(
        hal.main, operands=tuple(omitted if k == op.inputs[1] else o
                                 for k, o in enumerate(hal.main.operands)),
        input_indexes=hal.main.input_indexes[:1])), "input 1 is omitted")
    hal = op_model(ttb, [data, m], size).hal_model
    op = hal.main.operations[0]
    as_input = replace(hal.main.operands[op.inputs[2]], lifetime=L.SUBGRAPH_INPUT, location=None)
    yield ("size not constant", replace(hal, main=replace(
        hal.main, operands=tuple(as_input if k == op.inputs[2] else o
                                 for k, o in enumerate(hal.main.operands)),
        input_indexes=hal.main.input_indexes + (op.inputs[2],))),
        "input 2 (a parameter) must be a constant")


@pytest.mark.parametrize("what,model,message", list(_bad_models()),
                         ids=[w for w, _, _ in _bad_models()])
async def test_a_malformed_landmark_operation_is_invalid_argument(what, model, message):
    hal = model if isinstance(model, HalModel) else model.hal_model
    dev = MediapipeDevice()
    assert await dev.supported_operations(hal) == [False]
    with pytest.raises(NnrtError) as e:
        await dev.prepare_model(hal)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert e.value.message.startswith("operation 0 (com.nnrt.mediapipe:")
    assert message in e.value.message


async def test_landmarks_of_unknown_count_are_checked_when_they_come():
    x = landmarks([(0, 0), (0, 10), (4, 0), (4, 10)])
    model = op_model(mp.LANDMARKS_TO_TRANSFORM_MATRIX, [x], l2tm_params([0, 5], 0, 1),
                     dynamic=(0,))
    with pytest.raises(NnrtError, match="landmark index 5 is outside the 4 landmarks") as e:
        await run(model, [x])
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


# --- the importer and mediapipe's own kernels ----------------------------------------------

def test_the_importer_maps_the_landmark_custom_ops():
    hal = nnrt.tflite.load(FACE).hal_model
    ext = [op for op in hal.main.operations if op.type.is_extension]
    names = [op.type.name.split(":")[1] for op in ext]
    assert names == ["LANDMARKS_TO_TRANSFORM_MATRIX"] * 3 + ["TRANSFORM_TENSOR_BILINEAR"] * 3 \
        + ["TRANSFORM_LANDMARKS"] * 5
    # The lips' crop: its flexbuffer options as NNAPI constants.
    value = [hal.constant_value(hal.main.operands[i]) for i in ext[0].inputs[1:]]
    assert len(value[0]) == 80 and value[0][:3].tolist() == [61, 146, 91]
    assert value[1:] == [61, 291, 0.0, 16, 16, 1.5, 1.5]
    assert [hal.constant_value(hal.main.operands[i]) for i in ext[3].inputs[2:]] == [16, 16]
    assert hal.main.operands[ext[3].outputs[0]].dimensions == (1, 16, 16, 32)


def _face_custom_op(name: str):
    file = read(FACE.read_bytes(), FACE.name)
    (k, *_) = [k for k, op in enumerate(file.graphs[0].operators) if op.name == f"CUSTOM:{name}"]
    return file, k


@pytest.mark.parametrize("change,message", [
    # Version 1's options (mediapipe's V1 parser's keys): refused for the version.
    (dict(version=1, custom_options=bytes(flexbuffers.Dumps(dict(
        input_hw=[48, 48], output_hw=[16, 16], dimensions=3, landmarks_range=192,
        bbox_size_multiplier=1.5, left_rotation_idx=61, right_rotation_idx=291,
        subset=[61, 291])))), "is version 1; com.nnrt.mediapipe implements version 2"),
    (dict(custom_options=b"\x00\x01garbage"), "custom options are not a flexbuffer"),
])
def test_the_importer_refuses_what_mediapipe_does_not_define(change, message):
    file, k = _face_custom_op("Landmarks2TransformMatrix")
    graph = file.graphs[0]
    graph.operators[k] = replace(graph.operators[k], **change)
    with pytest.raises(NnrtError, match=message) as e:
        load_operators(file, 0, [k])
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_the_importer_names_a_missing_option():
    file, k = _face_custom_op("TransformTensorBilinear")
    graph = file.graphs[0]
    graph.operators[k] = replace(graph.operators[k],
                                 custom_options=bytes(flexbuffers.Dumps({"output_height": 16})))
    with pytest.raises(NnrtError, match="custom option 'output_width' must be an int, got None"):
        load_operators(file, 0, [k])


async def test_each_custom_op_of_face_landmark_with_attention_computes_what_mediapipe_does():
    """Each of the model's 11 custom ops alone (imported from the file), on
    the values its inputs had in mediapipe's run of the model, gives what
    mediapipe's kernel gave. The kernels take the same float32 steps, so the
    bilinear sampling and the landmark mapping are bit for bit; the matrix
    goes through sine, cosine and arctangent, whose last bit is the math
    library's: within 8 float32 ulps of its largest entry."""
    recorded = np.load(DATA / "face_landmark_with_attention.mediapipe.npz")
    file = read(FACE.read_bytes(), FACE.name)
    custom = [op for op in file.graphs[0].operators if op.name.startswith("CUSTOM:")]
    assert len(custom) == 11
    async with nnrt.Runtime(devices=[MediapipeDevice()]) as rt:
        for op in custom:
            compiled = await rt.compile(load_operators(file, 0, [op.index]))
            inputs = [recorded[f"tensor{t}"] for t in op.inputs]
            got = (await compiled.execute(inputs)).outputs[0]
            want = recorded[f"tensor{op.outputs[0]}"]
            assert got.shape == want.shape, op.name
            if op.name == "CUSTOM:Landmarks2TransformMatrix":
                assert np.max(np.abs(got - want)) <= 8 * EPS * np.max(np.abs(want)), op.name
            else:
                np.testing.assert_array_equal(got, want, err_msg=op.name)


async def test_a_crop_too_large_to_allocate_fails_the_execution_not_the_driver():
    data, m = ramp(), matrix([1, 0, 0, 0], [0, 1, 0, 0])
    model = op_model(mp.TRANSFORM_TENSOR_BILINEAR, [data, m],
                     [(T.INT32, 2**24), (T.INT32, 2**24)])   # 4 PiB: past any address space
    with pytest.raises(NnrtError) as e:
        await run(model, [data, m])
    assert e.value.status == ErrorStatus.GENERAL_FAILURE
    assert "MemoryError" in e.value.message
