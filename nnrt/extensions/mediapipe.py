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

EXTENSION = define_extension(Extension(
    NAME,
    operand_types=(ExtensionOperandTypeInfo(TRANSPOSE_CONV_PARAMS, is_tensor=False,
                                            byte_size=PARAMS_FORMAT.size),),
    operation_names=((CONVOLUTION_2D_TRANSPOSE_BIAS, "CONVOLUTION_2D_TRANSPOSE_BIAS"),),
))

# TFLite custom op code -> operation type within the extension.
CUSTOM_OPS = {"Convolution2DTransposeBias": CONVOLUTION_2D_TRANSPOSE_BIAS}
