"""The real-world schema corpus of the grammar tests: the JSON Schema Test Suite, installed by
scripts/install.sh from the npm registry package ``json-schema-test-suite`` into
``$DSPARK_HARDEN_NPM_PREFIX`` (default ``~/.cache/dspark-harden/npm``).

A missing corpus is a test FAILURE naming the set-up step, never a skip: a green run must mean the
corpus was exercised.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

NPM_PACKAGE = "json-schema-test-suite"
DRAFTS = ("draft4", "draft3")


def npm_prefix() -> str:
    return os.path.abspath(
        os.path.expanduser(
            os.environ.get("DSPARK_HARDEN_NPM_PREFIX", os.path.join("~", ".cache", "dspark-harden", "npm"))
        )
    )


def suite_dir() -> str:
    path = os.path.join(npm_prefix(), "node_modules", NPM_PACKAGE, "tests")
    if not all(os.path.isdir(os.path.join(path, d)) for d in DRAFTS):
        pytest.fail(
            f"the JSON Schema Test Suite corpus is missing at {path} (npm package {NPM_PACKAGE}): run "
            f"scripts/install.sh (it runs `npm install --prefix {npm_prefix()} {NPM_PACKAGE}`)",
            pytrace=False,
        )
    return path


def load(drafts=DRAFTS) -> list[tuple[str, dict]]:
    """[(name, schema)] — every distinct schema of the suite's test groups, in a stable order."""
    root = suite_dir()
    out: dict[str, tuple[str, dict]] = {}
    for draft in drafts:
        for path in sorted(glob.glob(os.path.join(root, draft, "**", "*.json"), recursive=True)):
            with open(path, encoding="utf-8") as fh:
                groups = json.load(fh)
            rel = os.path.relpath(path, root)[: -len(".json")]
            for i, group in enumerate(groups):
                schema = group["schema"]
                if not isinstance(schema, dict):
                    continue
                text = json.dumps(schema, sort_keys=True)
                out.setdefault(text, (f"{rel}#{i}", schema))
    return list(out.values())
