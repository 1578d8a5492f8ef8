"""Alias: the server harness lives in the package, :mod:`dspark_harden.devtools.lock` (the demo
uses it too, and product code never imports from tests/). ``tests.harness.lock`` is that very
module, so monkeypatching either name patches the same object."""

import sys

from dspark_harden.devtools import lock as _impl

sys.modules[__name__] = _impl
