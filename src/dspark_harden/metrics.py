"""Every Prometheus metric family dspark-harden exports, in one place.

Conventions (Prometheus, not SGLang's ``sglang:`` prefix): names start with ``dspark_harden_``,
base units (``_seconds``, ``_bytes``), counters end in ``_total``, no colons, bounded label values
only (never schema hashes or request ids), a ``dp_rank`` label where aggregation across DP ranks
matters. Families are declared here as specs and instantiated lazily per process (after SGLang has
set ``PROMETHEUS_MULTIPROC_DIR``), so they work in SGLang's Prometheus multiprocess mode; gauges
declare their ``multiprocess_mode`` explicitly. docs/metrics.md documents every family (a test
keeps both in sync).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

PREFIX = "dspark_harden_"

# default latency buckets: 1 µs .. 10 s
LATENCY_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple = ()
    buckets: tuple = LATENCY_BUCKETS
    multiprocess_mode: str = "mostrecent"  # gauges only
    # label combinations to pre-create so a series exists before its first event
    precreate: tuple = ()
    feature: str = "core"
    # how to aggregate across ranks (documented in docs/metrics.md)
    aggregation: str = ""

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric {self.name} must start with {PREFIX}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name} must end with _total")
        if ":" in self.name:
            raise ValueError(f"metric {self.name} must not contain ':'")


FAMILIES: dict[str, Family] = {}


def declare(*families: Family) -> None:
    for fam in families:
        if fam.name in FAMILIES:
            raise ValueError(f"metric {fam.name} declared twice")
        FAMILIES[fam.name] = fam


# ------------------------------------------------------------------------------------------
# core / platform
declare(
    Family(
        "dspark_harden_build_info", "gauge",
        "dspark-harden build information (value 1).",
        labels=("version", "sglang_version"), multiprocess_mode="max",
        aggregation="max; identical on every process",
    ),
    Family(
        "dspark_harden_feature_bound", "gauge",
        "1 when the feature's patches are bound and verified in this process role, else 0.",
        labels=("feature", "role", "status"), multiprocess_mode="max",
        aggregation="max by (feature): a feature is active when any process reports 1",
    ),
)

# ------------------------------------------------------------------------------------------
# Feature sections: each feature declares its families below, in its own section.


# ------------------------------------------------------------------------------------------
# runtime: lazily created prometheus_client objects

_LOCK = threading.Lock()
_LIVE: dict[str, Any] = {}


def get(name: str) -> Any:
    """The live prometheus_client metric for a declared family (created on first use)."""
    obj = _LIVE.get(name)
    if obj is not None:
        return obj
    with _LOCK:
        obj = _LIVE.get(name)
        if obj is None:
            obj = _create(FAMILIES[name])
            _LIVE[name] = obj
    return obj


def _create(fam: Family) -> Any:
    import prometheus_client as pc

    short = fam.name[: -len("_total")] if fam.kind == "counter" else fam.name
    if fam.kind == "counter":
        obj = pc.Counter(short, fam.doc, labelnames=fam.labels)
    elif fam.kind == "gauge":
        obj = pc.Gauge(fam.name, fam.doc, labelnames=fam.labels, multiprocess_mode=fam.multiprocess_mode)
    elif fam.kind == "histogram":
        obj = pc.Histogram(fam.name, fam.doc, labelnames=fam.labels, buckets=fam.buckets)
    else:  # pragma: no cover - guarded by declare()
        raise ValueError(fam.kind)
    for combo in fam.precreate:
        obj.labels(*combo) if fam.labels else None
    return obj


def precreate(name: str, combos: Iterable[tuple]) -> None:
    """Pre-create label combinations known only at runtime (e.g. this process's dp_rank)."""
    obj = get(name)
    for combo in combos:
        obj.labels(*combo)


def reset_for_tests() -> None:
    """Forget live objects (their collectors stay registered in prometheus_client's registry)."""
    with _LOCK:
        _LIVE.clear()


def families(feature: Optional[str] = None) -> list[Family]:
    return [f for f in FAMILIES.values() if feature is None or f.feature == feature]
