"""``dspark-harden bench serve``: one production-shaped trace replayed against a stock SGLang DP2
server and a plugin DP2 server in the same run, alternating rounds; the sequential and concurrent
correctness gates; ``--ablate``. What is measured and how is in docs/e2e.md.

Both servers are launched once (stock first), from the same tiny model, with the same flags
(DeepseekV3 tiny, ``--dp-size 2 --tp-size 2 --enable-dp-attention``): stock with no plugin at all,
the plugin with every feature that can run on the CPU geometry (native DP2 exchange included) and
its persistent grammar cache in a fresh directory of this run. Only one server runs at a time:
the other one's whole process group is stopped (SIGSTOP) so that it takes no CPU (the stock DP
controller's busy loop alone takes ~45 % of a core) and resumed (SIGCONT) for its own rounds.
Before every pass each server's caches are flushed (``POST /flush_cache``: radix cache, KV pools
and the grammar backend's memory cache - stock's and the plugin's LRU alike), so every round of
both starts from the same cache state and replays the same trace.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .. import server as _server
from . import client as _client
from . import procs as _procs
from . import trace as _trace

#: env every plugin server gets on top of the defaults (everything else is on by default)
PLUGIN_ENV = {"SGLANG_DSPARK_DP2_SHM_MLP_SYNC": "1"}

#: (feature, env that switches it off) for --ablate: the features that act on this CPU geometry
ABLATIONS: list[tuple[str, dict]] = [
    ("dp2-native-exchange", {"SGLANG_DSPARK_DP2_SHM_MLP_SYNC": "0"}),
    ("dp-controller-blocking-loop", {"DSPARK_HARDEN_DP_CONTROLLER_LOOP": "0"}),
    ("grammar-service", {"DSPARK_HARDEN_GRAMMAR": "0"}),
    ("atomic-routed-batch", {"DSPARK_HARDEN_ATOMIC_ROUTED_BATCH": "0"}),
    ("gc-freeze", {"DSPARK_HARDEN_GC_FREEZE": "0"}),
    ("scheduler-phase-metrics", {"DSPARK_HARDEN_SCHEDULER_PHASE_METRICS": "0"}),
    ("lifecycle-shutdown", {"DSPARK_HARDEN_LIFECYCLE": "0"}),
    ("health-scheduler", {"DSPARK_HARDEN_HEALTH_SCHEDULER": "0"}),
]
#: features that are on by default but do nothing on the CPU harness (said in the report)
NOT_EXERCISED = {
    "prefill-graph-dp": "no prefill CUDA graphs on CPU (the scheduler logs why the feature does not apply)",
    "hostpool-teardown": "no HiCache host pools on this server",
    "observability": "kept on in every ablation: the benches and the soak read its metrics",
}

SUMMARY_KEYS = (
    "output_tok_s",
    "req_s",
    "e2e_p50_s",
    "e2e_p95_s",
    "e2e_p99_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "wall_s",
    "errors",
    "constrained_invalid",
    "constrained_truncated",
    "accept_length_mean",
)


def log(msg: str) -> None:
    sys.stderr.write(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


#: ``--speculative``: algorithm -> what the servers add to the DP2 geometry. DSpark: Qwen3 tiny +
#: the tiny random-weight DSpark draft (devtools/tiny_models.ensure_dspark_draft), DP-attention needs
#: --enable-dp-lm-head (docs/testing.md); the plugin servers turn the DSpark mask feature on.
SPECULATIVE = {
    "dspark": {
        "algorithm": "DSPARK",
        "arch": "qwen3",
        "plugin_env": {"DSPARK_HARDEN_DSPARK_MASKS": "1"},
        #: the mask feature's ablation (reported beside the comparison)
        "ablation": ("dspark-masks", {"DSPARK_HARDEN_DSPARK_MASKS": "0"}),
    },
}


def base_config(speculative: Optional[str] = None) -> _server.ServerConfig:
    c = _server.DP2_CONFIG
    if not speculative:
        return c
    spec = SPECULATIVE[speculative]
    from .. import tiny_models

    extra = (
        "--speculative-algorithm",
        spec["algorithm"],
        "--speculative-draft-model-path",
        tiny_models.dspark_draft_dir(),
        "--enable-dp-lm-head",
    )
    return _server.ServerConfig(**{**c.__dict__, "arch": spec["arch"], "extra_args": tuple(c.extra_args) + extra})


def stock_config(speculative: Optional[str] = None) -> _server.ServerConfig:
    c = base_config(speculative)
    return _server.ServerConfig(**{**c.__dict__, "plugins": None, "name": "e2e-stock"})


def plugin_config(
    grammar_dir: str, off: Optional[dict] = None, name: str = "e2e-plugin", speculative: Optional[str] = None
) -> _server.ServerConfig:
    spec_env = SPECULATIVE[speculative]["plugin_env"] if speculative else {}
    env = {**PLUGIN_ENV, **spec_env, "DSPARK_HARDEN_GRAMMAR_DISK_DIR": grammar_dir, **(off or {})}
    c = base_config(speculative).with_env(**env)
    return _server.ServerConfig(**{**c.__dict__, "name": name})


_MASK_STEPS = re.compile(
    r'^dspark_harden_dspark_mask_steps_total\{dp_rank="(\d+)",outcome="(\w+)"\} ([0-9.e+]+)$', re.M
)
_MASK_ENGINE = re.compile(r'^dspark_harden_dspark_mask_engine\{dp_rank="(\d+)",engine="(\w+)"\} ([0-9.e+]+)$', re.M)


def mask_state(metrics_text: str) -> dict:
    """The DSpark mask feature's engine per DP rank (gauge 1) and its step counters by outcome,
    summed over ranks, from one /metrics scrape."""
    engines = {rank: eng for rank, eng, v in _MASK_ENGINE.findall(metrics_text) if float(v) == 1.0}
    steps: dict = {}
    for _rank, outcome, v in _MASK_STEPS.findall(metrics_text):
        steps[outcome] = steps.get(outcome, 0) + int(float(v))
    return {"engine_by_rank": dict(sorted(engines.items())), "steps": steps}


class Pausable:
    """A started server that is either running or SIGSTOPped as a whole group."""

    def __init__(self, server: _server.SGLangServer):
        self.server = server
        self.paused = False

    def pause(self) -> None:
        if not self.paused:
            _procs.pause(self.server.pid)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            _procs.resume(self.server.pid)
            self.paused = False
        deadline = time.monotonic() + 60
        while not self.server._http_ok("/model_info", timeout=5):
            if time.monotonic() > deadline or self.server.proc.poll() is not None:
                raise _server.ServerError(self.server._failure("did not answer /model_info after SIGCONT"))
            time.sleep(0.5)

    def flush(self) -> None:
        """Empty the radix cache, KV pools and the grammar memory cache (retry until idle)."""
        deadline = time.monotonic() + 120
        while True:
            r = self.server.post("/flush_cache", timeout=60)
            if r.status_code == 200:
                return
            if time.monotonic() > deadline:
                raise _server.ServerError(
                    self.server._failure(f"/flush_cache answered HTTP {r.status_code}: {r.text[:300]}")
                )
            time.sleep(1.0)

    def stop(self) -> None:
        if self.paused:
            try:
                _procs.resume(self.server.pid)
            except ProcessLookupError:
                pass
            self.paused = False
        self.server.stop()
        self.server.remove_workdir()


def _stop_all(servers: dict) -> None:
    """Stop every server of the run (a failure to stop one is logged, the others still stop), then release
    the run's server lock."""
    for p in servers.values():
        try:
            p.stop()
        except Exception as exc:  # noqa: BLE001
            log(f"stopping {p.server.config.name}: {exc}")
    _server._lock.release()


