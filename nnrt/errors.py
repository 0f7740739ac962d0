"""One error tree for nnrt: every failure carries an ErrorStatus.

Inside nnrt code raises :class:`NnrtError` (or a subclass) with the status and
a message that names the operand, operation or message at fault; the public
API lets it through unchanged, so callers catch exactly one exception type.
"""
from __future__ import annotations

import enum


class ErrorStatus(enum.IntEnum):
    """HAL 1.3 ErrorStatus (numeric values as in the HAL)."""

    NONE = 0
    DEVICE_UNAVAILABLE = 1
    GENERAL_FAILURE = 2
    OUTPUT_INSUFFICIENT_SIZE = 3
    INVALID_ARGUMENT = 4
    MISSED_DEADLINE_TRANSIENT = 5
    MISSED_DEADLINE_PERSISTENT = 6
    RESOURCE_EXHAUSTED_TRANSIENT = 7
    RESOURCE_EXHAUSTED_PERSISTENT = 8
    DEAD_OBJECT = 10000


# The statuses every execution compares with, bound once for its hot paths
# (imported as globals): on Python 3.11 reading a member off its Enum class
# costs ~120 ns (EnumType's __getattr__ hook, gone in 3.12), a global ~10 ns
# (issue 16).
STATUS_NONE = ErrorStatus.NONE
STATUS_INSUFFICIENT = ErrorStatus.OUTPUT_INSUFFICIENT_SIZE


class ResultCode(enum.IntEnum):
    """NeuralNetworks.h result codes, as the app-facing builder reports them."""

    NO_ERROR = 0
    OUT_OF_MEMORY = 1
    INCOMPLETE = 2
    UNEXPECTED_NULL = 3
    BAD_DATA = 4
    OP_FAILED = 5
    BAD_STATE = 6
    UNMAPPABLE = 7
    OUTPUT_INSUFFICIENT_SIZE = 8
    UNAVAILABLE_DEVICE = 9
    MISSED_DEADLINE_TRANSIENT = 10
    MISSED_DEADLINE_PERSISTENT = 11
    RESOURCE_EXHAUSTED_TRANSIENT = 12
    RESOURCE_EXHAUSTED_PERSISTENT = 13
    DEAD_OBJECT = 14


_RESULT_OF_STATUS = {
    ErrorStatus.NONE: ResultCode.NO_ERROR,
    ErrorStatus.DEVICE_UNAVAILABLE: ResultCode.UNAVAILABLE_DEVICE,
    ErrorStatus.GENERAL_FAILURE: ResultCode.OP_FAILED,
    ErrorStatus.OUTPUT_INSUFFICIENT_SIZE: ResultCode.OUTPUT_INSUFFICIENT_SIZE,
    ErrorStatus.INVALID_ARGUMENT: ResultCode.BAD_DATA,
    ErrorStatus.MISSED_DEADLINE_TRANSIENT: ResultCode.MISSED_DEADLINE_TRANSIENT,
    ErrorStatus.MISSED_DEADLINE_PERSISTENT: ResultCode.MISSED_DEADLINE_PERSISTENT,
    ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT: ResultCode.RESOURCE_EXHAUSTED_TRANSIENT,
    ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT: ResultCode.RESOURCE_EXHAUSTED_PERSISTENT,
    ErrorStatus.DEAD_OBJECT: ResultCode.DEAD_OBJECT,
}


class NnrtError(Exception):
    """The one exception type of nnrt; ``status`` says what kind of failure.

    ``result_code`` is the NeuralNetworks.h code the builder API would return
    (BAD_DATA for a bad argument, BAD_STATE for a call after ``finish``).
    ``output_shapes`` is set on OUTPUT_INSUFFICIENT_SIZE.
    """

    def __init__(self, status: ErrorStatus, message: str, *,
                 result_code: ResultCode | None = None, output_shapes=None):
        super().__init__(f"{status.name}: {message}")
        self.status = ErrorStatus(status)
        self.message = message
        self.result_code = result_code if result_code is not None else _RESULT_OF_STATUS[self.status]
        self.output_shapes = output_shapes


def invalid(message: str) -> NnrtError:
    """An INVALID_ARGUMENT error (BAD_DATA at the builder)."""
    return NnrtError(ErrorStatus.INVALID_ARGUMENT, message)


def bad_state(message: str) -> NnrtError:
    return NnrtError(ErrorStatus.INVALID_ARGUMENT, message, result_code=ResultCode.BAD_STATE)


def general_failure(message: str) -> NnrtError:
    return NnrtError(ErrorStatus.GENERAL_FAILURE, message)
