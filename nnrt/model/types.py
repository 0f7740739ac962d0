"""NNAPI enumerations (names and numeric codes of NeuralNetworks.h / HAL 1.3)
and the per-operand-type facts every layer needs (element dtype, byte size)."""
from __future__ import annotations

import enum

import numpy as np


class OperandType(enum.IntEnum):
    FLOAT32 = 0
    INT32 = 1
    UINT32 = 2
    TENSOR_FLOAT32 = 3
    TENSOR_INT32 = 4
    TENSOR_QUANT8_ASYMM = 5
    BOOL = 6
    TENSOR_QUANT16_SYMM = 7
    TENSOR_FLOAT16 = 8
    TENSOR_BOOL8 = 9
    FLOAT16 = 10
    TENSOR_QUANT8_SYMM_PER_CHANNEL = 11
    TENSOR_QUANT16_ASYMM = 12
    TENSOR_QUANT8_SYMM = 13
    TENSOR_QUANT8_ASYMM_SIGNED = 14
    SUBGRAPH = 15  # ANEURALNETWORKS_MODEL in the NDK header
    # Deprecated OEM types (NeuralNetworksOEM.h): opaque to the runtime, for
    # a driver that claims OEM_OPERATION. Extensions replace them.
    OEM = 10000
    TENSOR_OEM_BYTE = 10001

    @property
    def is_extension(self) -> bool:
        return False

    @property
    def is_tensor(self) -> bool:
        return self not in _SCALARS

    @property
    def is_scalar(self) -> bool:
        return self in _SCALARS

    @property
    def is_quantized(self) -> bool:
        return self in _QUANTIZED

    @property
    def dtype(self) -> np.dtype:
        """numpy element type of this operand type's buffer."""
        return _DTYPES[self]

    @property
    def element_size(self) -> int:
        return _DTYPES[self].itemsize


_SCALARS = frozenset({OperandType.FLOAT32, OperandType.INT32, OperandType.UINT32,
                      OperandType.BOOL, OperandType.FLOAT16, OperandType.SUBGRAPH,
                      OperandType.OEM})
_QUANTIZED = frozenset({OperandType.TENSOR_QUANT8_ASYMM, OperandType.TENSOR_QUANT8_ASYMM_SIGNED,
                        OperandType.TENSOR_QUANT8_SYMM, OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL,
                        OperandType.TENSOR_QUANT16_ASYMM, OperandType.TENSOR_QUANT16_SYMM})
_DTYPES = {
    OperandType.FLOAT32: np.dtype(np.float32),
    OperandType.INT32: np.dtype(np.int32),
    OperandType.UINT32: np.dtype(np.uint32),
    OperandType.TENSOR_FLOAT32: np.dtype(np.float32),
    OperandType.TENSOR_INT32: np.dtype(np.int32),
    OperandType.TENSOR_QUANT8_ASYMM: np.dtype(np.uint8),
    OperandType.BOOL: np.dtype(np.bool_),
    OperandType.TENSOR_QUANT16_SYMM: np.dtype(np.int16),
    OperandType.TENSOR_FLOAT16: np.dtype(np.float16),
    OperandType.TENSOR_BOOL8: np.dtype(np.bool_),
    OperandType.FLOAT16: np.dtype(np.float16),
    OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL: np.dtype(np.int8),
    OperandType.TENSOR_QUANT16_ASYMM: np.dtype(np.uint16),
    OperandType.TENSOR_QUANT8_SYMM: np.dtype(np.int8),
    OperandType.TENSOR_QUANT8_ASYMM_SIGNED: np.dtype(np.int8),
    OperandType.SUBGRAPH: np.dtype(np.uint32),
    # An OEM scalar is one opaque byte here; its meaning is the driver's.
    OperandType.OEM: np.dtype(np.uint8),
    OperandType.TENSOR_OEM_BYTE: np.dtype(np.uint8),
}


