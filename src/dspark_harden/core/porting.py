"""Other SGLang releases: read a stock SGLang tree's source *text* (no import), fingerprint every
patch target there, and say which changed against the release the patches were written for.

Used by ``dspark-harden port-report`` (the list, with a unified diff of each changed target) and by
the binder and ``dspark-harden check`` (the one-line verdict that opens their output when the
installed SGLang is outside :data:`~dspark_harden.core.patch.SUPPORTED_SGLANG`).

A fingerprint here is the very digest :func:`~dspark_harden.core.patch.fingerprint_source` takes of
the live object (sha256 of the dedented ``def``/``class`` text, decorators included), so the
fingerprints recorded on the patches compare directly with a tree that is not importable here (an
unpacked wheel of another release, or the installed one when it is the wrong release).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .patch import SUPPORTED_SGLANG, Role
from .settings import Settings

# status of one target in a tree
SAME = "same"
CHANGED = "changed"
MISSING = "missing"


class PortError(Exception):
    """Bad input to the port report (no SGLang tree at a path, unreadable version)."""


class TargetNotFound(Exception):
    """A target's definition is not in the tree (the message says where it looked)."""


@dataclass
class SglangTree:
    """A stock SGLang package on disk: ``package`` is the directory holding ``sglang/__init__.py``'s
    files (``.../site-packages/sglang`` or ``<unpacked wheel>/sglang``)."""

    package: str
    version: str
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def at(cls, path: str) -> "SglangTree":
        """The tree at ``path``: the ``sglang`` package directory itself, or a directory that holds
        it (a site-packages directory, an unpacked wheel or sdist's ``python/``)."""
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.exists(path):
            raise PortError(f"--sglang {path}: no such file or directory")
        if not os.path.isdir(path):
            raise PortError(
                f"--sglang {path}: not a directory (unpack the wheel first: python -m zipfile -e sglang-X.whl DIR)"
            )
        for cand in (path, os.path.join(path, "sglang"), os.path.join(path, "python", "sglang")):
            if os.path.isfile(os.path.join(cand, "__init__.py")) and os.path.basename(cand) == "sglang":
                return cls(package=cand, version=_tree_version(cand))
        raise PortError(
            f"--sglang {path}: no SGLang package there (looked for sglang/__init__.py in {path}, "
            f"{path}/sglang and {path}/python/sglang)"
        )

    @classmethod
    def installed(cls) -> "SglangTree":
        """The SGLang this interpreter imports (found without importing it)."""
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.origin:
            raise PortError("sglang is not installed in this environment (pass --sglang PATH to an unpacked tree)")
        return cls(package=os.path.dirname(spec.origin), version=_tree_version(os.path.dirname(spec.origin)))

    def relpath(self, path: str) -> str:
        return os.path.relpath(path, os.path.dirname(self.package))

    def module_file(self, module: str) -> str:
        parts = module.split(".")
        if parts[0] != "sglang":
            raise TargetNotFound(f"module {module} is not part of the sglang package")
        base = os.path.join(self.package, *parts[1:])
        for cand in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(cand):
                return cand
        raise TargetNotFound(
            f"module {module} not found ({os.path.relpath(base, os.path.dirname(self.package))}.py does not exist)"
        )

    def _module(self, module: str) -> tuple:
        if module not in self._cache:
            path = self.module_file(module)
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            try:
                tree = ast.parse(text, filename=path)
            except SyntaxError as exc:
                raise TargetNotFound(f"{path} does not parse: {exc}") from None
            self._cache[module] = (path, text.splitlines(keepends=True), tree.body)
        return self._cache[module]

    def target_source(self, target: str, _depth: int = 0) -> tuple:
        """``(dedented source text, file path)`` of ``"pkg.module:Qual.name"`` in this tree. A
        top-level name the module only imports (``from .x import GrammarTree``) is followed to its
        definition, as the live attribute would be."""
        module, _, qual = target.partition(":")
        if not qual:
            raise TargetNotFound(f"target {target!r} must look like 'package.module:Attr.path'")
        path, lines, body = self._module(module)
        parts = qual.split(".")
        node = None
        for i, part in enumerate(parts):
            defs = [
                n
                for n in body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ]
            if not defs:
                if i == 0 and _depth < 8:
                    origin = _imported_from(module, path, body, part)
                    if origin is not None:
                        return self.target_source(f"{origin[0]}:{'.'.join([origin[1], *parts[1:]])}", _depth + 1)
                where = "module" if i == 0 else f"class {'.'.join(parts[:i])}"
                raise TargetNotFound(f"{part!r} is not defined in the {where} body of {path}")
            node = defs[-1]  # the last definition is the one that binds the name
            body = node.body
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        return textwrap.dedent("".join(lines[start : node.end_lineno])), path


