"""The litert driver: its partition of an NNAPI model compiled to a TFLite
flatbuffer and run by LiteRT (``ai-edge-litert``) with XNNPACK, cut into
segments a scheduler can preempt between. See docs/vendors/litert.md.

``available()`` says whether LiteRT is importable; nnrt works without it
(the driver is then not listed).
"""
from __future__ import annotations

import importlib.util


def available() -> bool:
    """True when ai-edge-litert, tflite and flatbuffers can be imported."""
    return all(importlib.util.find_spec(m) is not None
               for m in ("ai_edge_litert", "tflite", "flatbuffers"))


def __getattr__(name: str):
    # The driver module imports LiteRT's schema packages: load it only when
    # asked for, so `import nnrt.drivers.litert` works without them.
    if name in ("LiteRTDevice", "LiteRTPreparedModel", "DEFAULT_SEGMENT_TIME"):
        from . import driver
        return getattr(driver, name)
    raise AttributeError(name)


__all__ = ["DEFAULT_SEGMENT_TIME", "LiteRTDevice", "LiteRTPreparedModel",
           "available"]
