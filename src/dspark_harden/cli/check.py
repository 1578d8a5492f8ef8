"""``dspark-harden check``: load the plugin the way SGLang does, in a fresh child per role."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..core import feature as F

ROLES = ("main", "controller", "scheduler", "detokenizer")
_MARK = "@@DSPARK_CHECK@@"
# worst wins when merging one feature's status across roles
_RANK = {F.FAILED: 4, F.BOUND: 3, F.UPSTREAM: 2, F.UNAVAILABLE: 1, F.DISABLED: 0}


def failed_report(role: str, error: str) -> dict:
    """A role's report when it produced none of its own (what ``merge`` and the profiles read)."""
    return {"role": role, "plugin_loaded": False, "ok": False, "features": [], "sglang_version": "?", "errors": [error]}


LAUNCH_ENV = "DSPARK_HARDEN_CHECK_LAUNCH_ARGS"


def run_children(roles, env: dict | None = None, timeout: float = 300.0, launch=None) -> list[dict]:
    """One report per role, in ``roles``' order: a single child process imports SGLang once and forks
    one grandchild per role, which runs SGLang's own ``load_plugins()`` (``_check_child``)."""
    roles = list(roles)
    child_env = dict(os.environ if env is None else env)
    child_env.pop("DSPARK_HARDEN_ROLE", None)
    child_env.pop(LAUNCH_ENV, None)
    if launch is not None:
        child_env[LAUNCH_ENV] = json.dumps(list(launch))
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_harden.cli._check_child", "--roles", ",".join(roles)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            rep = json.loads(line[len(_MARK) :])
            found.setdefault(rep.get("role"), rep)
    tail = (proc.stderr or proc.stdout)[-2000:]
    return [
        found.get(role)
        or failed_report(role, f"check child for role {role} exited {proc.returncode} without a report: {tail}")
        for role in roles
    ]


def run_child(role: str, env: dict | None = None, timeout: float = 300.0) -> dict:
    return run_children([role], env, timeout)[0]


def merge(reports: list[dict]) -> dict:
    features: dict[str, dict] = {}
    problems: list[str] = []
    version = next((r.get("sglang_version") for r in reports if r.get("sglang_version")), "?")
    loaded = all(r.get("plugin_loaded") for r in reports)
    for rep in reports:
        problems.extend(f"{rep['role']}: {e}" for e in rep.get("errors", []))
        for feat in rep.get("features", []):
            cur = features.setdefault(
                feat["name"],
                {
                    "name": feat["name"],
                    "area": feat.get("area", ""),
                    "status": feat["status"],
                    "switch": feat.get("switch"),
                    "default_on": feat.get("default_on", True),
                    "detail": feat.get("detail", ""),
                    "targets": [],
                    "test_only": bool(feat.get("test_only", False)),
                },
            )
            if _RANK.get(feat["status"], 0) > _RANK.get(cur["status"], 0):
                cur["status"], cur["detail"] = feat["status"], feat.get("detail", "")
            cur["targets"].extend(
                {"target": t["target"], "role": t["role"], "bound": t["bound"], "detail": t["detail"]}
                for t in feat.get("targets", [])
            )
    ok = loaded and not problems and all(f["status"] != F.FAILED for f in features.values())
    verdict = next((r["verdict"] for r in reports if r.get("verdict")), None)
    launch = next((r["launch"] for r in reports if r.get("launch")), None)
    return {
        **({"launch": launch} if launch else {}),
        "ok": ok,
        "sglang_version": version,
        "plugin_loaded": loaded,
        "problems": problems,
        "verdict": verdict,
        "features": list(features.values()),
    }


