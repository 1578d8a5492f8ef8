"""cffi out-of-line API-mode builder for the native DP2 exchange (used by setup.py)."""

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef_source() -> str:
    with open(os.path.join(HERE, "dp2_exchange.h")) as fh:
        text = fh.read()
    # cffi's cdef understands no preprocessor: keep declarations, turn the ABI macro into an enum-free int
    text = re.sub(r"^#.*$", "", text, flags=re.M)
    return text


ffibuilder = FFI()
ffibuilder.cdef(_cdef_source())
ffibuilder.set_source(
    "dspark_harden._dp2_native",
    '#include "dp2_exchange.h"',
    sources=[os.path.join("native", "dp2_exchange.c")],
    include_dirs=[HERE],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"],
    libraries=["rt"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
