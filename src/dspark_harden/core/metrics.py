"""The metrics core: naming conventions, the one registry of families, and the lazy
multiprocess-safe runtime. Families themselves live with their feature.

Conventions (Prometheus, not SGLang's ``sglang:`` prefix): names start with ``dspark_harden_``,
base units (``_seconds``, ``_bytes``), counters end in ``_total``, no colons, bounded label values
only (never schema hashes or request ids), a ``dp_rank`` label where aggregation across DP ranks
matters. :func:`convention_problems` is the single statement of these rules: :class:`Family`
enforces it when a family is declared and ``dspark-harden metrics-lint`` applies it to a live scrape.

Declaring families (any feature, built-in or third-party): in the feature's own package, build
:class:`Family` objects (optionally grouped in a :class:`MetricGroup` with a title and intro for the
generated reference) and return them from a ``dspark_metrics()`` hook implementation (see
docs/hooks.md). :data:`FAMILIES` is the registry built from every plugin's hook on first use
(built-in features, then third-party ones from the ``dspark_harden.features`` entry-point group);
a duplicate name or a family naming a feature nobody registered stops startup. docs/metrics.md is
generated from the built-in declarations (``dspark-harden metrics --markdown``; a test keeps it
current).

Families are instantiated lazily per process (after SGLang has set ``PROMETHEUS_MULTIPROC_DIR``),
so they work in SGLang's Prometheus multiprocess mode, where every process writes its own mmap
files and the main process serves ``/metrics`` from all of them. Gauges pass their
``multiprocess_mode`` explicitly. Label combinations listed in ``Family.precreate`` are created
when the process starts (by the observability feature, for features active in that process), so a
series exists before its first event; the placeholder :data:`DP_RANK` in a combination stands for
this process's ``dp_rank`` label value (``roles.CONTEXT.dp_label``). Call :func:`get` at runtime
(never at import or bind time in the main process: use :func:`when_ready` for start-up publishing).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger("dspark_harden")

PREFIX = "dspark_harden_"

# default latency buckets: 1 µs .. 10 s
LATENCY_BUCKETS = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

KINDS = ("counter", "gauge", "histogram")
# prometheus_client's gauge multiprocess modes ("all"/"liveall" add a pid label: avoid them)
GAUGE_MODES = frozenset(
    {
        "min",
        "max",
        "sum",
        "mostrecent",
        "all",
        "livemin",
        "livemax",
        "livesum",
        "livemostrecent",
        "liveall",
    }
)
# placeholder in Family.precreate combinations: this process's dp_rank label value
DP_RANK = "$dp_rank"

_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
_LABEL_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
# unit suffixes that are not Prometheus base units (seconds, bytes, ratios)
_NON_BASE_UNITS = {
    "ms": "seconds",
    "msec": "seconds",
    "milliseconds": "seconds",
    "us": "seconds",
    "usec": "seconds",
    "microseconds": "seconds",
    "ns": "seconds",
    "nanoseconds": "seconds",
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "kb": "bytes",
    "mb": "bytes",
    "gb": "bytes",
    "kib": "bytes",
    "mib": "bytes",
    "gib": "bytes",
    "kilobytes": "bytes",
    "megabytes": "bytes",
    "gigabytes": "bytes",
    "percent": "ratio",
}
_RESERVED_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def convention_problems(name: str, kind: str, labels: Iterable[str] = (), *, own: bool = True) -> list[str]:
    """Prometheus naming problems of one family (empty list when clean).

    ``name`` is the family name as exposed (counters with their ``_total``). ``own`` adds the
    rules specific to dspark-harden families (prefix).
    """
    out: list[str] = []
    labels = tuple(labels)
    if own and not name.startswith(PREFIX):
        out.append(f"{name}: must start with {PREFIX}")
    if ":" in name:
        out.append(f"{name}: must not contain ':' (colons are reserved for recording rules)")
    elif not _NAME_RE.match(name):
        out.append(f"{name}: must be lower snake_case [a-z_][a-z0-9_]*")
    if kind not in KINDS:
        out.append(f"{name}: unknown type {kind!r} (one of {', '.join(KINDS)})")
    if kind == "counter" and not name.endswith("_total"):
        out.append(f"{name}: counter must end with _total")
    if kind in ("gauge", "histogram") and name.endswith("_total"):
        out.append(f"{name}: only counters end with _total ({kind})")
    if kind in ("gauge", "histogram") and name.endswith(_RESERVED_SUFFIXES):
        out.append(f"{name}: suffixes {', '.join(_RESERVED_SUFFIXES)} are reserved for histogram/counter samples")
    words = name[: -len("_total")].split("_") if name.endswith("_total") else name.split("_")
    for word in words:
        base = _NON_BASE_UNITS.get(word)
        if base:
            out.append(f"{name}: unit '{word}' is not a base unit (use {base})")
    if len(set(labels)) != len(labels):
        out.append(f"{name}: duplicate label names {labels}")
    for label in labels:
        if not _LABEL_RE.match(label) or label.startswith("__"):
            out.append(f"{name}: bad label name {label!r}")
        if label == "le" and kind == "histogram" or label == "quantile":
            out.append(f"{name}: label {label!r} is reserved")
        if label == "pid":
            out.append(f"{name}: label 'pid' is added by multiprocess 'all' gauges; do not declare it")
    return out


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple = ()
    buckets: tuple = LATENCY_BUCKETS
    # gauges only: how the main process combines the per-process values of one label set
    multiprocess_mode: str = "mostrecent"
    # label combinations to pre-create so a series exists before its first event
    # (DP_RANK stands for this process's dp_rank label value)
    precreate: tuple = ()
    # the Feature.name whose activity the family reports ("core": always)
    feature: str = "core"
    # how to aggregate across ranks (documented in docs/metrics.md)
    aggregation: str = ""
    # process roles (Role values, e.g. "scheduler") that emit it; empty: any role.
    # Pre-creation happens only in these roles.
    roles: tuple = ()

    def __post_init__(self) -> None:
        problems = convention_problems(self.name, self.kind, self.labels)
        if not self.doc.strip():
            problems.append(f"{self.name}: empty documentation")
        if self.kind == "gauge" and self.multiprocess_mode not in GAUGE_MODES:
            problems.append(
                f"{self.name}: multiprocess_mode {self.multiprocess_mode!r} not one of {sorted(GAUGE_MODES)}"
            )
        if self.kind == "gauge" and self.multiprocess_mode in ("all", "liveall"):
            problems.append(f"{self.name}: multiprocess_mode {self.multiprocess_mode!r} adds an unbounded pid label")
        for combo in self.precreate:
            if not isinstance(combo, tuple) or len(combo) != len(self.labels):
                problems.append(f"{self.name}: precreate combination {combo!r} does not match labels {self.labels}")
        if any(DP_RANK in combo for combo in self.precreate if isinstance(combo, tuple)) and not self.roles:
            problems.append(f"{self.name}: pre-creating {DP_RANK} needs roles= (the processes that own a dp_rank)")
        for role in self.roles:
            if role not in ("main", "controller", "scheduler", "detokenizer"):
                problems.append(f"{self.name}: unknown role {role!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class MetricGroup:
    """Families of one feature shown together in the generated reference (docs/metrics.md):
    ``title`` is the section heading, ``intro`` a paragraph above its table (markdown)."""

    title: str
    families: tuple
    intro: str = ""

    def __post_init__(self) -> None:
        if not self.title.strip():
            raise ValueError("MetricGroup needs a title")
        for fam in self.families:
            if not isinstance(fam, Family):
                raise ValueError(f"MetricGroup {self.title!r}: {fam!r} is not a Family")


class MetricsError(ValueError):
    """A plugin's ``dspark_metrics`` declarations are inconsistent (duplicate name, unknown feature)."""


