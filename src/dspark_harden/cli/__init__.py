"""``dspark-harden`` console script: self-check, settings, patch ledger, benches, operator tools."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..devtools.e2e import cli as _e2e_cli
from . import check as _check
from . import ledger as _ledger
from . import metrics_ref as _metrics_ref
from . import port_report as _port_report
from . import profiles as _profiles


def build_parser(pm=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-harden", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="bind and verify the plugin in a fresh child per process role")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--role", action="append", choices=[r for r in _check.ROLES], help="only these roles")
    p.add_argument(
        "--include-test-features",
        action="store_true",
        help="also list test-only features (e.g. dspark-testsupport's), hidden by default unless failed",
    )
    p.add_argument(
        "--profile",
        choices=sorted(_profiles.PROFILES),
        help="also fail unless this deployment's features bind in its role "
        "(dsv4-dspark-dp2: docs/deploy-dsv4-dspark-dp2.md)",
    )
    p.add_argument(
        "--skip-cuda-features",
        action="store_true",
        help="with --profile, on a host without CUDA: leave the profile's CUDA-only features unchecked "
        "(the verdict says PARTIAL)",
    )
    p.add_argument(
        "launch",
        nargs=argparse.REMAINDER,
        help="after --: the sglang launch arguments (python -m sglang.launch_server ARGS); each feature is "
        "judged against them, parsed and resolved with SGLang's own parser: bound (applies), unavailable "
        "(why), or failed (startup would be refused)",
    )
    p.set_defaults(func=_check.main)

    p = sub.add_parser("env", help="every environment variable the plugin reads")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="the text of docs/settings.md")
    p.set_defaults(func=_ledger.env_main)

    p = sub.add_parser("metrics", help="every metric family the installed features declare")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="the text of docs/metrics.md (built-in features)")
    p.add_argument(
        "--extensions",
        action="store_true",
        help="with --markdown: also document installed third-party features' families",
    )
    p.set_defaults(func=_metrics_ref.main)

    p = sub.add_parser("patches", help="the patch ledger: target, why, retire-when")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_ledger.patches_main)

    _port_report.register(sub)

    bench = sub.add_parser("bench", help="benchmarks against the stock path in the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    _e2e_cli.register(bench_sub)  # bench serve / bench soak: devtools, not a feature (docs/e2e.md)

    if pm is None:
        from ..core.manager import make_manager

        pm = make_manager()
    pm.hook.dspark_cli(subparsers=sub, bench_subparsers=bench_sub)
    return parser


def main(argv: Optional[list] = None) -> int:
    from ..core.manager import ExtensionError

    try:
        parser = build_parser()
    except ExtensionError as exc:  # a broken third-party feature: one clear line, no traceback
        print(f"dspark-harden: {exc} (DSPARK_HARDEN_STRICT_EXTENSIONS=0 skips it, with an ERROR log)", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