def start(config: _server.ServerConfig) -> Pausable:
    """Start ``config`` (the harness retries a start that lost a port race) and check that the
    plugin is active in it exactly when it should be."""
    log(f"starting {config.name} ({'stock' if config.plugins is None else 'plugin'}) ...")
    s = _server.SGLangServer(config).start()
    if config.plugins is not None and not s.plugin_roles():
        s.stop()
        raise _server.ServerError(s._failure("the plugin is not active in any process"))
    if config.plugins is None and s.plugin_roles():
        s.stop()
        raise _server.ServerError(s._failure("the stock server has the plugin active"))
    return Pausable(s)


def one_pass(p: Pausable, entries: list[dict], *, sequential: bool = False) -> dict:
    p.resume()
    p.flush()
    before = _procs.sample(p.server.pid)
    results, wall = _client.replay(
        p.server.url,
        entries,
        sequential=sequential,
        stream_override=False if sequential else None,
        tokenizer_dir=_server.model_path(p.server.config),
    )
    after = _procs.sample(p.server.pid)
    p.pause()
    summary = _client.summarize(results, wall, entries)
    summary["cpu_s_by_role"] = _procs.cpu_by_role(before, after)
    summary["cpu_s_total"] = round(sum(summary["cpu_s_by_role"].values()), 3)
    return {"summary": summary, "outputs": _client.outputs_by_id(results), "results": results}