@dataclass(frozen=True)
class Declared:
    """One plugin's group of families, as the registry collected it."""

    plugin: str
    group: MetricGroup


class Registry(Mapping):
    """``name -> Family`` of every plugin's ``dspark_metrics()`` hook, in registration order
    (built-in features first). ``groups`` keeps the plugins' grouping for the reference docs and
    ``owner(name)`` the plugin that declared a family."""

    def __init__(self, declared: Iterable[Declared] = ()) -> None:
        self.groups: list[Declared] = list(declared)
        self._by_name: dict[str, Family] = {}
        self._owner: dict[str, str] = {}
        for d in self.groups:
            for fam in d.group.families:
                if fam.name in self._by_name:
                    raise MetricsError(f"metric {fam.name} declared twice (by {self._owner[fam.name]} and {d.plugin})")
                self._by_name[fam.name] = fam
                self._owner[fam.name] = d.plugin

    def __getitem__(self, name: str) -> Family:
        return self._by_name[name]

    def __iter__(self):
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def owner(self, name: str) -> str:
        return self._owner[name]


def collect(pm: Any, feature_names: Optional[Iterable[str]] = None) -> Registry:
    """Build a :class:`Registry` from the ``dspark_metrics`` hook implementations of ``pm``
    (called in registration order, each answer attributed to its plugin). Every family must
    name ``"core"`` or a feature some plugin contributes (``feature_names``; default: ask ``pm``)."""
    if feature_names is None:
        from .manager import all_features

        feature_names = [f.name for f in all_features(pm)]
    known = set(feature_names) | {"core"}
    declared: list[Declared] = []
    for impl in pm.hook.dspark_metrics.get_hookimpls():
        answer = impl.function()
        loose: list[Family] = []
        for item in answer or ():
            if isinstance(item, MetricGroup):
                declared.append(Declared(impl.plugin_name, item))
            elif isinstance(item, Family):
                loose.append(item)
            else:
                raise MetricsError(
                    f"{impl.plugin_name}: dspark_metrics returned {item!r} (not a Family or MetricGroup)"
                )
        if loose:
            declared.append(Declared(impl.plugin_name, MetricGroup(impl.plugin_name, tuple(loose))))
    for d in declared:
        for fam in d.group.families:
            if fam.feature not in known:
                raise MetricsError(f"metric {fam.name} (declared by {d.plugin}) names unknown feature {fam.feature!r}")
    return Registry(declared)


