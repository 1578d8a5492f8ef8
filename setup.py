"""Build hook: compiles the native modules with cffi (out-of-line API mode).

The cffi builders live beside the C sources in native/ (see native/build.py). cffi builds them
against the stable ABI (``py_limited_api``: ``*.abi3.so``), so the wheel is tagged ``cp310-abi3``:
one wheel for every CPython >= 3.10 on the platform it was built on (docs/install.md).
"""

from setuptools import setup

setup(
    cffi_modules=["native/build.py:dp2_ffibuilder", "native/build.py:traverse_ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
