"""Build hook: compiles the native modules with cffi (out-of-line API mode).

The cffi builders live beside the C sources in native/ (see native/build.py).
"""
from setuptools import setup

setup(cffi_modules=["native/build.py:dp2_ffibuilder", "native/build.py:traverse_ffibuilder"])