def registry(*, load_extensions: bool = True) -> Registry:
    """A fresh registry from a fresh plugin manager (``load_extensions=False``: built-in features
    only, what docs/metrics.md and the shipped dashboard are generated from)."""
    from .manager import make_manager

    return collect(make_manager(load_extensions=load_extensions))


class _ProcessRegistry(Mapping):
    """This process's registry: the one :func:`use` installed (the binder installs the registry of
    the plugin manager it bound with), else built on first use from a default plugin manager."""

    def __init__(self) -> None:
        self._reg: Optional[Registry] = None
        self._building = False

    def current(self) -> Registry:
        reg = self._reg
        if reg is not None:
            return reg
        with _LOCK:
            if self._reg is None:
                if self._building:
                    raise RuntimeError(
                        "the metric registry was read while it is being built "
                        "(a feature module reads dspark_harden metrics at import time)"
                    )
                self._building = True
                try:
                    from .manager import make_manager, strict_extensions_from_env

                    self._reg = collect(make_manager(strict_extensions=strict_extensions_from_env()))
                finally:
                    self._building = False
            return self._reg

    def use(self, reg: Registry) -> None:
        with _LOCK:
            self._reg = reg

    def __getitem__(self, name: str) -> Family:
        return self.current()[name]

    def __iter__(self):
        return iter(self.current())

    def __len__(self) -> int:
        return len(self.current())


_LOCK = threading.RLock()
#: every declared family of this process (built-in and third-party), by name
FAMILIES = _ProcessRegistry()


