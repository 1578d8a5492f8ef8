"""A short per-feature summary of a server's ``/metrics`` scrape: which dspark-harden features are
active in which process roles, how often each ran and its key figure (``make demo`` prints it;
``dspark-harden metrics-summary --url ...`` for any server). Features without a dedicated line get
the totals of their declared counter families, so new and third-party features show up too."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

from ..core import metrics


def parse(text: str) -> dict:
    """{sample name: [(labels, value)]} of the ``dspark_harden_*`` samples in a text scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(metrics.PREFIX):
                out[s.name].append((dict(s.labels), s.value))
    return out


def _sum(samples: dict, name: str, **match) -> float:
    return sum(v for lb, v in samples.get(name, ()) if all(lb.get(k) == w for k, w in match.items()))


def _by(samples: dict, name: str, label: str, **match) -> dict:
    out: dict = defaultdict(float)
    for lb, v in samples.get(name, ()):
        if all(lb.get(k) == w for k, w in match.items()):
            out[lb.get(label, "")] += v
    return dict(out)


def _counts(d: dict, key: str = "") -> str:
    items = [f"{key}{k}: {v:g}" if key else f"{k} {v:g}" for k, v in sorted(d.items()) if v]
    return ", ".join(items) or "none yet"


def _ranks(samples: dict, name: str) -> list:
    return sorted({lb.get("dp_rank") for lb, _ in samples.get(name, ()) if lb.get("dp_rank") not in (None, "none")})


def _phases(s: dict) -> str:
    parts = []
    for r in _ranks(s, "dspark_harden_scheduler_phase_calls_total"):
        calls = _sum(s, "dspark_harden_scheduler_phase_calls_total", dp_rank=r, phase="run_batch")
        sec = _sum(s, "dspark_harden_scheduler_phase_seconds_total", dp_rank=r, phase="run_batch")
        mean = f", mean {sec / calls * 1e3:.1f} ms" if calls else ""
        parts.append(f"rank {r}: run_batch {calls:g} calls{mean}")
    return "; ".join(parts) or "no scheduler samples"


def _ingress(s: dict) -> str:
    batches = _by(s, "dspark_harden_atomic_batches_total", "dp_rank")
    msgs = _sum(s, "dspark_harden_scheduler_batch_messages_total")
    rej = _by(s, "dspark_harden_route_rejections_total", "reason")
    return (
        f"routed batches sent as one message: {_counts(batches, 'rank ')}; batch messages received by "
        f"schedulers: {msgs:g}; bad-rank requests answered 400 instead of a crash: {_counts(rej)}"
    )


def _health(s: dict) -> str:
    return f"/health_scheduler answers: {_counts(_by(s, 'dspark_harden_health_scheduler_checks_total', 'outcome'))}"


def _grammar(s: dict) -> str:
    lookups = _by(s, "dspark_harden_grammar_lookups_total", "source")
    stored = _sum(s, "dspark_harden_grammar_disk_stored_total")
    return f"grammar lookups by source: {_counts(lookups)}; disk entries published: {stored:g}"


def _dp2(s: dict) -> str:
    parts = []
    for r in _ranks(s, "dspark_harden_dp2_exchange_calls_total"):
        calls = _sum(s, "dspark_harden_dp2_exchange_calls_total", channel="mlp", dp_rank=r)
        ex = _sum(s, "dspark_harden_dp2_exchange_seconds_total", channel="mlp", dp_rank=r, phase="exchange_total")
        wait = _sum(s, "dspark_harden_dp2_exchange_seconds_total", channel="mlp", dp_rank=r, phase="peer_wait")
        means = (
            f", mean {ex / calls * 1e6:.1f} us per exchange ({wait / calls * 1e6:.1f} us of it waiting for the peer)"
            if calls
            else ""
        )
        parts.append(f"rank {r}: {calls:g} native MLP-sync exchanges{means}")
    errors = _sum(s, "dspark_harden_dp2_exchange_errors_total")
    return "; ".join(parts + [f"errors {errors:g}"]) if parts else "no exchange samples"


def _masks(s: dict) -> str:
    return f"DSpark verify steps with a grammar: {_counts(_by(s, 'dspark_harden_dspark_mask_steps_total', 'outcome'))}"


def _platform(s: dict) -> str:
    roles = sorted(
        {
            lb["role"]
            for lb, v in s.get("dspark_harden_feature_bound", ())
            if lb.get("feature") == "observability" and v == 1
        }
    )
    info = [lb for lb, v in s.get("dspark_harden_build_info", ()) if v == 1]
    ver = f"dspark-harden {info[0]['version']} on sglang {info[0]['sglang_version']}; " if info else ""
    return f"{ver}published by processes: {', '.join(roles) or 'none'}"


#: feature -> key-figure line (others get their counter totals)
KEY_FIGURES: dict[str, Callable[[dict], str]] = {
    "observability": _platform,
    "scheduler-phase-metrics": _phases,
    "atomic-routed-batch": _ingress,
    "health-scheduler": _health,
    "grammar-service": _grammar,
    "dp2-native-exchange": _dp2,
    "dspark-masks": _masks,
}


def _generic(s: dict, feature: str, registry) -> Optional[str]:
    fams = [f for f in registry.values() if f.feature == feature and f.kind == "counter"]
    if not fams:
        return None
    parts = [f"{f.name[len(metrics.PREFIX) :]} {_sum(s, f.name):g}" for f in fams]
    return "; ".join(parts)


def feature_status(samples: dict) -> dict:
    """{feature: {status: [roles]}} from ``dspark_harden_feature_bound`` (a series exists per
    feature, role and status; its value is 1 only for ``bound``)."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for lb, v in samples.get("dspark_harden_feature_bound", ()):
        if v == 1 or lb.get("status") != "bound":
            out[lb["feature"]][lb["status"]].append(lb["role"])
    return {f: {st: sorted(set(r)) for st, r in d.items()} for f, d in out.items()}


def test_only_features() -> set:
    """Names of the installed test-only features (left out of an operator's summary)."""
    from ..core.manager import all_features, make_manager

    return {f.name for f in all_features(make_manager()) if f.test_only}


def summarize(text: str, registry=None, hide: Optional[set] = None) -> list:
    """Lines: one block per bound feature (what ran where and its key figure), then the features
    that are upstream / disabled / unavailable; features in ``hide`` are left out."""
    registry = registry if registry is not None else metrics.current()
    s = parse(text)
    status = {f: d for f, d in feature_status(s).items() if f not in (hide or set())}
    lines = []
    bound = sorted(f for f, d in status.items() if "bound" in d)
    for feat in bound:
        roles = ", ".join(status[feat]["bound"])
        fn = KEY_FIGURES.get(feat)
        figure = fn(s) if fn else (_generic(s, feat, registry) or "bound (this feature exports no metric family)")
        lines.append(f"{feat} [bound in: {roles}]")
        lines.append(f"    {figure}")
    rest = sorted(set(status) - set(bound))
    for st in ("upstream", "disabled", "unavailable"):
        names = [f for f in rest if st in status[f]]
        if names:
            lines.append(f"{st}: {', '.join(names)}")
    return lines
