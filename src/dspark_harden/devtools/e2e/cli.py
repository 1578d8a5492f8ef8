"""Argument parsers of ``dspark-harden bench serve`` and ``dspark-harden bench soak`` (the core CLI
registers them; nothing heavy is imported until a command runs)."""

from __future__ import annotations


def _positive_int(text: str) -> int:
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def register(bench_subparsers) -> None:
    b = bench_subparsers.add_parser(
        "serve",
        help="production-shaped replay against a real stock DP2 server and a plugin DP2 server, "
        "alternating rounds, with the correctness gates (docs/e2e.md)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--rounds", type=_positive_int, default=3, help="rounds per server (default %(default)s)")
    b.add_argument("--trace", metavar="FILE", help="replay this JSONL trace instead of the generated one")
    b.add_argument(
        "--rate",
        type=_positive_float,
        default=4.0,
        help="Poisson arrival rate of the generated trace, entries/s (default %(default)s)",
    )
    b.add_argument(
        "--requests",
        type=_positive_int,
        default=120,
        help="entries in the generated trace (a routed batch of 64 is one entry; default %(default)s)",
    )
    b.add_argument("--seed", type=int, default=0, help="seed of the generated trace (default %(default)s)")
    b.add_argument(
        "--seq-requests",
        type=_positive_int,
        default=18,
        help="requests of the sequential correctness gate, each capped at 16 output tokens (default %(default)s)",
    )
    b.add_argument("--ablate", action="store_true", help="also run the plugin once with each feature off in turn")
    b.add_argument("--ablate-features", metavar="A,B", help="ablate only these features (implies --ablate)")
    b.add_argument(
        "--speculative",
        choices=["dspark"],
        help="compare stock and plugin with this speculative algorithm (DSpark: Qwen3 tiny + the tiny DSpark "
        "draft, trace weighted towards constrained requests, DSPARK_HARDEN_DSPARK_MASKS ablated; "
        "--ablate is not combined with it)",
    )
    b.add_argument(
        "--compare-draft-masks",
        action="store_true",
        help="with --speculative dspark: the plugin with the verify masked only against the plugin with the draft "
        "masked too (DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1), alternating rounds; accept length and output tok/s, "
        "identical greedy outputs (docs/dspark_masks.md)",
    )
    b.add_argument(
        "--corpus",
        type=_positive_int,
        metavar="N",
        help="add N json_schema requests drawn from the JSON Schema Test Suite (the schemas xgrammar "
        "compiles; each output validated with its schema's draft) to the trace",
    )
    b.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up pass per server")
    b.add_argument("--write-trace", metavar="FILE", help="also write the replayed trace as JSONL")
    b.add_argument(
        "--details", metavar="DIR", help="write every request's result (outputs included) per round as JSONL"
    )
    b.set_defaults(func=_serve)

    s = bench_subparsers.add_parser(
        "soak",
        help="constant mixed load on a real plugin DP2 server for --minutes: 5xx, health, RSS slope, "
        "fds, /dev/shm, grammar cache bytes; --adversarial adds abusive input (docs/e2e.md)",
    )
    s.add_argument("--minutes", type=_positive_float, required=True, help="how long to load the server")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--rate", type=_positive_float, default=4.0, help="well-formed entries/s (default %(default)s)")
    s.add_argument("--seed", type=int, default=1)
    s.add_argument(
        "--adversarial",
        action="store_true",
        help="fault-injection mode: abusive requests during the soak, and a clean phase to compare",
    )
    s.add_argument(
        "--skip-abuse", metavar="A,B", help="leave these abuses out of --adversarial (names as in the report)"
    )
    s.add_argument(
        "--poll-s", type=_positive_float, default=5.0, help="health / process sampling period (default %(default)s)"
    )
    s.add_argument(
        "--stock",
        action="store_true",
        help="soak the same DP2 server without the plugin (RSS / fd reference; not with --adversarial)",
    )
    s.set_defaults(func=_soak)


def _serve(args) -> int:
    from . import serve

    return serve.main(args)


def _soak(args) -> int:
    from . import soak

    return soak.main(args)
