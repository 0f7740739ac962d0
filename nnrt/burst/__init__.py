"""Burst executions: controller (app side) and server (driver side) over the FMQ."""
