"""``dspark-harden env`` and ``dspark-harden patches``: what the plugin reads and what it binds."""

from __future__ import annotations

import json
import os

from ..core.manager import all_setting_specs, make_manager
from ..core.patch import Role
from ..core.settings import Settings


def env_rows() -> list[dict]:
    pm = make_manager()
    rows = []
    for spec in all_setting_specs(pm):
        rows.append({
            "name": spec.name,
            "feature": spec.feature or "core",
            "default": _show(spec.default),
            "current": os.environ.get(spec.name),
            "accepts": spec.describe_accepts(),
            "doc": spec.doc,
        })
    return rows


def _show(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return "(unset)"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "(empty)"
    return str(value)


def env_main(args) -> int:
    rows = env_rows()
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        cur = "(unset)" if r["current"] is None else repr(r["current"])
        print(f"{r['name']}  [{r['feature']}]  default={r['default']}  current={cur}")
        print(f"    accepts: {r['accepts']}")
        print(f"    {r['doc']}")
    return 0


def patch_rows() -> list[dict]:
    """Every patch any feature declares, for every role, as if all features were enabled."""
    pm = make_manager()
    specs = all_setting_specs(pm)
    values = {s.name: s.default for s in specs}
    # ledger shows all patches: pretend every feature switch is on
    for group in pm.hook.dspark_features():
        for feat in group or []:
            if feat.switch:
                values[feat.switch] = True
    settings = Settings(values=values, specs={s.name: s for s in specs})
    rows: dict[str, dict] = {}
    for role in Role:
        for group in pm.hook.dspark_patches(role=role, settings=settings):
            for p in group or []:
                row = rows.setdefault(p.key, {
                    "target": p.key, "feature": p.feature, "kind": p.kind.value,
                    "roles": sorted(r.value for r in p.roles), "fingerprint": p.fingerprint,
                    "versions": p.versions, "why": p.why, "retire_when": p.retire_when,
                })
    return sorted(rows.values(), key=lambda r: (r["feature"], r["target"]))


def patches_main(args) -> int:
    rows = patch_rows()
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        print(f"{r['target']}  [{r['feature']}; {r['kind']}; roles {','.join(r['roles'])}; sglang {r['versions']}; fp {r['fingerprint']}]")
        print(f"    why: {r['why']}")
        print(f"    retire when: {r['retire_when']}")
    return 0
