"""Build glue for the optional native fast path of the fmq ring.

Metadata lives in pyproject.toml. ``optional=True``: without a C compiler or
Python headers the install still succeeds and the ring uses its pure-Python
always-signal protocol (see nnrt/fmq/ring.py).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("nnrt.fmq._native", ["nnrt/fmq/_native.c"],
                             extra_compile_args=["-O2", "-std=gnu11"], optional=True)])