def check(roles=ROLES, env: dict | None = None, profile=None, skip_cuda: bool = False, launch=None) -> dict:
    """Every role's report merged; with ``profile`` (a :class:`~.profiles.Profile`), also whether its
    features reached their statuses in its role (``result["profile"]``; ``ok`` needs both); with
    ``launch`` (sglang launch arguments), every feature judged against those server arguments."""
    reports = run_children(roles, env, launch=launch)
    result = merge(reports)
    if profile is not None:
        from .profiles import evaluate

        judged = evaluate(
            profile,
            next((r for r in reports if r.get("role") == profile.role), None),
            skip_cuda,
            environ=os.environ if env is None else env,
        )
        result["profile"] = judged
        result["ok"] = result["ok"] and judged["ok"]
    if result["verdict"] is None:  # a child that failed before binding has none: read the tree here
        from ..core import porting

        try:
            verdict = porting.version_verdict()
        except Exception as exc:  # noqa: BLE001 - the summary line must not hide the per-role problems
            result["problems"].append(f"counting changed patch targets failed: {type(exc).__name__}: {exc}")
            verdict = None
        result["verdict"] = verdict["line"] if verdict else None
    return result


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
        targets = sorted(
            {f"{t['target']} [{t['role']}]" + ("" if t["bound"] else " UNBOUND: " + t["detail"]) for t in f["targets"]}
        )
        rows.append((f["name"], f["status"], switch, targets[0] if targets else (f["detail"] or "-")))
        rows.extend(("", "", "", t) for t in targets[1:])
        if targets and f["detail"] and f["status"] == F.BOUND:  # what a bound feature says of itself (e.g. the GPU)
            rows.append(("", "", "", f["detail"]))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines.insert(1, "-" * min(120, sum(widths) + 20))
    head = f"dspark-harden check against sglang {result['sglang_version']}: {'OK' if result['ok'] else 'FAILED'}"
    out = ([result["verdict"]] if result.get("verdict") else []) + [head]
    launch = result.get("launch")
    if launch:
        out.append(f"judged against: {' '.join(launch['argv'])} ({launch['resolution']})")
        out.append(f"plugin loaded because {launch['loaded_because']}")
    out += lines
    for p in result["problems"]:
        out.append(f"PROBLEM: {p}")
    prof = result.get("profile")
    if prof:
        state = "OK" if prof["ok"] else "FAILED"
        if prof["ok"] and prof["skipped"]:
            state = "PARTIAL (--skip-cuda-features)"
        out.append(
            f"profile {prof['name']} ({prof['role']} role): {state}: {len(prof['met'])} feature(s) as needed"
            + (f", {len(prof['problems'])} not" if prof["problems"] else "")
            + (f", {len(prof['optional'])} optional not chosen" if prof.get("optional") else "")
            + (f", not checked (CUDA only): {', '.join(prof['skipped'])}" if prof["skipped"] else "")
        )
        out.extend(f"PROFILE: {p}" for p in prof["problems"])
        out.extend(f"OPTIONAL: {o}" for o in prof.get("optional", ()))
        out.extend(f"NOTE: {n}" for n in prof.get("notes", ()))
    if result.get("hidden_test_features"):
        out.append(
            f"({len(result['hidden_test_features'])} test-only feature(s) not shown: "
            f"{', '.join(result['hidden_test_features'])}; --include-test-features shows them)"
        )
    return "\n".join(out)


def main(args) -> int:
    roles = tuple(args.role) if args.role else ROLES
    profile = None
    if getattr(args, "profile", None):
        from .profiles import PROFILES

        profile = PROFILES[args.profile]
        if profile.role not in roles:
            print(
                f"dspark-harden check: --profile {profile.name} is judged in the {profile.role} role, which "
                f"--role leaves out (add --role {profile.role})",
                file=sys.stderr,
            )
            return 2
    elif getattr(args, "skip_cuda_features", False):
        print("dspark-harden check: --skip-cuda-features applies only with --profile", file=sys.stderr)
        return 2
    launch = list(getattr(args, "launch", None) or [])
    if launch[:1] == ["--"]:
        launch = launch[1:]
    result = check(roles, profile=profile, skip_cuda=getattr(args, "skip_cuda_features", False), launch=launch or None)
    shown = operator_view(result, include_test=getattr(args, "include_test_features", False))
    print(json.dumps(shown) if args.json else render_table(shown))
    return 0 if result["ok"] else 1
