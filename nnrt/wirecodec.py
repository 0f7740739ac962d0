"""One bounds-checked byte reader and one writer, for every wire format of
nnrt (the driver-service control protocol and the burst wire format).

No nnrt imports, no I/O. A :class:`Reader` never reads past the end of its
bytes: every read that would raises the error its owner gives it (the
protocol's ``ProtocolError``, the burst format's ``BurstProtocolError``),
never a ``struct.error`` or an ``IndexError``, so a decoder built on it
either returns a message or raises its protocol error. Counts are checked
against what is left *before* anything is allocated for them.
"""
from __future__ import annotations

import struct
from typing import Callable

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
I32 = struct.Struct("<i")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
F64 = struct.Struct("<d")


def _scalar(st: struct.Struct):
    """A Reader method reading one ``st`` value (the hot path: no helper calls)."""
    size, unpack = st.size, st.unpack_from

    def read(self, what: str):
        pos = self.pos
        if pos + size > len(self.data):
            raise self.truncated(size, what)
        self.pos = pos + size
        return unpack(self.data, pos)[0]
    return read


class Reader:
    """A cursor over ``data``; ``error(text)`` makes the exception raised for
    bytes that do not hold what is asked."""

    __slots__ = ("data", "pos", "error")

    def __init__(self, data, error: Callable[[str], Exception]):
        self.data = data
        self.pos = 0
        self.error = error

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def truncated(self, n: int, what: str) -> Exception:
        return self.error(f"truncated at byte {self.pos} of {len(self.data)}: {what} "
                          f"needs {n} bytes, {len(self.data) - self.pos} left")

    def take(self, st: struct.Struct, what: str) -> tuple:
        pos = self.pos
        end = pos + st.size
        if end > len(self.data):
            raise self.truncated(st.size, what)
        self.pos = end
        return st.unpack_from(self.data, pos)

    u8 = _scalar(U8)
    u32 = _scalar(U32)
    i32 = _scalar(I32)
    u64 = _scalar(U64)
    f64 = _scalar(F64)

    def u32_array(self, n: int, what: str) -> tuple[int, ...]:
        """``n`` u32 values (``n`` already bounded by the caller's limit)."""
        return self._array("I", 4, n, what)

    def f64_array(self, n: int, what: str) -> tuple[float, ...]:
        """``n`` f64 values (``n`` already bounded by the caller's limit)."""
        return self._array("d", 8, n, what)

    def _array(self, code: str, size: int, n: int, what: str) -> tuple:
        pos = self.pos
        end = pos + size * n
        if n < 0 or end > len(self.data):
            raise self.truncated(size * n, what)
        self.pos = end
        return struct.unpack_from(f"<{n}{code}", self.data, pos)

    def raw(self, n: int, what: str) -> bytes:
        pos = self.pos
        end = pos + n
        if n < 0 or end > len(self.data):
            raise self.truncated(n, what)
        self.pos = end
        return bytes(self.data[pos:end])

    def finish(self, what: str) -> None:
        """The message must end here: trailing bytes are an error."""
        if self.pos != len(self.data):
            raise self.error(f"{what}: {len(self.data) - self.pos} bytes of trailing garbage")


class Writer:
    """Appends to one bytearray; ``value()`` is the bytes written."""

    __slots__ = ("out",)

    def __init__(self, head: bytes = b""):
        self.out = bytearray(head)

    def pack(self, st: struct.Struct, *values) -> None:
        self.out += st.pack(*values)

    def u8(self, v: int) -> None: self.out += U8.pack(v)
    def u32(self, v: int) -> None: self.out += U32.pack(v)
    def i32(self, v: int) -> None: self.out += I32.pack(v)
    def u64(self, v: int) -> None: self.out += U64.pack(v)
    def f64(self, v: float) -> None: self.out += F64.pack(v)

    def u32_array(self, values) -> None:
        """The values only; a count, if the format has one, is the caller's."""
        values = tuple(values)
        self.out += struct.pack(f"<{len(values)}I", *values)

    def f64_array(self, values) -> None:
        """The values only, as :meth:`u32_array`."""
        values = tuple(values)
        self.out += struct.pack(f"<{len(values)}d", *values)

    def raw(self, data) -> None:
        self.out += data

    def value(self) -> bytes:
        return bytes(self.out)


__all__ = ["F64", "I32", "Reader", "U16", "U32", "U64", "U8", "Writer"]