class OperationType(enum.IntEnum):
    # HAL 1.0
    ADD = 0
    AVERAGE_POOL_2D = 1
    CONCATENATION = 2
    CONV_2D = 3
    DEPTHWISE_CONV_2D = 4
    DEPTH_TO_SPACE = 5
    DEQUANTIZE = 6
    EMBEDDING_LOOKUP = 7
    FLOOR = 8
    FULLY_CONNECTED = 9
    HASHTABLE_LOOKUP = 10
    L2_NORMALIZATION = 11
    L2_POOL_2D = 12
    LOCAL_RESPONSE_NORMALIZATION = 13
    LOGISTIC = 14
    LSH_PROJECTION = 15
    LSTM = 16
    MAX_POOL_2D = 17
    MUL = 18
    RELU = 19
    RELU1 = 20
    RELU6 = 21
    RESHAPE = 22
    RESIZE_BILINEAR = 23
    RNN = 24
    SOFTMAX = 25
    SPACE_TO_DEPTH = 26
    SVDF = 27
    TANH = 28
    # HAL 1.1
    BATCH_TO_SPACE_ND = 29
    DIV = 30
    MEAN = 31
    PAD = 32
    SPACE_TO_BATCH_ND = 33
    SQUEEZE = 34
    STRIDED_SLICE = 35
    SUB = 36
    TRANSPOSE = 37
    # HAL 1.2
    ABS = 38
    ARGMAX = 39
    ARGMIN = 40
    AXIS_ALIGNED_BBOX_TRANSFORM = 41
    BIDIRECTIONAL_SEQUENCE_LSTM = 42
    BIDIRECTIONAL_SEQUENCE_RNN = 43
    BOX_WITH_NMS_LIMIT = 44
    CAST = 45
    CHANNEL_SHUFFLE = 46
    DETECTION_POSTPROCESSING = 47
    EQUAL = 48
    EXP = 49
    EXPAND_DIMS = 50
    GATHER = 51
    GENERATE_PROPOSALS = 52
    GREATER = 53
    GREATER_EQUAL = 54
    GROUPED_CONV_2D = 55
    HEATMAP_MAX_KEYPOINT = 56
    INSTANCE_NORMALIZATION = 57
    LESS = 58
    LESS_EQUAL = 59
    LOG = 60
    LOGICAL_AND = 61
    LOGICAL_NOT = 62
    LOGICAL_OR = 63
    LOG_SOFTMAX = 64
    MAXIMUM = 65
    MINIMUM = 66
    NEG = 67
    NOT_EQUAL = 68
    PAD_V2 = 69
    POW = 70
    PRELU = 71
    QUANTIZE = 72
    QUANTIZED_16BIT_LSTM = 73
    RANDOM_MULTINOMIAL = 74
    REDUCE_ALL = 75
    REDUCE_ANY = 76
    REDUCE_MAX = 77
    REDUCE_MIN = 78
    REDUCE_PROD = 79
    REDUCE_SUM = 80
    ROI_ALIGN = 81
    ROI_POOLING = 82
    RSQRT = 83
    SELECT = 84
    SIN = 85
    SLICE = 86
    SPLIT = 87
    SQRT = 88
    TILE = 89
    TOPK_V2 = 90
    TRANSPOSE_CONV_2D = 91
    UNIDIRECTIONAL_SEQUENCE_LSTM = 92
    UNIDIRECTIONAL_SEQUENCE_RNN = 93
    RESIZE_NEAREST_NEIGHBOR = 94
    # HAL 1.3
    QUANTIZED_LSTM = 95
    IF = 96
    WHILE = 97
    ELU = 98
    HARD_SWISH = 99
    FILL = 100
    RANK = 101
    # NNAPI feature level 6 (after HAL 1.3, from NeuralNetworks.h)
    BATCH_MATMUL = 102
    PACK = 103
    # NNAPI feature level 7
    MIRROR_PAD = 104
    REVERSE = 105
    # NeuralNetworksOEM.h: passed to a driver that claims it, never run by the runtime.
    OEM_OPERATION = 10000

    @property
    def is_extension(self) -> bool:
        return False

    @property
    def is_oem(self) -> bool:
        return self == OperationType.OEM_OPERATION


class OperandLifeTime(enum.IntEnum):
    """HAL 1.3 OperandLifeTime."""

    TEMPORARY_VARIABLE = 0
    SUBGRAPH_INPUT = 1
    SUBGRAPH_OUTPUT = 2
    CONSTANT_COPY = 3
    CONSTANT_REFERENCE = 4
    NO_VALUE = 5
    SUBGRAPH = 6


class FusedActivation(enum.IntEnum):
    NONE = 0
    RELU = 1
    RELU1 = 2
    RELU6 = 3


class PaddingScheme(enum.IntEnum):
    SAME = 1
    VALID = 2


class HalVersion(enum.IntEnum):
    """The HAL version (or, after HAL 1.3, the NNAPI feature level) an
    operation signature first appeared in."""

    V1_0 = 10
    V1_1 = 11
    V1_2 = 12
    V1_3 = 13
    FL6 = 16     # NNAPI feature level 6 (ANEURALNETWORKS_FEATURE_LEVEL_6)
    FL7 = 17     # NNAPI feature level 7

    @property
    def feature_level(self) -> int:
        """The NNAPI feature level of this version as NeuralNetworks.h codes
        it: the Android API level up to HAL 1.3, 1000000 + n from level 6."""
        return {10: 27, 11: 28, 12: 29, 13: 30, 16: 1000006, 17: 1000007}[int(self)]
