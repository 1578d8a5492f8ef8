"""Compatibility alias: the metrics core lives in :mod:`dspark_harden.core.metrics`.

``import dspark_harden.metrics`` (or ``from dspark_harden import metrics``) yields that very module,
so call sites and third-party code written against the old path keep working. Metric families are
not declared here: each feature declares its own through the ``dspark_metrics`` hook.
"""

import sys

from .core import metrics as _core_metrics

sys.modules[__name__] = _core_metrics
