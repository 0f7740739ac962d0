"""NNAPI operations: the registry and one module per operation family.

Importing this package imports every family module, which registers its
operations (see ``registry.py``).
"""
import importlib
import pkgutil

from .registry import (Arg, Call, OperationDef, OpView, definition, has_definition, register,
                       register_extension, registered, registered_extensions)

_NOT_FAMILIES = {"registry", "common"}

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name not in _NOT_FAMILIES and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Arg", "Call", "OperationDef", "OpView", "definition", "has_definition", "register",
           "register_extension", "registered", "registered_extensions"]
