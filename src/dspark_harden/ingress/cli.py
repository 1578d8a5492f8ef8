"""CLI of the ingress features: ``dspark-harden bench controller``."""

from __future__ import annotations


def register(subparsers, bench_subparsers) -> None:
    """``dspark-harden bench controller`` (registered by the feature's ``dspark_cli`` hook)."""
    p = bench_subparsers.add_parser(
        "controller",
        help="idle CPU and dispatch latency of the stock vs the blocking DP controller loop (alternating runs)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument(
        "--idle-seconds", type=float, default=3.0, help="idle window per loop (CPU is scaled to 10 s); default 3"
    )
    p.add_argument("--requests", type=int, default=300, help="requests timed per loop; default 300")
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--runs", type=int, default=5, help="runs, each timing both loops in alternating order; default 5")
    p.add_argument("--blocks", type=int, default=6, help="alternating latency blocks per controller and run; default 6")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the controllers and the bench process to separate CPUs (default: pinned)",
    )
    p.add_argument(
        "--spin-us",
        type=int,
        default=None,
        help="our loop's busy-poll window after a message (default: DSPARK_HARDEN_DP_CONTROLLER_SPIN_US's default)",
    )

    def run(args) -> int:
        import json

        from .bench import run_controller_bench

        result = run_controller_bench(
            idle_seconds=args.idle_seconds,
            n_requests=args.requests,
            dp_size=args.dp_size,
            runs=args.runs,
            spin_us=args.spin_us,
            blocks=args.blocks,
            pin=not args.no_pin,
        )
        if args.json:
            print(json.dumps(result))
            return 0
        print(
            f"{'run':>3} {'order':13} {'stock idle':>10} {'ours idle':>10} {'stock p50':>10} {'ours p50':>10}"
            "   (idle: CPU-s per 10 s; p50: us)"
        )
        for i, r in enumerate(result["runs"]):
            print(
                f"{i:>3} {r['order']:13} {r['stock_idle_cpu_s_per_10s']:>10.3f} {r['harden_idle_cpu_s_per_10s']:>10.3f} "
                f"{r['stock_dispatch_p50_us']:>10.1f} {r['harden_dispatch_p50_us']:>10.1f}"
            )
        for k in (
            "stock_idle_cpu_s_per_10s",
            "harden_idle_cpu_s_per_10s",
            "stock_dispatch_p50_us",
            "harden_dispatch_p50_us",
        ):
            v = result[k]
            print(f"{k:28s} median {v['median']:.3f}  min {v['min']:.3f}  max {v['max']:.3f}")
        print(f"runs with our p50 <= stock's: {result['harden_p50_le_stock_runs']} of {len(result['runs'])}")
        return 0

    p.set_defaults(func=run)
