"""Definitions of vendor extensions shipped with nnrt: what an NNAPI vendor
ships as a header (the extension's name, its operand types and operation
codes), so an app, the TFLite importer and the driver agree on them. The
implementations live in drivers (``nnrt.drivers.mediapipe``)."""
