"""Drivers: the reference CPU driver, LiteRT, samples and extension drivers.

Services, which host a driver in a process of its own, are transport, not
drivers: :mod:`nnrt.service`.
"""
