"""Alias: the server harness lives in the package, :mod:`dspark_harden.devtools.server` (the demo
uses it too, and product code never imports from tests/). ``tests.harness.server`` is that very
module, so monkeypatching either name patches the same object."""

import sys

from dspark_harden.devtools import server as _impl

sys.modules[__name__] = _impl