def use(reg: Registry) -> None:
    """Install ``reg`` as this process's registry (the binder does, with its plugin manager's)."""
    FAMILIES.use(reg)


def current() -> Registry:
    return FAMILIES.current()


# ------------------------------------------------------------------------------------------
# runtime: lazily created prometheus_client objects
#
# Multiprocess safety: prometheus_client picks its value class (in-process vs per-process mmap
# files) when ``prometheus_client.values`` is first imported. SGLang sets PROMETHEUS_MULTIPROC_DIR
# in the main process only in ``_set_envs_and_config``, *after* plugins were loaded, so nothing may
# create a metric in the main process before then (doing so would also break SGLang's own
# tokenizer metrics). The observability feature calls :func:`defer_until_configured` in the main
# process at bind time and :func:`configured` right after SGLang's ``_set_envs_and_config``;
# :func:`when_ready` runs start-up publishing at the right moment in every process.

_LIVE: dict[str, Any] = {}
_READY = True
_PENDING: list = []
_EARLY: set = set()


def get(name: str) -> Any:
    """The live prometheus_client metric for a declared family (created on first use)."""
    obj = _LIVE.get(name)
    if obj is not None:
        return obj
    with _LOCK:
        obj = _LIVE.get(name)
        if obj is None:
            fam = FAMILIES.get(name)
            if fam is None:
                raise KeyError(f"metric {name} is not declared by any dspark_metrics hook")
            if not _READY:
                _EARLY.add(name)
            obj = _create(fam)
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
    else:  # pragma: no cover - guarded by Family.__post_init__
        raise ValueError(fam.kind)
    return obj


def child(name: str, *labelvalues: Any) -> Any:
    """``get(name).labels(*labelvalues)`` (or the label-less metric), for hot paths to cache."""
    obj = get(name)
    return obj.labels(*labelvalues) if FAMILIES[name].labels else obj


def precreate(name: str, combos: Iterable[tuple]) -> None:
    """Pre-create label combinations (e.g. ones known only at runtime) so their series exist.

    A gauge series that is new here is set to 0: in multiprocess mode a ``mostrecent`` gauge that
    was never set has no timestamp and is left out of the scrape.
    """
    fam = FAMILIES[name]
    obj = get(name)
    for combo in combos:
        combo = tuple(str(v) for v in combo)
        if len(combo) != len(fam.labels):
            raise ValueError(f"{name}: combination {combo} does not match labels {fam.labels}")
        if not fam.labels:
            if fam.kind == "gauge" and not getattr(obj, "_dspark_precreated", False):
                obj.set(0)
                obj._dspark_precreated = True
            continue
        with _LOCK:
            new = combo not in getattr(obj, "_metrics", {})
            ch = obj.labels(*combo)
        if new and fam.kind == "gauge":
            ch.set(0)


def precreate_process(role: str, active_features: Iterable[str], dp_label: str) -> list[str]:
    """Pre-create every declared combination of every family emitted in ``role`` whose feature is
    active here ("core" always is). Returns the names of the families touched."""
    active = set(active_features) | {"core"}
    done = []
    for fam in FAMILIES.values():
        if fam.roles and role not in fam.roles:
            continue
        if fam.feature not in active:
            continue
        combos = [tuple(dp_label if v == DP_RANK else v for v in combo) for combo in fam.precreate]
        if not fam.labels:
            combos = [()]
        if combos:
            precreate(fam.name, combos)
            done.append(fam.name)
    return done


# -- readiness (main process) ----------------------------------------------------------------


def ready() -> bool:
    return _READY


def defer_until_configured() -> None:
    """Main process, before SGLang decided its Prometheus mode: hold :func:`when_ready` work."""
    global _READY
    with _LOCK:
        if "prometheus_client.values" in sys.modules or _has_multiproc_env():
            return  # already decided (embedding app imported prometheus_client, or env preset)
        _READY = False


