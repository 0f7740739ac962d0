"""The ``com.nnrt.mediapipe`` extension: mediapipe's TFLite custom operations.

Operation ``CONVOLUTION_2D_TRANSPOSE_BIAS`` (type within 0) is mediapipe's
``Convolution2DTransposeBias``, a transposed convolution whose bias is an
input, taking its parameters the way the TFLite custom op does:

* input 0: TENSOR_FLOAT32 [batches, height, width, depth_in] (NHWC)
* input 1: TENSOR_FLOAT32 weights [depth_out, filter_h, filter_w, depth_in] (OHWI)
* input 2: TENSOR_FLOAT32 bias [depth_out]
* input 3: ``TRANSPOSE_CONV_PARAMS`` (operand type 0 of this extension), a
  constant scalar of 12 bytes: TFLite's ``TfLiteTransposeConvParams``, three
  little-endian int32 ``padding`` (1 SAME, 2 VALID), ``stride_w``, ``stride_h``
  -- exactly the op's custom options in the .tflite file
* output 0: TENSOR_FLOAT32 [batches, out_h, out_w, depth_out] with
  ``out = in * stride`` for SAME and ``(in - 1) * stride + filter`` for VALID.

The next three are the version-2 kernels of mediapipe's ``Landmarks2TransformMatrix``,
``TransformTensorBilinear`` and ``TransformLandmarks`` (what mediapipe's own op
resolvers register; face_landmark_with_attention uses them to crop eye and lip
regions out of a feature map and to map the refined landmarks back). A *matrix*
is a TENSOR_FLOAT32 [1, 4, 4], row-major, mapping a point (x, y, 0, 1) of a
crop to the point of the source it comes from; only its first two rows are
read. Their parameters are NNAPI constants (scalars and an INT32 tensor),
the values of the op's flexbuffer custom options. Batches are 1, as in
mediapipe's kernels (they read batch 0 only).

``LANDMARKS_TO_TRANSFORM_MATRIX`` (type within 1): the matrix of a rotated
crop around a subset of landmarks.

* input 0: TENSOR_FLOAT32 [1, num_landmarks, 3] landmarks (x, y, z)
* input 1: TENSOR_INT32 [k], k >= 1, constant: the subset's landmark indices
* input 2, 3: INT32 constants: left and right rotation landmark indices
* input 4: FLOAT32 constant: the target rotation in radians
* input 5, 6: INT32 constants > 0: the crop's output height and width
* input 7, 8: FLOAT32 constants > 0: scale_x, scale_y of the crop
* output 0: TENSOR_FLOAT32 [1, 4, 4]: the rotation is ``target - atan2(right.y
  - left.y, right.x - left.x)``; rotated by it, the subset's bounding box
  (centre c, size w x h) becomes the crop, scaled by ``scale_x * w /
  output_width`` and ``scale_y * h / output_height``: the matrix is
  ``shift(c) @ rotate(-rotation) @ scale @ shift(-output_width / 2,
  -output_height / 2)``.

``TRANSFORM_TENSOR_BILINEAR`` (type within 2): sample a crop of a feature map.

* input 0: TENSOR_FLOAT32 [1, height, width, channels]
* input 1: TENSOR_FLOAT32 [1, 4, 4] matrix
* input 2, 3: INT32 constants > 0: output height and width
* output 0: TENSOR_FLOAT32 [1, output_height, output_width, channels]: output
  pixel (x, y) is input 0 sampled bilinearly at the matrix's image of the
  pixel centre (x + 0.5, y + 0.5) less 0.5 (mediapipe's align-corners
  correction); a point outside [0, width - 1] x [0, height - 1] gives 0.

``TRANSFORM_LANDMARKS`` (type within 3): map landmarks through a matrix.

* input 0: TENSOR_FLOAT32 [1, num_landmarks, d], d 2 (x, y) or 3 (x, y, z)
* input 1: TENSOR_FLOAT32 [1, 4, 4] matrix
* output 0: TENSOR_FLOAT32 like input 0: (x, y) mapped by the matrix, z kept.
"""
from __future__ import annotations

import struct

from ..model.extensions import Extension, ExtensionOperandTypeInfo, define_extension

NAME = "com.nnrt.mediapipe"

# Operand types within the extension.
TRANSPOSE_CONV_PARAMS = 0
PARAMS_FORMAT = struct.Struct("<3i")

# Operation types within the extension.
CONVOLUTION_2D_TRANSPOSE_BIAS = 0
LANDMARKS_TO_TRANSFORM_MATRIX = 1
TRANSFORM_TENSOR_BILINEAR = 2
TRANSFORM_LANDMARKS = 3

EXTENSION = define_extension(Extension(
    NAME,
    operand_types=(ExtensionOperandTypeInfo(TRANSPOSE_CONV_PARAMS, is_tensor=False,
                                            byte_size=PARAMS_FORMAT.size),),
    operation_names=((CONVOLUTION_2D_TRANSPOSE_BIAS, "CONVOLUTION_2D_TRANSPOSE_BIAS"),
                     (LANDMARKS_TO_TRANSFORM_MATRIX, "LANDMARKS_TO_TRANSFORM_MATRIX"),
                     (TRANSFORM_TENSOR_BILINEAR, "TRANSFORM_TENSOR_BILINEAR"),
                     (TRANSFORM_LANDMARKS, "TRANSFORM_LANDMARKS")),
))

# TFLite custom op code -> operation type within the extension.
CUSTOM_OPS = {
    "Convolution2DTransposeBias": CONVOLUTION_2D_TRANSPOSE_BIAS,
    "Landmarks2TransformMatrix": LANDMARKS_TO_TRANSFORM_MATRIX,
    "TransformTensorBilinear": TRANSFORM_TENSOR_BILINEAR,
    "TransformLandmarks": TRANSFORM_LANDMARKS,
}
