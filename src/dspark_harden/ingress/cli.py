"""CLI of the ingress features: ``dspark-harden bench controller``."""

from __future__ import annotations


def register(subparsers, bench_subparsers) -> None:
    """``dspark-harden bench controller`` (registered by the feature's ``dspark_cli`` hook)."""
    p = bench_subparsers.add_parser(
        "controller",
        help="idle CPU and dispatch latency of the stock vs the blocking DP controller loop (one run)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--idle-seconds", type=float, default=3.0,
                   help="idle window per loop (CPU is scaled to 10 s); default 3")
    p.add_argument("--requests", type=int, default=300, help="requests timed per loop; default 300")
    p.add_argument("--dp-size", type=int, default=2)

    def run(args) -> int:
        import json

        from .bench import run_controller_bench

        result = run_controller_bench(idle_seconds=args.idle_seconds, n_requests=args.requests,
                                      dp_size=args.dp_size)
        if args.json:
            print(json.dumps(result))
        else:
            for k, v in result.items():
                print(f"{k:32s} {v:.3f}")
        return 0

    p.set_defaults(func=run)
