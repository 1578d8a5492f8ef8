"""``dspark-harden check``: load the plugin the way SGLang does, in a fresh child per role."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from ..core import feature as F

ROLES = ("main", "controller", "scheduler", "detokenizer")
_MARK = "@@DSPARK_CHECK@@"
# worst wins when merging one feature's status across roles
_RANK = {F.FAILED: 4, F.BOUND: 3, F.UPSTREAM: 2, F.UNAVAILABLE: 1, F.DISABLED: 0}


def run_child(role: str, env: dict | None = None, timeout: float = 300.0) -> dict:
    child_env = dict(os.environ if env is None else env)
    child_env["DSPARK_HARDEN_ROLE"] = role
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_harden.cli._check_child"],
        env=child_env, capture_output=True, text=True, timeout=timeout,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"role": role, "plugin_loaded": False, "ok": False, "features": [], "sglang_version": "?",
            "errors": [f"check child for role {role} exited {proc.returncode} without a report: {tail}"]}


def merge(reports: list[dict]) -> dict:
    features: dict[str, dict] = {}
    problems: list[str] = []
    version = next((r.get("sglang_version") for r in reports if r.get("sglang_version")), "?")
    loaded = all(r.get("plugin_loaded") for r in reports)
    for rep in reports:
        problems.extend(f"{rep['role']}: {e}" for e in rep.get("errors", []))
        for feat in rep.get("features", []):
            cur = features.setdefault(feat["name"], {
                "name": feat["name"], "area": feat.get("area", ""), "status": feat["status"],
                "switch": feat.get("switch"), "default_on": feat.get("default_on", True),
                "detail": feat.get("detail", ""), "targets": [], "test_only": bool(feat.get("test_only", False)),
            })
            if _RANK.get(feat["status"], 0) > _RANK.get(cur["status"], 0):
                cur["status"], cur["detail"] = feat["status"], feat.get("detail", "")
            cur["targets"].extend(
                {"target": t["target"], "role": t["role"], "bound": t["bound"], "detail": t["detail"]}
                for t in feat.get("targets", [])
            )
    ok = loaded and not problems and all(f["status"] != F.FAILED for f in features.values())
    return {"ok": ok, "sglang_version": version, "plugin_loaded": loaded, "problems": problems,
            "features": list(features.values())}


def check(roles=ROLES, env: dict | None = None) -> dict:
    with ThreadPoolExecutor(max_workers=len(roles)) as pool:
        reports = list(pool.map(lambda r: run_child(r, env), roles))
    return merge(reports)


def operator_view(result: dict, include_test: bool = False) -> dict:
    """``result`` without test-only features (test support installed next to the plugin) unless
    ``include_test``; a failed one is always shown (it is why the check failed)."""
    if include_test:
        return result
    keep = [f for f in result["features"] if not f.get("test_only") or f["status"] == F.FAILED]
    hidden = sorted(f["name"] for f in result["features"] if f not in keep)
    return {**result, "features": keep, "hidden_test_features": hidden}


def render_table(result: dict) -> str:
    rows = [("feature", "status", "switch (default)", "targets")]
    for f in result["features"]:
        switch = f"{f['switch']} ({'on' if f['default_on'] else 'opt-in'})" if f["switch"] else "-"
        targets = sorted({f"{t['target']} [{t['role']}]" + ("" if t["bound"] else " UNBOUND: " + t["detail"]) for t in f["targets"]})
        rows.append((f["name"], f["status"], switch, targets[0] if targets else (f["detail"] or "-")))
        rows.extend(("", "", "", t) for t in targets[1:])
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines.insert(1, "-" * min(120, sum(widths) + 20))
    head = f"dspark-harden check against sglang {result['sglang_version']}: {'OK' if result['ok'] else 'FAILED'}"
    out = [head, *lines]
    for p in result["problems"]:
        out.append(f"PROBLEM: {p}")
    if result.get("hidden_test_features"):
        out.append(f"({len(result['hidden_test_features'])} test-only feature(s) not shown: "
                   f"{', '.join(result['hidden_test_features'])}; --include-test-features shows them)")
    return "\n".join(out)


def main(args) -> int:
    result = check(tuple(args.role) if args.role else ROLES)
    shown = operator_view(result, include_test=getattr(args, "include_test_features", False))
    print(json.dumps(shown) if args.json else render_table(shown))
    return 0 if result["ok"] else 1