def configured() -> None:
    """SGLang has configured Prometheus (PROMETHEUS_MULTIPROC_DIR set when --enable-metrics):
    repair an early import, drop metrics created too early, run the deferred work."""
    global _READY
    with _LOCK:
        if _READY:
            pending = []
        else:
            _repair_value_class()
            for name in sorted(_EARLY):
                logger.warning(
                    "dspark-harden metric %s was created in the main process before SGLang configured "
                    "Prometheus multiprocess mode; it is re-created now and earlier values are lost "
                    "(use metrics.when_ready for start-up publishing)",
                    name,
                )
                _forget(name)
            _EARLY.clear()
            _READY = True
            pending, _PENDING[:] = list(_PENDING), []
    for fn in pending:
        fn()


def when_ready(fn: Callable[[], None]) -> None:
    """Run ``fn`` now if metrics may be created in this process, else once SGLang configured them."""
    with _LOCK:
        if not _READY:
            _PENDING.append(fn)
            return
    fn()


def _has_multiproc_env() -> bool:
    import os

    # prometheus_client switches on presence, not value
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


def _repair_value_class() -> None:
    """If prometheus_client.values was imported before PROMETHEUS_MULTIPROC_DIR existed, its value
    class is the in-process one and no metric created from now on would reach /metrics. Re-pick it
    (prometheus_client reads ``values.ValueClass`` whenever a metric child is created)."""
    if not _has_multiproc_env():
        return
    mod = sys.modules.get("prometheus_client.values")
    if mod is None:
        return
    if not getattr(mod.ValueClass, "_multiprocess", False):
        logger.warning(
            "dspark-harden: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set; "
            "switching it to multiprocess values"
        )
        mod.ValueClass = mod.get_value_class()


def _forget(name: str) -> None:
    obj = _LIVE.pop(name, None)
    if obj is None:
        return
    try:
        import prometheus_client as pc

        pc.REGISTRY.unregister(obj)
    except (KeyError, ValueError):  # pragma: no cover - not registered
        pass


def reset_for_tests() -> None:
    """Forget live objects and unregister them from prometheus_client's default registry."""
    global _READY
    with _LOCK:
        for name in list(_LIVE):
            _forget(name)
        _EARLY.clear()
        _PENDING.clear()
        _READY = True


def families(feature: Optional[str] = None) -> list[Family]:
    return [f for f in FAMILIES.values() if feature is None or f.feature == feature]


# -- helpers for the features' runtime code -------------------------------------------------------


def process_dp_label() -> str:
    """This process's ``dp_rank`` label value ("none" outside DP schedulers or before binding)."""
    from . import roles

    ctx = roles.CONTEXT
    return ctx.dp_label if ctx is not None else "none"


def never_raises(fn: Callable) -> Callable:
    """Decorator for a feature's metric helpers: a metric update must never fail a request."""
    import functools

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            logger.debug("metric update %s failed", fn.__qualname__, exc_info=True)

    return run


def add_histogram_counts(child: Any, counts: list, total: float) -> None:
    """Add pre-bucketed observations to a prometheus_client histogram child: ``counts[i]`` observations
    in bucket ``i`` (non-cumulative, one per upper bound including +Inf) summing to ``total``.

    For hot paths that bucket in process (or in native code) and flush periodically: prometheus_client
    has only ``observe(value)``, so this adds to the child's per-bucket and sum values directly (the
    ones ``observe`` increments, mmap-backed in multiprocess mode). Raises ``ValueError`` if the child
    does not have that shape (a prometheus_client that changed its histogram internals)."""
    buckets = getattr(child, "_buckets", None)
    total_value = getattr(child, "_sum", None)
    if buckets is None or total_value is None or len(buckets) != len(counts):
        raise ValueError(
            f"histogram child {child!r} has no _buckets/_sum of {len(counts)} buckets: "
            "prometheus_client's Histogram internals changed"
        )
    for value, n in zip(buckets, counts):
        if n:
            value.inc(n)
    if total:
        total_value.inc(total)
