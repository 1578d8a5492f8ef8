"""Child process of ``dspark-harden check``: runs SGLang's own ``load_plugins()`` for one role."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

from .check import _MARK


def _report() -> dict:
    role = os.environ["DSPARK_HARDEN_ROLE"]
    from ..core import binder
    from ..entry import PLUGIN_NAME

    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == PLUGIN_NAME]
    base = {"role": role, "sglang_version": binder.sglang_version(), "plugin_loaded": False, "features": [], "errors": []}
    if not eps:
        base["errors"].append(f"no entry point {PLUGIN_NAME!r} in group sglang.srt.plugins: is dspark-harden installed in this environment?")
        return base
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        base["errors"].append(
            f"SGLANG_PLUGINS={allowed!r} does not name {PLUGIN_NAME}: SGLang would not load the plugin at all "
            f"(set SGLANG_PLUGINS={PLUGIN_NAME} or include it in the list)"
        )
        return base
    from sglang.srt.plugins import load_plugins

    error = None
    try:
        load_plugins()
    except binder.BindError as exc:
        error = exc
    if binder.STATE.report is None:
        base["errors"].append(str(error) if error else "load_plugins() returned without running the dspark_harden entry point")
        return base
    rep = binder.STATE.report.to_dict()
    rep["plugin_loaded"] = True
    return rep


def main() -> int:
    try:
        rep = _report()
    except BaseException as exc:  # noqa: BLE001 - the parent needs a report whatever happens
        rep = {"role": os.environ.get("DSPARK_HARDEN_ROLE", "?"), "plugin_loaded": False, "features": [],
               "sglang_version": "?", "errors": [f"{type(exc).__name__}: {exc}"]}
    sys.stdout.write(_MARK + json.dumps(rep) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
