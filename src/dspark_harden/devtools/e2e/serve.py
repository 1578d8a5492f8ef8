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

SUMMARY_KEYS = ("output_tok_s", "req_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s", "ttft_p50_s", "ttft_p95_s",
                "ttft_p99_s", "wall_s", "errors", "constrained_invalid", "constrained_truncated")


def log(msg: str) -> None:
    sys.stderr.write(f"[bench serve {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def stock_config() -> _server.ServerConfig:
    c = _server.DP2_CONFIG
    return _server.ServerConfig(**{**c.__dict__, "plugins": None, "name": "e2e-stock"})


def plugin_config(grammar_dir: str, off: Optional[dict] = None, name: str = "e2e-plugin") -> _server.ServerConfig:
    env = {**PLUGIN_ENV, "DSPARK_HARDEN_GRAMMAR_DISK_DIR": grammar_dir, **(off or {})}
    c = _server.DP2_CONFIG.with_env(**env)
    return _server.ServerConfig(**{**c.__dict__, "name": name})


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
                raise _server.ServerError(self.server._failure(f"/flush_cache answered HTTP {r.status_code}: {r.text[:300]}"))
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
    results, wall = _client.replay(p.server.url, entries, sequential=sequential,
                                   stream_override=False if sequential else None)
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
    out["median"]["cpu_s_by_role"] = {role: round(statistics.median(
        [r["cpu_s_by_role"].get(role, 0.0) for r in rounds]), 3) for role in roles}
    out["median"]["cpu_s_total"] = _median(rounds, "cpu_s_total")
    out["spread"] = {k: [min(v), max(v)] for k in SUMMARY_KEYS
                     if (v := [r[k] for r in rounds if r.get(k) is not None])}
    out["errors"] = sum(r["errors"] for r in rounds)
    out["constrained_invalid"] = sum(r["constrained_invalid"] for r in rounds)
    out["rounds"] = rounds
    out.update({k: out["median"][k] for k in ("output_tok_s", "req_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s",
                                             "ttft_p50_s", "ttft_p95_s", "ttft_p99_s")})
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
    out["per_round"] = [{"output_tok_s": _ratio(p["output_tok_s"], s["output_tok_s"]),
                         "p99_s": _ratio(s["e2e_p99_s"], p["e2e_p99_s"])}
                        for s, p in zip(stock["rounds"], plugin["rounds"])]
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
                diffs.append({"id": rid, "kind": by_id[rid]["kind"], "first_difference_at": first,
                              "stock_len": len(x), "plugin_len": len(y)})
    missing = [rid for rid in by_id if rid not in stock_out or rid not in plugin_out]
    return {"checked": checked, "identical": identical, "differences": diffs[:20], "failed_requests": missing}


def run(entries: list[dict], *, rounds: int = 3, seq_requests: int = 18, ablate: bool = False,
        ablate_only: Optional[list] = None, details: Optional[str] = None, warmup: bool = True) -> dict:
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    seq = _trace.sequential_subset(entries, seq_requests)
    workdir = Path(tempfile.mkdtemp(prefix="dsh-bench-serve-", dir="/tmp"))
    report: dict = {"rounds": rounds, "trace": _trace.describe(entries), "method": {
        "servers": "DP2 (--dp-size 2 --tp-size 2 --enable-dp-attention), tiny DeepseekV3, same flags",
        "alternation": "stock, plugin, stock, plugin, ...; the idle server's process group is SIGSTOPped",
        "cache_state": "POST /flush_cache before every pass (radix cache, KV pools, grammar memory cache); "
                       "the plugin's persistent grammar disk cache lives in a fresh directory of this run",
        "ratio": "output_tok_s/req_s: plugin/stock; p50_s/p95_s/p99_s (end-to-end) and ttft_*: stock/plugin",
        "warmup": "one uncounted pass per server before the gate (and per ablated server)" if warmup else "none",
    }}
    _server._lock.acquire()  # one lock for the whole run (re-entrant: both servers run under it)
    servers: dict[str, Pausable] = {}
    try:
        servers["stock"] = start(stock_config())
        report["stock_ready_s"] = round(servers["stock"].server.ready_seconds, 1)
        servers["stock"].pause()
        servers["plugin"] = start(plugin_config(str(workdir / "grammar")))
        report["plugin_ready_s"] = round(servers["plugin"].server.ready_seconds, 1)
        servers["plugin"].pause()
        compare(servers["stock"], servers["plugin"], entries, seq, rounds, report, details, warmup)
        if details:
            Path(details, "report-before-ablation.json").write_text(json.dumps(report, indent=2))
        # ablation: the plugin with one feature off, each followed by a stock round for reference
        if ablate:
            servers.pop("plugin").stop()
            report["ablation"] = _ablate(entries, servers["stock"], workdir, report, ablate_only)
    finally:
        for p in servers.values():
            try:
                p.stop()
            except Exception as exc:  # noqa: BLE001
                log(f"stopping {p.server.config.name}: {exc}")
        _server._lock.release()
    report["ok"] = ok(report)
    return report


def compare(stock: Pausable, plugin: Pausable, entries: list[dict], seq: list[dict], rounds: int,
            report: dict, details: Optional[str] = None, warmup: bool = True) -> dict:
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
    report["sequential_pass"] = {n: {k: seq_out[n]["summary"][k] for k in ("wall_s", "errors", "constrained_invalid")}
                                 for n in seq_out}
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
            log(f"  {name}: {json.dumps({k: res['summary'][k] for k in ('output_tok_s', 'e2e_p99_s', 'errors', 'constrained_invalid')})}")
            if details:
                _write_details(details, f"{name}-round{i + 1}", res["results"])
    report["stock"] = aggregate(per["stock"])
    report["plugin"] = aggregate(per["plugin"])
    report["ratio"] = ratios(report["stock"], report["plugin"])
    s2s = [_client.identical_fraction(a, b) for a, b in zip(outs["stock"], outs["stock"][1:])]
    p2s = [_client.identical_fraction(a, b) for a, b in zip(outs["plugin"], outs["stock"])]
    report["identical_concurrent"] = {
        "stock_vs_stock": _median_of(s2s), "plugin_vs_stock": _median_of(p2s),
        "stock_vs_stock_per_pair": s2s, "plugin_vs_stock_per_round": p2s,
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
            "output_tok_s": a["output_tok_s"], "e2e_p99_s": a["e2e_p99_s"], "errors": a["errors"],
            "cpu_s_total": a["cpu_s_total"],
            "vs_stock_same_time": {"output_tok_s": _ratio(a["output_tok_s"], s["output_tok_s"]),
                                   "p99_s": _ratio(s["e2e_p99_s"], a["e2e_p99_s"])},
            "vs_full_plugin_median": {"output_tok_s": _ratio(a["output_tok_s"], full["output_tok_s"]),
                                      "p99_s": _ratio(full["e2e_p99_s"], a["e2e_p99_s"])},
            "stock_reference": {k: s[k] for k in ("output_tok_s", "e2e_p99_s", "errors")},
        }
        log(f"  without {feature}: {json.dumps(out['features'][feature]['vs_stock_same_time'])}")
    return out


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
            entries = _trace.generate(seed=args.seed, requests=args.requests, rate=args.rate)
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
            print(f"bench serve: --ablate-features: unknown {unknown}; known: {[f for f, _ in ABLATIONS]}", file=sys.stderr)
            return 2
    report = run(entries, rounds=args.rounds, seq_requests=args.seq_requests, ablate=args.ablate or bool(only),
                 ablate_only=only, details=args.details, warmup=not args.no_warmup)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(human(report))
    return 0 if report["ok"] else 1


def human(r: dict) -> str:
    lines = [f"trace: {json.dumps(r['trace'])}"]
    for name in ("stock", "plugin"):
        m = r[name]["median"]
        lines.append(f"{name:6s}: {m['output_tok_s']} tok/s, {m['req_s']} req/s, e2e p50/p95/p99 "
                     f"{m['e2e_p50_s']}/{m['e2e_p95_s']}/{m['e2e_p99_s']} s, ttft p50/p99 {m['ttft_p50_s']}/{m['ttft_p99_s']} s, "
                     f"errors {r[name]['errors']}, cpu-s {m['cpu_s_by_role']} (medians of {r['rounds']} rounds)")
    lines.append(f"ratio : {json.dumps({k: v for k, v in r['ratio'].items() if k != 'per_round'})}")
    lines.append(f"sequential identical: {r['identical_sequential']['identical']}/{r['identical_sequential']['checked']}")
    lines.append(f"concurrent identical: {json.dumps(r['identical_concurrent'])}")
    for f, a in r.get("ablation", {}).get("features", {}).items():
        lines.append(f"without {f}: {json.dumps(a['vs_stock_same_time'])} vs stock, {json.dumps(a['vs_full_plugin_median'])} vs full plugin")
    lines.append("ok" if r["ok"] else "NOT OK")
    return "\n".join(lines)
