"""Vendor extensions (NeuralNetworksExtensions.h, HAL 1.2+).

An extension is a named set of operand and operation types a driver offers
beyond NNAPI's own. Its name is reverse-domain (``com.example.my_extension``).
In a model, an extension type is a 32-bit code: the high 16 bits are the
extension's *prefix*, a number the model assigns (a bijection prefix <->
name held in the model and sent to drivers with it), the low 16 bits the
type within the extension. A code whose prefix is 0 is one of NNAPI's own.

What an extension's operand types are (tensor or scalar, bytes per element
or per scalar) is its *definition* (:class:`Extension`), which a vendor
publishes the way an NNAPI vendor ships a header: the app-side builder needs
it to size operands, and the driver that implements it returns it from
``Device.supported_extensions()``. :func:`define_extension` makes a definition
known in this process (the analogue of NNAPI's process-wide TypeManager);
a definition received from a driver service is made known the same way.

The semantics of extension operations (how many inputs, which types) are
the driver's to validate; the runtime checks only what it can: operand
indexes, that the extension is known, byte sizes of extension values.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import invalid
from .types import OperandType, OperationType

TYPE_WITHIN_BITS = 16          # NNAPI's kExtensionTypeBits
MAX_PREFIX = (1 << 16) - 1     # 0 is reserved for NNAPI's own types
_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def check_extension_name(name) -> str:
    """A reverse-domain name: two or more dot-separated lower-case labels."""
    if not isinstance(name, str) or len(name) > 255 or not _NAME.match(name):
        raise invalid(f"{name!r} is not an extension name (reverse-domain, like "
                      f"'com.example.my_extension')")
    return name


def _check_within(type_within) -> int:
    if isinstance(type_within, bool) or not isinstance(type_within, (int, np.integer)) \
            or not 0 <= type_within < (1 << TYPE_WITHIN_BITS):
        raise invalid(f"type within an extension must be in [0, 65535], got {type_within!r}")
    return int(type_within)


@dataclass(frozen=True, slots=True)
class ExtensionOperandTypeInfo:
    """One operand type of an extension (HAL ``Extension::OperandTypeInformation``):
    ``byte_size`` is a scalar's size, or a tensor element's."""

    type: int
    is_tensor: bool
    byte_size: int


@dataclass(frozen=True)
class Extension:
    """An extension's definition: its name, its operand types and (for
    messages only) the names of its operations by type within."""

    name: str
    operand_types: tuple[ExtensionOperandTypeInfo, ...] = ()
    operation_names: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        check_extension_name(self.name)
        seen = set()
        for info in self.operand_types:
            _check_within(info.type)
            if info.type in seen:
                raise invalid(f"extension {self.name}: operand type {info.type} declared twice")
            if info.byte_size < 0 or info.byte_size > 1 << 20 \
                    or (not info.is_tensor and info.byte_size == 0):
                raise invalid(f"extension {self.name}: operand type {info.type} has byte size "
                              f"{info.byte_size}")
            seen.add(info.type)

    def operand_type_info(self, type_within: int) -> ExtensionOperandTypeInfo:
        for info in self.operand_types:
            if info.type == type_within:
                return info
        raise invalid(f"extension {self.name} has no operand type {type_within}")

    def operation_name(self, type_within: int) -> str:
        return dict(self.operation_names).get(type_within, str(type_within))


_KNOWN: dict[str, Extension] = {}
_LOCK = threading.Lock()


def define_extension(extension: Extension) -> Extension:
    """Make ``extension`` known in this process. Defining the same extension
    twice is fine; two different definitions under one name are refused."""
    with _LOCK:
        known = _KNOWN.get(extension.name)
        if known is not None and (set(known.operand_types) != set(extension.operand_types)):
            raise invalid(f"extension {extension.name} is already defined with other operand "
                          f"types")
        if known is None or len(extension.operation_names) > len(known.operation_names):
            _KNOWN[extension.name] = extension
        return _KNOWN[extension.name]


def known_extension(name: str) -> Extension:
    """The definition of extension ``name``; INVALID_ARGUMENT if none is known."""
    check_extension_name(name)
    try:
        return _KNOWN[name]
    except KeyError:
        raise invalid(f"extension {name} is not known in this process: import its "
                      f"definition, or open a runtime that finds a device offering it") from None


class _ExtensionCode(int):
    """A 32-bit extension type code: the model's prefix for the extension in
    the high bits, the type within the extension in the low 16."""

    extension: str
    is_extension = True

    @property
    def prefix(self) -> int:
        return int(self) >> TYPE_WITHIN_BITS

    @property
    def type_within(self) -> int:
        return int(self) & MAX_PREFIX


class ExtensionOperandType(_ExtensionCode):
    """The operand type ``code`` (prefix << 16 | type within) of extension
    ``extension``; it answers what :class:`OperandType` answers (is it a
    tensor, its element size) from the extension's definition."""

    info: ExtensionOperandTypeInfo

    def __new__(cls, code: int, extension: str, info: ExtensionOperandTypeInfo):
        self = super().__new__(cls, code)
        self.extension = extension
        self.info = info
        return self

    @property
    def name(self) -> str:
        return f"{self.extension}:{self.type_within}"

    is_quantized = False

    @property
    def is_tensor(self) -> bool:
        return self.info.is_tensor

    @property
    def is_scalar(self) -> bool:
        return not self.info.is_tensor

    @property
    def element_size(self) -> int:
        return self.info.byte_size

    @property
    def dtype(self) -> np.dtype:
        n = self.info.byte_size
        return np.dtype(f"u{n}") if n in (1, 2, 4, 8) else np.dtype((np.void, max(n, 1)))

    def __repr__(self) -> str:
        return f"<ExtensionOperandType {self.name} code={int(self):#x}>"

    def __reduce__(self):
        return (ExtensionOperandType, (int(self), self.extension, self.info))


