"""Build hook: compiles the native DP2 exchange with cffi (out-of-line API mode).

The cffi builder lives beside the C sources in native/ (see native/build_dp2.py).
"""
from setuptools import setup

setup(cffi_modules=["native/build_dp2.py:ffibuilder"])
