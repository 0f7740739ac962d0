"""The com.nnrt.tflite extension's operations (nnrt/ops/tflite_builtins.py),
built by hand as an app would: validation, shapes (dynamic for RANGE of
run-time ends) and kernels on the reference device. The importer's use of
them is tested in test_tflite_import.py against LiteRT."""
import numpy as np
import pytest

import nnrt
from nnrt import OperandType as T
from nnrt.errors import ErrorStatus
from nnrt.extensions import tflite as ext


def _rfft2d_model(shape, fft_length) -> nnrt.Model:
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, shape)
    length = m.add_operand(T.TENSOR_INT32, [2])
    m.set_operand_value(length, np.array(fft_length, np.int32))
    y = m.add_operand(T.TENSOR_FLOAT32)
    m.add_operation(m.get_extension_operation_type(ext.NAME, ext.RFFT2D), [x, length], [y])
    m.identify_inputs_and_outputs([x], [y])
    return m.finish()


def _range_model(kind: T, start, delta) -> nnrt.Model:
    m = nnrt.Model()
    ends = []
    for value in (start, None, delta):
        operand = m.add_operand(kind, [1])
        if value is not None:
            m.set_operand_value(operand, np.array([value], kind.dtype))
        ends.append(operand)
    out = m.add_operand(kind, [0])
    m.add_operation(m.get_extension_operation_type(ext.NAME, ext.RANGE), ends, [out])
    m.identify_inputs_and_outputs([ends[1]], [out])
    return m.finish()


@pytest.mark.parametrize("shape,fft_length", [((2, 3, 10), (4, 8)), ((5, 16), (8, 32)),
                                              ((1, 2, 1, 4, 4), (4, 4))])
def test_rfft2d_pads_or_crops_to_fft_length_and_interleaves_real_and_imaginary(shape,
                                                                                fft_length):
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    result = nnrt.run(_rfft2d_model(shape, fft_length), [x])
    want = np.fft.rfft2(x.astype(np.float64), s=fft_length)
    (got,) = result.outputs
    assert got.shape == shape[:-2] + (fft_length[0], 2 * (fft_length[1] // 2 + 1))
    assert np.abs(got[..., 0::2] - want.real).max() <= 1e-6 * np.abs(want).max()
    assert np.abs(got[..., 1::2] - want.imag).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("fft_length", [(3, 8), (4, 0)])
def test_rfft2d_refuses_lengths_that_are_not_powers_of_two(fft_length):
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.run(_rfft2d_model((4, 8), fft_length), [np.zeros((4, 8), np.float32)])
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT
    assert "powers of two" in info.value.message


@pytest.mark.parametrize("kind,start,delta,limit,want", [
    (T.TENSOR_INT32, 7, -2, 0, [7, 5, 3, 1]),
    (T.TENSOR_INT32, -3, 4, 6, [-3, 1, 5]),
    (T.TENSOR_FLOAT32, 0.5, 0.25, 1.4, [0.5, 0.75, 1.0, 1.25])])
def test_range_length_comes_from_the_values_at_run_time(kind, start, delta, limit, want):
    result = nnrt.run(_range_model(kind, start, delta), [np.array([limit], kind.dtype)])
    assert result.output_shapes == [(len(want),)]
    np.testing.assert_array_equal(result.outputs[0], np.array(want, kind.dtype))


@pytest.mark.parametrize("delta,limit,reason", [(0, 5, "delta is 0"),
                                                (1, -5, "moves away from limit")])
def test_range_fails_the_execution_where_tflite_does(delta, limit, reason):
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.run(_range_model(T.TENSOR_INT32, 0, delta), [np.array([limit], np.int32)])
    assert reason in info.value.message
