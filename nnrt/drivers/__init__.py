"""Drivers: the HAL, the reference CPU driver and (later) driver services."""
