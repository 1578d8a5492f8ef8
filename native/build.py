"""cffi out-of-line API-mode builders for the native modules (used by setup.py).

* ``dspark_harden._dp2_native``: the DP2 shared-memory/futex exchange (dp2_exchange.{h,c});
* ``dspark_harden._traverse_native``: the DSpark draft-chain traversal over xgrammar's
  GrammarMatcher through the TVM FFI C ABI, on native threads (draft_traverse.{h,c}).
"""

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
CFLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]


def _builder(module: str, header: str, source: str, libraries: list) -> FFI:
    with open(os.path.join(HERE, header)) as fh:
        # cffi's cdef understands no preprocessor: keep declarations (constants are enums)
        cdef = re.sub(r"^#.*$", "", fh.read(), flags=re.M)
    ffi = FFI()
    ffi.cdef(cdef)
    ffi.set_source(
        module,
        f'#include "{header}"',
        sources=[os.path.join("native", source)],
        include_dirs=[HERE],
        extra_compile_args=CFLAGS,
        libraries=libraries,
    )
    return ffi


dp2_ffibuilder = _builder("dspark_harden._dp2_native", "dp2_exchange.h", "dp2_exchange.c", ["rt", "pthread"])
traverse_ffibuilder = _builder(
    "dspark_harden._traverse_native", "draft_traverse.h", "draft_traverse.c", ["dl", "pthread"]
)

if __name__ == "__main__":
    dp2_ffibuilder.compile(verbose=True)
    traverse_ffibuilder.compile(verbose=True)
