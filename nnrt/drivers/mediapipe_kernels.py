"""numpy kernels of mediapipe's landmark operations (``com.nnrt.mediapipe``
types 1 to 3, defined in ``nnrt.extensions.mediapipe``).

They compute what version 2 of mediapipe's CPU kernels computes
(mediapipe/util/tflite/operations/landmarks_to_transform_matrix.cc,
transform_tensor_bilinear.cc, transform_landmarks.cc), in the same float32
steps: every product and sum the C++ code does in ``float`` is rounded to
float32 here, and the few it does in ``double`` (a ``1.0 - t`` weight, the
align-corners shift) in float64. Sines, cosines and the arctangent are taken
in float64 and rounded once, as the C library's float functions round.
Arguments are checked by the driver before these run.
"""
from __future__ import annotations

import numpy as np

_F32 = np.float32


def _mat4_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for 4x4 float32 matrices, each sum accumulated left to right
    in float32 from 0 (mediapipe's ``Mat4::operator*=``)."""
    out = np.zeros((4, 4), _F32)
    for k in range(4):
        out = out + np.multiply.outer(a[:, k], b[k, :]).astype(_F32)
    return out


def _rotate(c, s, x, y):
    """First two rows of ``[[c, -s, 0], [s, c, 0], [0, 0, 1]] @ (x, y, 1)``,
    summed in float32 from 0 (``Mat3 * float3``)."""
    zero = _F32(0)
    rx = (c * x + (-s) * y) + zero * _F32(1)
    ry = (s * x + c * y) + zero * _F32(1)
    return rx, ry


def landmarks_to_transform_matrix(landmarks: np.ndarray, subset: np.ndarray, left: int,
                                  right: int, target_rotation: float, output_height: int,
                                  output_width: int, scale_x: float,
                                  scale_y: float) -> np.ndarray:
    """The [1, 4, 4] matrix of the crop around ``landmarks[0, subset]``
    (``landmarks`` [1, n, 3]), rotated so that the left-to-right landmark
    line makes ``target_rotation`` with the x axis."""
    points = landmarks.reshape(-1, landmarks.shape[-1]).astype(_F32, copy=False)
    (lx, ly), (rx, ry) = points[left, :2], points[right, :2]
    rotation = _F32(np.arctan2(np.float64(_F32(ry - ly)), np.float64(_F32(rx - lx))))
    rotation = _F32(_F32(target_rotation) - rotation)
    c, s = _F32(np.cos(np.float64(rotation))), _F32(np.sin(np.float64(rotation)))
    xs, ys = _rotate(c, s, points[subset, 0], points[subset, 1])
    x_max, x_min, y_max, y_min = xs.max(), xs.min(), ys.max(), ys.min()
    crop_width, crop_height = _F32(x_max - x_min), _F32(y_max - y_min)
    centre_x, centre_y = _F32(x_min + x_max) / _F32(2), _F32(y_min + y_max) / _F32(2)
    ci, si = _F32(np.cos(np.float64(-rotation))), _F32(np.sin(np.float64(-rotation)))
    crop_x, crop_y = _rotate(ci, si, centre_x, centre_y)

    t = np.eye(4, dtype=_F32)
    shift = np.eye(4, dtype=_F32)
    shift[0, 3], shift[1, 3] = crop_x, crop_y
    t = _mat4_mul(t, shift)
    r = -rotation
    cr, sr = _F32(np.cos(np.float64(r))), _F32(np.sin(np.float64(r)))
    rotate = np.eye(4, dtype=_F32)
    rotate[:2, :2] = [[cr, -sr], [sr, cr]]
    t = _mat4_mul(t, rotate)
    scale = np.eye(4, dtype=_F32)
    scale[0, 0] = _F32(_F32(scale_x) * crop_width) / _F32(output_width)
    scale[1, 1] = _F32(_F32(scale_y) * crop_height) / _F32(output_height)
    t = _mat4_mul(t, scale)
    shift2 = np.eye(4, dtype=_F32)
    shift2[0, 3], shift2[1, 3] = -(output_width / 2.0), -(output_height / 2.0)
    return _mat4_mul(t, shift2).reshape(1, 4, 4)


def _rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = matrix.reshape(-1).astype(_F32, copy=False)
    return m[0:4].copy(), m[4:8].copy()


def _dot(row: np.ndarray, x, y):
    """``row . (x, y, 0, 1)`` summed left to right in float32 (``DotProduct``)."""
    return ((row[0] * x + row[1] * y) + row[2] * _F32(0)) + row[3] * _F32(1)


def transform_tensor_bilinear(data: np.ndarray, matrix: np.ndarray, output_height: int,
                              output_width: int) -> np.ndarray:
    """Sample ``data`` [1, h, w, c] bilinearly on the crop ``matrix`` maps
    from: [1, output_height, output_width, c]."""
    _, h, w, _ = data.shape
    x_row, y_row = _rows(matrix)
    # The align-corners correction, in double as mediapipe writes it.
    for row in (x_row, y_row):
        row[3] = _F32(np.float64(row[3]) + (np.float64(row[0]) * 0.5
                                            + np.float64(row[1]) * 0.5 - 0.5))
    oy, ox = np.meshgrid(np.arange(output_height, dtype=_F32),
                         np.arange(output_width, dtype=_F32), indexing="ij")
    tx, ty = _dot(x_row, ox, oy), _dot(y_row, ox, oy)
    # NaN coordinates (a degenerate matrix) count as outside: mediapipe's
    # comparison lets them through to an undefined float-to-int conversion.
    inside = (tx >= 0) & (tx <= w - 1) & (ty >= 0) & (ty <= h - 1)
    tx, ty = np.where(inside, tx, _F32(0)), np.where(inside, ty, _F32(0))
    fx, fy = np.floor(tx), np.floor(ty)
    right, lower = (tx - fx)[..., None], (ty - fy)[..., None]
    x0, y0 = fx.astype(np.intp), fy.astype(np.intp)
    padded = np.zeros((h + 1, w + 1, data.shape[3]), _F32)   # reads past the edge give 0
    padded[:h, :w] = data[0]
    q11, q21 = padded[y0, x0], padded[y0, x0 + 1]
    q12, q22 = padded[y0 + 1, x0], padded[y0 + 1, x0 + 1]
    r64, l64 = 1.0 - right.astype(np.float64), 1.0 - lower.astype(np.float64)
    upper = (r64 * q11 + (right * q21).astype(np.float64)).astype(_F32)
    below = (r64 * q12 + (right * q22).astype(np.float64)).astype(_F32)
    out = ((lower * below).astype(np.float64) + l64 * upper).astype(_F32)
    return np.where(inside[..., None], out, _F32(0))[None]


def transform_landmarks(landmarks: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``landmarks`` [1, n, 2 or 3] with (x, y) mapped through ``matrix``, z kept."""
    x_row, y_row = _rows(matrix)
    out = landmarks.astype(_F32, copy=True)
    x, y = landmarks[..., 0].astype(_F32), landmarks[..., 1].astype(_F32)
    out[..., 0], out[..., 1] = _dot(x_row, x, y), _dot(y_row, x, y)
    return out
