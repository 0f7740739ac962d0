"""Definitions of vendor extensions shipped with nnrt: what an NNAPI vendor
ships as a header (the extension's name, its operand types and operation
codes), so an app, the TFLite importer and the driver agree on them. The
implementations live in drivers (``nnrt.drivers.mediapipe``) or, for the
extension the reference and litert drivers run, in the operation registry
(``nnrt.ops.tflite_builtins``) and the litert driver's table.

The allowlist (``nnrt.hal.allowlist``) is for third-party vendors'
extensions; nnrt's own, listed in ``OWN``, need no entry."""

from . import mediapipe, tflite

OWN = frozenset({mediapipe.NAME, tflite.NAME})
# The driver kind (``nnrt driver serve --driver``, ``Runtime(spawn=[...])``)
# that offers each of nnrt's own extensions.
DRIVER_OF = {mediapipe.NAME: "mediapipe", tflite.NAME: "reference"}
