"""The C accelerator of the per-row hot path; everything else is declared in setup.cfg.

`optional=True`: without a C compiler the install still succeeds and the pure-Python
twins run (cdc/accel.py says which one is in use, `cdc --version` tells the user).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cdc._speedups", ["cdc/_speedups.c"], extra_compile_args=["-O2"], optional=True)])