class ExtensionOperationType(_ExtensionCode):
    """The operation type ``code`` of extension ``extension``."""

    def __new__(cls, code: int, extension: str, name: str | None = None):
        self = super().__new__(cls, code)
        self.extension = extension
        self._name = name
        return self

    @property
    def name(self) -> str:
        return f"{self.extension}:{self._name or self.type_within}"

    is_oem = False

    def __repr__(self) -> str:
        return f"<ExtensionOperationType {self.name} code={int(self):#x}>"

    def __reduce__(self):
        return (ExtensionOperationType, (int(self), self.extension, self._name))


def is_extension_code(code: int) -> bool:
    return int(code) >> TYPE_WITHIN_BITS != 0


def operand_type(code, prefixes: dict[int, str]) -> OperandType | ExtensionOperandType:
    """The operand type of ``code`` in a model whose prefix map is
    ``prefixes`` (prefix -> name); INVALID_ARGUMENT for an unknown code,
    prefix or extension."""
    if isinstance(code, (OperandType, ExtensionOperandType)):
        return code
    code = int(code)
    if not is_extension_code(code):
        try:
            return OperandType(code)
        except ValueError:
            raise invalid(f"unknown operand type {code}") from None
    prefix = code >> TYPE_WITHIN_BITS
    if prefix not in prefixes:
        raise invalid(f"operand type {code:#x} has extension prefix {prefix}, which the "
                      f"model does not map to an extension")
    ext = known_extension(prefixes[prefix])
    return ExtensionOperandType(code, ext.name, ext.operand_type_info(code & MAX_PREFIX))


def operation_type(code, prefixes: dict[int, str]) -> OperationType | ExtensionOperationType:
    """The operation type of ``code`` in a model with prefix map ``prefixes``.
    Extension operations need no definition here: their semantics are the
    driver's."""
    if isinstance(code, (OperationType, ExtensionOperationType)):
        return code
    code = int(code)
    if not is_extension_code(code):
        try:
            return OperationType(code)
        except ValueError:
            raise invalid(f"unknown operation type {code}") from None
    prefix = code >> TYPE_WITHIN_BITS
    if prefix not in prefixes:
        raise invalid(f"operation type {code:#x} has extension prefix {prefix}, which the "
                      f"model does not map to an extension")
    name = check_extension_name(prefixes[prefix])
    ext = _KNOWN.get(name)
    within = code & MAX_PREFIX
    return ExtensionOperationType(code, name,
                                  ext.operation_name(within) if ext is not None else None)


def uses_extensions(model) -> set[str]:
    """The extensions whose types ``model`` (a HalModel) uses, and "OEM" when
    it uses an OEM operation or operand: what the allowlist governs."""
    used: set[str] = set()
    for sub in (model.main, *model.referenced):
        for o in sub.operands:
            if o.type.is_extension:
                used.add(o.type.extension)
            elif o.type in (OperandType.OEM, OperandType.TENSOR_OEM_BYTE):
                used.add("OEM")
        for op in sub.operations:
            if op.type.is_extension:
                used.add(op.type.extension)
            elif op.type.is_oem:
                used.add("OEM")
    return used