def _imported_from(module: str, path: str, body: list, name: str) -> Optional[tuple]:
    """``(defining module, name there)`` for a top-level ``from m import x [as name]``."""
    for node in body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level:
                pkg = module.split(".")
                if not path.endswith("__init__.py"):
                    pkg = pkg[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                src = ".".join(pkg + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            return src, alias.name
    return None


def _tree_version(package: str) -> str:
    parent = os.path.dirname(package)
    for entry in sorted(os.listdir(parent)):
        if re.fullmatch(r"sglang-[^-]+\.dist-info", entry):
            meta = os.path.join(parent, entry, "METADATA")
            if os.path.isfile(meta):
                with open(meta, encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
    vfile = os.path.join(package, "_version.py")
    if os.path.isfile(vfile):
        with open(vfile, encoding="utf-8") as fh:
            m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", fh.read(), re.M)
        if m:
            return m.group(1)
    return "unknown"


def fingerprint_text(src: str) -> str:
    """The digest :func:`~dspark_harden.core.patch.fingerprint_source` takes (of dedented text)."""
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def in_supported_range(version: str) -> bool:
    try:
        return Version(version) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        return False


# -- the targets ------------------------------------------------------------------------------------------


def all_enabled_settings(pm) -> Settings:
    """Default settings with every feature switch on (the ledger shows every patch)."""
    from .manager import all_setting_specs

    specs = all_setting_specs(pm)
    values = {s.name: s.default for s in specs}
    for group in pm.hook.dspark_features():
        for feat in group or []:
            if feat.switch:
                values[feat.switch] = True
    return Settings(values=values, specs={s.name: s for s in specs})


def declared_patches(pm=None) -> list:
    """Every patch any feature declares, for every role, as if all features were enabled (one per key)."""
    if pm is None:
        from .manager import make_manager

        pm = make_manager()
    settings = all_enabled_settings(pm)
    seen: dict = {}
    for role in Role:
        for group in pm.hook.dspark_patches(role=role, settings=settings):
            for p in group or []:
                seen.setdefault(p.key, p)
    return list(seen.values())


@dataclass(frozen=True)
class StockSource:
    """A read-only stock source a feature mirrors (hook ``dspark_stock_sources``): compared by the port
    report like a patch target, never bound."""

    feature: str
    target: str
    fingerprint: str
    why: str = ""


def stock_sources(pm) -> list:
    out = []
    for group in pm.hook.dspark_stock_sources():
        for src in group or []:
            if not isinstance(src, StockSource):
                raise PortError(f"dspark_stock_sources returned {src!r}, not a StockSource")
            out.append(src)
    return out


@dataclass
class TargetDrift:
    target: str
    feature: str
    kind: str
    expected: str  # the fingerprint recorded for the supported release
    status: str  # SAME / CHANGED / MISSING
    found: Optional[str] = None  # the fingerprint in the examined tree (None: missing)
    detail: str = ""  # why missing
    diff: Optional[str] = None  # unified diff baseline -> examined tree (None: no baseline source)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def fingerprinted_targets(pm=None) -> list:
    """``(target, feature, kind, recorded fingerprint)`` of every declared wrap/replace patch and every
    mirrored stock source (kind ``mirrored``), sorted; a target both patched and mirrored is listed once."""
    if pm is None:
        from .manager import make_manager

        pm = make_manager()
    rows = {p.target: (p.target, p.feature, p.kind.value, p.fingerprint) for p in declared_patches(pm) if p.fingerprint}
    for src in stock_sources(pm):
        rows.setdefault(src.target, (src.target, src.feature, "mirrored", src.fingerprint))
    return sorted(rows.values())


def compare(tree: SglangTree, targets: list, baseline: Optional[SglangTree] = None) -> list:
    """Each target's status in ``tree`` against its recorded fingerprint; for a changed or missing one,
    the unified diff from ``baseline``'s text of it (used only where the baseline's text matches the
    recorded fingerprint: it then *is* the supported release's source)."""
    out = []
    for target, feature, kind, expected in targets:
        row = TargetDrift(target=target, feature=feature, kind=kind, expected=expected, status=SAME)
        try:
            src, path = tree.target_source(target)
            row.found = fingerprint_text(src)
        except TargetNotFound as exc:
            src, path, row.status, row.detail = "", None, MISSING, str(exc)
        if row.status is SAME and row.found != expected:
            row.status = CHANGED
        if row.status is not SAME and baseline is not None:
            try:
                base_src, base_path = baseline.target_source(target)
            except TargetNotFound:
                base_src = None
            if base_src is not None and fingerprint_text(base_src) == expected:
                qual = target.partition(":")[2]
                row.diff = "".join(
                    difflib.unified_diff(
                        base_src.splitlines(keepends=True),
                        src.splitlines(keepends=True),
                        fromfile=f"sglang-{baseline.version}/{baseline.relpath(base_path)}:{qual}",
                        tofile=f"sglang-{tree.version}/{tree.relpath(path) if path else '(missing)'}:{qual}",
                    )
                )
                if row.diff and not row.diff.endswith("\n"):
                    row.diff += "\n"
        out.append(row)
    return out


def verdict_line(installed: str, changed: int, total: int) -> str:
    """The one line that opens ``check`` and startup output for an SGLang outside the supported range."""
    return (
        f"sglang {installed} is outside the supported range {SUPPORTED_SGLANG}: {changed} of {total} patch "
        f"targets' stock source changed (`dspark-harden port-report` lists them with diffs)"
    )


def version_verdict(pm=None, tree: Optional[SglangTree] = None) -> Optional[dict]:
    """``None`` when the installed SGLang is in the supported range; else the verdict: installed
    version, supported range, how many of the fingerprinted patch targets changed, and the line."""
    try:
        tree = tree or SglangTree.installed()
    except PortError as exc:
        return {
            "installed": "not installed",
            "supported": SUPPORTED_SGLANG,
            "changed": None,
            "targets": None,
            "changed_targets": [],
            "line": f"sglang is not installed: {exc}",
        }
    if in_supported_range(tree.version):
        return None
    rows = compare(tree, fingerprinted_targets(pm))
    changed = [r.target for r in rows if r.status != SAME]
    return {
        "installed": tree.version,
        "supported": SUPPORTED_SGLANG,
        "changed": len(changed),
        "targets": len(rows),
        "changed_targets": changed,
        "line": verdict_line(tree.version, len(changed), len(rows)),
    }
