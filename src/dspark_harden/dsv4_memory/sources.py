"""Fingerprints of stock functions read from the installed source *text* (no import): the sparse
prefill's FlashMLA wrapper module loads the CUDA extension at import, so on a CPU-only host
``dspark-harden check`` and the tests verify its fingerprint this way (the same digest as
:func:`dspark_harden.core.patch.fingerprint_source`)."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import textwrap


def module_path(module: str) -> str:
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {module.split('.')[0]!r} is not installed")
    root = os.path.dirname(spec.origin)
    return os.path.join(root, *module.split(".")[1:]) + ".py"


def source_fingerprint(target: str) -> str:
    """sha256[:16] of the dedented source of a module-level function or ``Class.method`` target."""
    module, _, qual = target.partition(":")
    path = module_path(module)
    with open(path, encoding="utf-8") as fh:
        src = fh.read()
    lines = src.splitlines(keepends=True)
    body = ast.parse(src).body
    node = None
    for part in qual.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(f"{target}: {part!r} not found in {path}")
        body = node.body
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    return hashlib.sha256(textwrap.dedent("".join(lines[start:node.end_lineno])).encode()).hexdigest()[:16]