def _median(rounds: list[dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rounds if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def aggregate(rounds: list[dict]) -> dict:
    """Medians over rounds, the per-round values and their spread (min, max)."""
    out: dict = {"median": {k: _median(rounds, k) for k in SUMMARY_KEYS}}
    roles = sorted({role for r in rounds for role in r["cpu_s_by_role"]})
    out["median"]["cpu_s_by_role"] = {
        role: round(statistics.median([r["cpu_s_by_role"].get(role, 0.0) for r in rounds]), 3) for role in roles
    }
    out["median"]["cpu_s_total"] = _median(rounds, "cpu_s_total")
    out["spread"] = {k: [min(v), max(v)] for k in SUMMARY_KEYS if (v := [r[k] for r in rounds if r.get(k) is not None])}
    out["errors"] = sum(r["errors"] for r in rounds)
    out["constrained_invalid"] = sum(r["constrained_invalid"] for r in rounds)
    out["rounds"] = rounds
    out.update(
        {
            k: out["median"][k]
            for k in (
                "output_tok_s",
                "req_s",
                "e2e_p50_s",
                "e2e_p95_s",
                "e2e_p99_s",
                "ttft_p50_s",
                "ttft_p95_s",
                "ttft_p99_s",
            )
        }
    )
    out["cpu_s_by_role"] = out["median"]["cpu_s_by_role"]
    return out


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return round(num / den, 4) if num and den else None


def ratios(stock: dict, plugin: dict) -> dict:
    """output_tok_s / req_s: plugin over stock (higher is better); p50_s / p95_s / p99_s (end to end)
    and ttft_*: stock over plugin (above 1: the plugin's latency is that many times lower).
    Each from the medians; ``per_round`` pairs round i of each."""
    sm, pm = stock["median"], plugin["median"]
    out = {
        "output_tok_s": _ratio(pm["output_tok_s"], sm["output_tok_s"]),
        "req_s": _ratio(pm["req_s"], sm["req_s"]),
        "p50_s": _ratio(sm["e2e_p50_s"], pm["e2e_p50_s"]),
        "p95_s": _ratio(sm["e2e_p95_s"], pm["e2e_p95_s"]),
        "p99_s": _ratio(sm["e2e_p99_s"], pm["e2e_p99_s"]),
        "ttft_p50_s": _ratio(sm["ttft_p50_s"], pm["ttft_p50_s"]),
        "ttft_p99_s": _ratio(sm["ttft_p99_s"], pm["ttft_p99_s"]),
        "cpu_s_total": _ratio(pm["cpu_s_total"], sm["cpu_s_total"]),
    }
    out["per_round"] = [
        {"output_tok_s": _ratio(p["output_tok_s"], s["output_tok_s"]), "p99_s": _ratio(s["e2e_p99_s"], p["e2e_p99_s"])}
        for s, p in zip(stock["rounds"], plugin["rounds"])
    ]
    return out


def compare_sequential(stock_out: dict, plugin_out: dict, entries: list[dict]) -> dict:
    checked = identical = 0
    diffs = []
    by_id = {e["id"]: e for e in entries}
    for rid in [e["id"] for e in entries]:
        a, b = stock_out.get(rid), plugin_out.get(rid)
        if a is None or b is None:
            continue
        for x, y in zip(a, b):
            checked += 1
            if x == y:
                identical += 1
            else:
                first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                diffs.append(
                    {
                        "id": rid,
                        "kind": by_id[rid]["kind"],
                        "first_difference_at": first,
                        "stock_len": len(x),
                        "plugin_len": len(y),
                    }
                )
    missing = [rid for rid in by_id if rid not in stock_out or rid not in plugin_out]
    return {"checked": checked, "identical": identical, "differences": diffs[:20], "failed_requests": missing}


def run(
    entries: list[dict],
    *,
    rounds: int = 3,
    seq_requests: int = 18,
    ablate: bool = False,
    ablate_only: Optional[list] = None,
    details: Optional[str] = None,
    warmup: bool = True,
    speculative: Optional[str] = None,
) -> dict:
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    seq = _trace.sequential_subset(entries, seq_requests)
    workdir = Path(tempfile.mkdtemp(prefix="dsh-bench-serve-", dir="/tmp"))
    report: dict = {
        "rounds": rounds,
        "trace": _trace.describe(entries),
        "method": {
            "servers": (
                "DP2 (--dp-size 2 --tp-size 2 --enable-dp-attention), tiny DeepseekV3, same flags"
                if not speculative
                else f"DP2 (--dp-size 2 --tp-size 2 --enable-dp-attention --enable-dp-lm-head), tiny Qwen3 + tiny "
                f"random-weight {SPECULATIVE[speculative]['algorithm']} draft, same flags"
            ),
            "alternation": "stock, plugin, stock, plugin, ...; the idle server's process group is SIGSTOPped",
            "cache_state": "POST /flush_cache before every pass (radix cache, KV pools, grammar memory cache); "
            "the plugin's persistent grammar disk cache lives in a fresh directory of this run",
            "ratio": "output_tok_s/req_s: plugin/stock; p50_s/p95_s/p99_s (end-to-end) and ttft_*: stock/plugin",
            "warmup": "one uncounted pass per server before the gate (and per ablated server)" if warmup else "none",
        },
    }
    if speculative:
        from .. import tiny_models

        tiny_models.ensure_dspark_draft()
    _server._lock.acquire()  # one lock for the whole run (re-entrant: both servers run under it)
    servers: dict[str, Pausable] = {}
    try:
        servers["stock"] = start(stock_config(speculative))
        report["stock_ready_s"] = round(servers["stock"].server.ready_seconds, 1)
        servers["stock"].pause()
        servers["plugin"] = start(plugin_config(str(workdir / "grammar"), speculative=speculative))
        report["plugin_ready_s"] = round(servers["plugin"].server.ready_seconds, 1)
        servers["plugin"].pause()
        compare(servers["stock"], servers["plugin"], entries, seq, rounds, report, details, warmup)
        if speculative:
            report["speculative"] = speculative_report(speculative, report, servers["plugin"])
            feature, env = SPECULATIVE[speculative]["ablation"]
            servers.pop("plugin").stop()
            report["speculative"]["ablation"] = _ablate_one(
                entries,
                servers["stock"],
                plugin_config(
                    str(workdir / f"grammar-{feature}"), env, name=f"e2e-no-{feature}", speculative=speculative
                ),
                feature,
                env,
                report["plugin"]["median"],
                rounds,
            )
        if details:
            Path(details, "report-before-ablation.json").write_text(json.dumps(report, indent=2))
        # ablation: the plugin with one feature off, each followed by a stock round for reference
        if ablate and not speculative:
            servers.pop("plugin").stop()
            report["ablation"] = _ablate(entries, servers["stock"], workdir, report, ablate_only)
    finally:
        _stop_all(servers)
        shutil.rmtree(workdir, ignore_errors=True)  # the servers' grammar caches: nothing of it is reported
    report["ok"] = ok(report)
    return report


#: ``--compare-draft-masks``: the DSpark plugin server with the verify masked only, against the same server
#: with the draft masked too (feature ``dspark-draft-masks``)
DRAFT_MASKS_ENV = {"DSPARK_HARDEN_DSPARK_DRAFT_MASKS": "1"}


def run_draft_masks(
    entries: list[dict], *, rounds: int = 3, seq_requests: int = 18, details: Optional[str] = None, warmup: bool = True
) -> dict:
    """Two DSpark plugin servers (tiny Qwen3 + the tiny random draft, DP2): ``verify_only`` (stock drafting,
    the verify masked) and ``draft_masks`` (``DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1``), the sequential greedy gate
    (identical outputs expected: the target decides every token) and ``rounds`` alternating rounds. Accept
    length is tokens per verify step (the bonus token included), pooled over a round, per request kind too."""
    from .. import tiny_models

    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    tiny_models.ensure_dspark_draft()
    seq = _trace.sequential_subset(entries, seq_requests)
    workdir = Path(tempfile.mkdtemp(prefix="dsh-bench-draft-masks-", dir="/tmp"))
    inner: dict = {"rounds": rounds, "trace": _trace.describe(entries)}
    servers: dict[str, Pausable] = {}
    _server._lock.acquire()
    try:
        for name, env in (("verify_only", None), ("draft_masks", DRAFT_MASKS_ENV)):
            servers[name] = start(
                plugin_config(str(workdir / f"grammar-{name}"), env, name=f"e2e-{name}", speculative="dspark")
            )
            servers[name].pause()
        compare(servers["verify_only"], servers["draft_masks"], entries, seq, rounds, inner, details, warmup)
        servers["draft_masks"].resume()
        try:
            draft_metrics = servers["draft_masks"].server.metrics_text()
        finally:
            servers["draft_masks"].pause()
    finally:
        _stop_all(servers)
        shutil.rmtree(workdir, ignore_errors=True)

    def side(agg: dict) -> dict:
        def by(field: str) -> dict:
            keys = sorted({k for r in agg["rounds"] for k in r.get(field, {})})
            return {k: _median_of([r[field][k] for r in agg["rounds"] if k in r.get(field, {})]) for k in keys}

        return {
            "accept_length_mean": agg["median"].get("accept_length_mean"),
            "accept_length_spread": agg["spread"].get("accept_length_mean"),
            "accept_length_by_kind": by("accept_length_by_kind"),
            "accept_length_by_schema_shape": by("accept_length_by_schema_shape"),
            "output_tok_s": agg["median"].get("output_tok_s"),
            "output_tok_s_spread": agg["spread"].get("output_tok_s"),
            "errors": agg["errors"],
            "constrained_invalid": agg["constrained_invalid"],
        }

    vo, dm = side(inner["stock"]), side(inner["plugin"])
    masked = sum(
        float(v)
        for v in re.findall(
            r'^dspark_harden_dspark_draft_masked_tokens_total\{dp_rank="\d+"\} (\S+)$', draft_metrics, re.M
        )
    )
    report = {
        "method": {
            "servers": "DP2 (--dp-size 2 --tp-size 2 --enable-dp-attention --enable-dp-lm-head), tiny Qwen3 + tiny "
            "random-weight DSpark draft, both with the plugin and DSPARK_HARDEN_DSPARK_MASKS=1; draft_masks adds "
            "DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1",
            "alternation": "verify_only, draft_masks, ...; the idle server's process group is SIGSTOPped",
            "accept_length": "output tokens / verify steps (meta_info.spec_verify_ct), bonus token included, pooled per "
            "round; medians over rounds",
        },
        "rounds": rounds,
        "trace": inner["trace"],
        "verify_only": vo,
        "draft_masks": dm,
        "ratio": {
            "accept_length": _ratio(dm["accept_length_mean"], vo["accept_length_mean"]),
            "output_tok_s": _ratio(dm["output_tok_s"], vo["output_tok_s"]),
        },
        "identical_sequential": inner["identical_sequential"],
        "draft_masked_tokens": masked,
    }
    report["ok"] = bool(
        report["identical_sequential"]["checked"]
        and report["identical_sequential"]["identical"] == report["identical_sequential"]["checked"]
        and not vo["errors"]
        and not dm["errors"]
        and not vo["constrained_invalid"]
        and not dm["constrained_invalid"]
        and masked > 0
    )
    return report


def compare(
    stock: Pausable,
    plugin: Pausable,
    entries: list[dict],
    seq: list[dict],
    rounds: int,
    report: dict,
    details: Optional[str] = None,
    warmup: bool = True,
) -> dict:
    """The sequential gate, then ``rounds`` alternating concurrent rounds, on two started servers
    (both are left paused); fills ``report``."""
    servers = {"stock": stock, "plugin": plugin}
    # 0. one uncounted pass each: a fresh process's first large batches are slower (allocator,
    # thread pools) whichever server it is; every counted pass then starts equally warm
    for name in ("stock", "plugin") if warmup else ():
        log(f"warm-up pass on {name} (not counted)")
        one_pass(servers[name], entries)
    # 1. the sequential correctness gate: same cache state (flushed), same order, one at a time
    seq_out = {}
    for name in ("stock", "plugin"):
        log(f"sequential gate on {name}: {len(seq)} requests one at a time")
        seq_out[name] = one_pass(servers[name], seq, sequential=True)
    report["identical_sequential"] = compare_sequential(seq_out["stock"]["outputs"], seq_out["plugin"]["outputs"], seq)
    report["sequential_pass"] = {
        n: {k: seq_out[n]["summary"][k] for k in ("wall_s", "errors", "constrained_invalid")} for n in seq_out
    }
    if details:
        for n in seq_out:
            _write_details(details, f"{n}-sequential", seq_out[n]["results"])

    # 2. alternating concurrent rounds
    per: dict[str, list] = {"stock": [], "plugin": []}
    outs: dict[str, list] = {"stock": [], "plugin": []}
    for i in range(rounds):
        for name in ("stock", "plugin"):
            log(f"round {i + 1}/{rounds}: {name} ({len(entries)} entries)")
            res = one_pass(servers[name], entries)
            res["summary"]["round"] = i + 1
            per[name].append(res["summary"])
            outs[name].append(res["outputs"])
            log(
                f"  {name}: {json.dumps({k: res['summary'][k] for k in ('output_tok_s', 'e2e_p99_s', 'errors', 'constrained_invalid')})}"
            )
            if details:
                _write_details(details, f"{name}-round{i + 1}", res["results"])
    report["stock"] = aggregate(per["stock"])
    report["plugin"] = aggregate(per["plugin"])
    report["ratio"] = ratios(report["stock"], report["plugin"])
    s2s = [_client.identical_fraction(a, b) for a, b in zip(outs["stock"], outs["stock"][1:])]
    p2s = [_client.identical_fraction(a, b) for a, b in zip(outs["plugin"], outs["stock"])]
    report["identical_concurrent"] = {
        "stock_vs_stock": _median_of(s2s),
        "plugin_vs_stock": _median_of(p2s),
        "stock_vs_stock_per_pair": s2s,
        "plugin_vs_stock_per_round": p2s,
    }
    report["ok"] = ok(report)
    return report


def _ablate(entries: list[dict], stock: Pausable, workdir: Path, report: dict, only: Optional[list]) -> dict:
    out: dict = {"not_exercised": NOT_EXERCISED, "features": {}}
    full = report["plugin"]["median"]
    chosen = [(f, env) for f, env in ABLATIONS if not only or f in only]
    for feature, env in chosen:
        cfg = plugin_config(str(workdir / f"grammar-{feature}"), env, name=f"e2e-no-{feature}")
        p = start(cfg)
        p.pause()
        try:
            log(f"ablation: warm-up pass without {feature} (not counted)")
            one_pass(p, entries)
            log(f"ablation: plugin without {feature}")
            a = one_pass(p, entries)["summary"]
            log("ablation: stock reference round")
            s = one_pass(stock, entries)["summary"]
        finally:
            p.stop()
        out["features"][feature] = {
            "env": env,
            "output_tok_s": a["output_tok_s"],
            "e2e_p99_s": a["e2e_p99_s"],
            "errors": a["errors"],
            "cpu_s_total": a["cpu_s_total"],
            "vs_stock_same_time": {
                "output_tok_s": _ratio(a["output_tok_s"], s["output_tok_s"]),
                "p99_s": _ratio(s["e2e_p99_s"], a["e2e_p99_s"]),
            },
            "vs_full_plugin_median": {
                "output_tok_s": _ratio(a["output_tok_s"], full["output_tok_s"]),
                "p99_s": _ratio(full["e2e_p99_s"], a["e2e_p99_s"]),
            },
            "stock_reference": {k: s[k] for k in ("output_tok_s", "e2e_p99_s", "errors")},
        }
        log(f"  without {feature}: {json.dumps(out['features'][feature]['vs_stock_same_time'])}")
    return out


def speculative_report(speculative: str, report: dict, plugin: Pausable) -> dict:
    """The ``speculative`` object of the JSON: algorithm, accept length (tokens per verify step,
    median over rounds) of each server, the plugin's mask engine and mask steps (its /metrics,
    cumulative over the whole run)."""
    plugin.resume()
    try:
        masks = mask_state(plugin.server.metrics_text())
    finally:
        plugin.pause()
    engines = set(masks["engine_by_rank"].values())
    return {
        "algorithm": SPECULATIVE[speculative]["algorithm"],
        "accept_length_mean": {n: report[n]["median"].get("accept_length_mean") for n in ("stock", "plugin")},
        "accept_length_spread": {n: report[n]["spread"].get("accept_length_mean") for n in ("stock", "plugin")},
        "mask_engine": engines.pop() if len(engines) == 1 else (sorted(engines) or None),
        "mask_engine_by_rank": masks["engine_by_rank"],
        "mask_steps": masks["steps"],
    }


def _ablate_one(
    entries: list[dict], stock: Pausable, cfg: _server.ServerConfig, feature: str, env: dict, full: dict, rounds: int
) -> dict:
    """The plugin with ``feature`` off, ``rounds`` rounds alternating with stock reference rounds."""
    p = start(cfg)
    p.pause()
    mine, ref = [], []
    try:
        log(f"ablation: warm-up pass without {feature} (not counted)")
        one_pass(p, entries)
        for i in range(rounds):
            log(f"ablation round {i + 1}/{rounds}: plugin without {feature}, then stock")
            mine.append(one_pass(p, entries)["summary"])
            ref.append(one_pass(stock, entries)["summary"])
            log(f"  without {feature}: {mine[-1]['output_tok_s']} tok/s; stock {ref[-1]['output_tok_s']} tok/s")
    finally:
        p.stop()
    a, s = aggregate(mine), aggregate(ref)
    return {
        "feature": feature,
        "env": env,
        "rounds": rounds,
        "output_tok_s": a["output_tok_s"],
        "output_tok_s_spread": a["spread"].get("output_tok_s"),
        "e2e_p99_s": a["e2e_p99_s"],
        "errors": a["errors"],
        "constrained_invalid": a["constrained_invalid"],
        "accept_length_mean": a["median"].get("accept_length_mean"),
        "stock_reference": {
            "output_tok_s": s["output_tok_s"],
            "output_tok_s_spread": s["spread"].get("output_tok_s"),
            "errors": s["errors"],
        },
        "vs_stock_same_time": {
            "output_tok_s": _ratio(a["output_tok_s"], s["output_tok_s"]),
            "p99_s": _ratio(s["e2e_p99_s"], a["e2e_p99_s"]),
        },
        "vs_full_plugin_median": {
            "output_tok_s": _ratio(a["output_tok_s"], full["output_tok_s"]),
            "p99_s": _ratio(full["e2e_p99_s"], a["e2e_p99_s"]),
        },
    }


def _median_of(vals: list) -> Optional[float]:
    vals = [v for v in vals if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _write_details(directory: str, name: str, results: list) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"{name}.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(_client.as_dict(r)) + "\n")


def ok(report: dict) -> bool:
    """The bench's gates: sequential outputs identical, no errors, every constrained output valid."""
    seq = report.get("identical_sequential", {})
    good = bool(seq.get("checked")) and seq.get("identical") == seq.get("checked") and not seq.get("failed_requests")
    for name in ("stock", "plugin"):
        if name in report:
            good = good and report[name]["errors"] == 0 and report[name]["constrained_invalid"] == 0
    for a in report.get("ablation", {}).get("features", {}).values():
        good = good and a["errors"] == 0
    spec_abl = report.get("speculative", {}).get("ablation")
    if spec_abl:
        good = good and spec_abl["errors"] == 0 and spec_abl["constrained_invalid"] == 0
    return good


def _term_as_interrupt(signum, frame):  # SIGTERM stops the servers like Ctrl-C does
    raise KeyboardInterrupt


def main(args) -> int:
    import signal

    signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        if args.trace:
            entries = _trace.load(args.trace)
        else:
            speculative = getattr(args, "speculative", None)
            entries = _trace.generate(
                seed=args.seed,
                requests=args.requests,
                rate=args.rate,
                mix=_trace.CONSTRAINED_MIX if speculative else None,
            )
        corpus_info = None
        if getattr(args, "corpus", None):
            tok_dir = _server.model_path(base_config(getattr(args, "speculative", None)))
            extra, corpus_info = _trace.corpus_entries(args.corpus, entries, seed=args.seed, tokenizer_dir=tok_dir)
            entries = sorted(entries + extra, key=lambda e: e["t"])
    except (_trace.TraceError, ValueError, OSError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    if args.write_trace:
        _trace.dump(entries, args.write_trace)
    problem = _server.cpu_platform_problem()
    if problem:
        print(f"bench serve: {problem}", file=sys.stderr)
        return 2
    only = [f.strip() for f in args.ablate_features.split(",")] if args.ablate_features else None
    if only:
        unknown = [f for f in only if f not in dict(ABLATIONS)]
        if unknown:
            print(
                f"bench serve: --ablate-features: unknown {unknown}; known: {[f for f, _ in ABLATIONS]}",
                file=sys.stderr,
            )
            return 2
    if getattr(args, "compare_draft_masks", False):
        if getattr(args, "speculative", None) != "dspark":
            print("bench serve: --compare-draft-masks needs --speculative dspark", file=sys.stderr)
            return 2
        report = run_draft_masks(
            entries, rounds=args.rounds, seq_requests=args.seq_requests, details=args.details, warmup=not args.no_warmup
        )
        print(json.dumps(report, indent=2) if args.json else human_draft_masks(report))
        return 0 if report["ok"] else 1
    report = run(
        entries,
        rounds=args.rounds,
        seq_requests=args.seq_requests,
        ablate=args.ablate or bool(only),
        ablate_only=only,
        details=args.details,
        warmup=not args.no_warmup,
        speculative=getattr(args, "speculative", None),
    )
    if corpus_info:
        report["corpus"] = corpus_info
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(human(report))
    return 0 if report["ok"] else 1


def human_draft_masks(r: dict) -> str:
    lines = [f"trace: {json.dumps(r['trace'])}"]
    for name in ("verify_only", "draft_masks"):
        m = r[name]
        lines.append(
            f"{name}: accept length {m['accept_length_mean']} (by kind {json.dumps(m['accept_length_by_kind'])}), "
            f"{m['output_tok_s']} tok/s, errors {m['errors']}, invalid {m['constrained_invalid']}"
        )
    lines.append(f"ratio draft_masks/verify_only: {json.dumps(r['ratio'])}")
    lines.append(
        f"identical sequential: {json.dumps({k: r['identical_sequential'][k] for k in ('checked', 'identical')})}"
    )
    lines.append(f"draft positions masked: {r['draft_masked_tokens']}; ok: {r['ok']}")
    return "\n".join(lines)


def human(r: dict) -> str:
    lines = [f"trace: {json.dumps(r['trace'])}"]
    for name in ("stock", "plugin"):
        m = r[name]["median"]
        lines.append(
            f"{name:6s}: {m['output_tok_s']} tok/s, {m['req_s']} req/s, e2e p50/p95/p99 "
            f"{m['e2e_p50_s']}/{m['e2e_p95_s']}/{m['e2e_p99_s']} s, ttft p50/p99 {m['ttft_p50_s']}/{m['ttft_p99_s']} s, "
            f"errors {r[name]['errors']}, cpu-s {m['cpu_s_by_role']} (medians of {r['rounds']} rounds)"
        )
    lines.append(f"ratio : {json.dumps({k: v for k, v in r['ratio'].items() if k != 'per_round'})}")
    lines.append(
        f"sequential identical: {r['identical_sequential']['identical']}/{r['identical_sequential']['checked']}"
    )
    lines.append(f"concurrent identical: {json.dumps(r['identical_concurrent'])}")
    for f, a in r.get("ablation", {}).get("features", {}).items():
        lines.append(
            f"without {f}: {json.dumps(a['vs_stock_same_time'])} vs stock, {json.dumps(a['vs_full_plugin_median'])} vs full plugin"
        )
    if "speculative" in r:
        sp = r["speculative"]
        lines.append(
            f"speculative: {sp['algorithm']}, accept length {json.dumps(sp['accept_length_mean'])}, "
            f"mask engine {sp['mask_engine']}, mask steps {json.dumps(sp['mask_steps'])}"
        )
        if sp.get("ablation"):
            ab = sp["ablation"]
            lines.append(
                f"without {ab['feature']}: {ab['output_tok_s']} tok/s, {json.dumps(ab['vs_stock_same_time'])} vs stock"
            )
    lines.append("ok" if r["ok"] else "NOT OK")
    return "\n".join(lines)
