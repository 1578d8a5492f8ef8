"""CLI: ``dspark-harden metrics-lint``, ``dspark-harden dashboard``, ``dspark-harden bench scheduler-phases``."""

from __future__ import annotations

import json
import statistics
import sys
import time


def register(subparsers, bench_subparsers) -> None:
    p = subparsers.add_parser(
        "metrics-lint",
        help="scrape a running server's /metrics; report metric-convention problems and dashboard "
        "queries that return no data",
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:30000/metrics", help="server URL or its /metrics URL (default %(default)s)"
    )
    p.add_argument(
        "--prometheus",
        metavar="URL",
        help="evaluate every dashboard query against this Prometheus (which scrapes the server)",
    )
    p.add_argument(
        "--dashboard",
        action="append",
        default=[],
        metavar="JSON",
        help="also check this Grafana dashboard file (repeatable); the built-in overview is always checked",
    )
    p.add_argument("--no-builtin-dashboard", action="store_true", help="do not check the built-in overview dashboard")
    p.add_argument(
        "--window", default="5m", help="value for $__rate_interval when evaluating queries (default %(default)s)"
    )
    p.add_argument(
        "--all-families",
        action="store_true",
        help="also lint SGLang's own families (sglang:* names break Prometheus conventions by design)",
    )
    p.add_argument("--max-label-values", type=int, default=64)
    p.add_argument("--max-series", type=int, default=512)
    p.add_argument(
        "--promtool",
        choices=("auto", "off", "require"),
        default="auto",
        help="run `promtool check metrics` on the scrape (auto: when installed)",
    )
    p.add_argument(
        "--strict", action="store_true", help="treat notes (e.g. panels of features that are off) as problems"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=lint_main)

    p = subparsers.add_parser(
        "metrics-summary",
        help="scrape a running server once; per feature: where it is bound, how often it ran, its key figure",
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:30000", help="server URL or its /metrics URL (default %(default)s)"
    )
    p.add_argument("--include-test-features", action="store_true", help="also show test-only features")
    p.set_defaults(func=summary_main)

    p = subparsers.add_parser(
        "dashboard", help="print the Grafana overview dashboard generated from the declared metrics"
    )
    p.add_argument("--out", metavar="PATH", help="write it to PATH instead of stdout")
    p.add_argument(
        "--extensions",
        action="store_true",
        help="also add panels for installed third-party features' families (the shipped dashboard has none)",
    )
    p.set_defaults(func=dashboard_main)

    b = bench_subparsers.add_parser(
        "scheduler-phases",
        help="per-call overhead of the scheduler-phase timing wrapper vs the bare call, same run (JSON)",
    )
    b.add_argument("--calls", type=int, default=200_000)
    b.add_argument("--repeats", type=int, default=5)
    b.set_defaults(func=bench_main)


def lint_main(args) -> int:
    from . import lint

    if args.max_label_values <= 0 or args.max_series <= 0:
        print("metrics-lint: --max-label-values and --max-series must be positive", file=sys.stderr)
        return 2
    try:
        result = lint.run(
            args.url,
            dashboards=args.dashboard,
            use_builtin_dashboard=not args.no_builtin_dashboard,
            prometheus=args.prometheus,
            window=args.window,
            own_only=not args.all_families,
            max_label_values=args.max_label_values,
            max_series=args.max_series,
            promtool=args.promtool,
            strict=args.strict,
        )
    except OSError as exc:
        print(f"metrics-lint: cannot scrape {lint.metrics_url(args.url)}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for f in result.findings:
            print(f)
        print(
            f"metrics-lint: {result.url}: {result.families} dspark_harden families, "
            f"{len(result.problems)} problem(s), {len(result.findings) - len(result.problems)} note(s)"
        )
    return 1 if result.problems else 0


def summary_main(args) -> int:
    from . import lint, summary

    try:
        text = lint.scrape(lint.metrics_url(args.url))
    except Exception as exc:  # noqa: BLE001 - any scrape failure is a usage problem
        print(f"metrics-summary: cannot scrape {lint.metrics_url(args.url)}: {exc}", file=sys.stderr)
        return 2
    hide = set() if args.include_test_features else summary.test_only_features()
    for line in summary.summarize(text, hide=hide):
        print(line)
    return 0


def dashboard_main(args) -> int:
    from . import dashboard

    text = dashboard.render(extensions=args.extensions)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


def bench_main(args) -> int:
    """Same run, same process: a bare method call vs the same call through the phase wrapper."""
    from . import phases

    if args.calls <= 0 or args.repeats <= 0:
        print("bench scheduler-phases: --calls and --repeats must be positive", file=sys.stderr)
        return 2
    # a private recorder that never flushes during the timed loop (flush cost measured separately)
    rec = phases.PhaseRecorder(interval_s=1e9)
    saved = phases.RECORDER
    phases.RECORDER = rec
    try:

        class Loop:
            def step(self, x):
                return x

        bare = Loop.step
        wrapped = phases.timed(bare, "run_batch")
        obj = Loop()

        def measure(fn) -> float:
            n = args.calls
            t0 = time.perf_counter_ns()
            for i in range(n):
                fn(obj, i)
            return (time.perf_counter_ns() - t0) / n

        bare_ns, wrapped_ns = [], []
        for _ in range(args.repeats):
            bare_ns.append(measure(bare))
            wrapped_ns.append(measure(wrapped))
        flush_ns = []
        from ..core import metrics

        for _ in range(max(3, args.repeats)):
            rec.observe(0, 1e-3, 0.0)
            t0 = time.perf_counter_ns()
            rec.flush()
            flush_ns.append(time.perf_counter_ns() - t0)
    finally:
        phases.RECORDER = saved
    out = {
        "bench": "scheduler-phases",
        "calls": args.calls,
        "repeats": args.repeats,
        "bare_call_ns_median": statistics.median(bare_ns),
        "wrapped_call_ns_median": statistics.median(wrapped_ns),
        "overhead_ns_per_call_median": statistics.median(w - b for w, b in zip(wrapped_ns, bare_ns)),
        "flush_ns_median": statistics.median(flush_ns),
        "flushes_per_second": 1.0,
        "multiprocess": bool(metrics._has_multiproc_env()),
    }
    print(json.dumps(out))
    return 0
