"""Argument parser of ``dspark-harden bench prefill-admission`` (registered by the feature's
``dspark_cli`` hook; imports neither the feature module nor, until it runs, the bench)."""

from __future__ import annotations

import argparse

from .decision import DEFAULT_PADDING_FACTOR


def _buckets(raw: str) -> list:
    try:
        values = [int(v) for v in raw.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"buckets must be positive integers, got {raw!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"buckets must be positive integers, got {raw!r}")
    return values


def _positive(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {raw!r}")
    return value


def _factor(raw: str) -> float:
    from .settings import padding_factor

    try:
        return padding_factor(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "prefill-admission",
        help="DP2 prefill CUDA-graph admission: stock vs dspark-harden on a trace (splits, coverage, padding)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="replay this JSONL trace instead of the built-in generator (format: docs/prefill_graph.md#trace-format)",
    )
    p.add_argument(
        "--buckets",
        type=_buckets,
        metavar="N[,N...]",
        help="captured token buckets (default: stock's list for --chunked-prefill-size 16384)",
    )
    p.add_argument(
        "--factor",
        type=_factor,
        default=DEFAULT_PADDING_FACTOR,
        help=f"harden padding factor, 1 < f <= 8 (default {DEFAULT_PADDING_FACTOR:g})",
    )
    p.add_argument(
        "--backend",
        choices=("full", "breakable"),
        default="full",
        help="prefill CUDA-graph backend (full: DeepSeek-V4 target with its backend hooks, request slots "
        "and chunked-prefix variants; breakable: decoding peers are converted to 1-token extends)",
    )
    p.add_argument(
        "--spec",
        choices=("none", "dspark"),
        default="none",
        help="speculative algorithm of the target (dspark: its worker passes capture mode FULL)",
    )
    p.add_argument(
        "--steps",
        type=_positive,
        default=None,
        help="length of the built-in trace (default 4000; ignored with --trace)",
    )

    def run(args):
        from .bench import main

        return main(args)

    p.set_defaults(func=run)
