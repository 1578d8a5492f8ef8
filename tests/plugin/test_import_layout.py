"""The package's import graph (every ``import`` statement, including the ones inside functions:
a lazy import still makes two modules depend on each other) has no cycles, and a feature package
never imports another feature package (features import the core; STYLE.md "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "dspark_harden"
ROOT_NAME = "dspark_harden"
#: top-level modules / packages that are not features (the platform everything may import)
CORE = {
    "core",
    "cli",
    "devtools",
    "entry",
    "upstream",
    "metrics",
    "__init__",
    "__main__",
    "_dp2_native",
    "_traverse_native",
}


def _modules(root: Path = PKG) -> dict:
    """dotted module name -> path, for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, level: int, target: str) -> str:
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def import_graph(root: Path = PKG) -> dict:
    """{module: {modules of this package it imports}} from the source's import statements."""
    mods = _modules(root)
    graph: dict = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module or "") if node.level else (node.module or "")
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod and t.startswith(ROOT_NAME):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_detector_finds_a_lazy_cycle_and_accepts_a_tree(tmp_path):
    pkg = tmp_path / ROOT_NAME
    (pkg / "feat").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "feat" / "__init__.py").write_text("")
    (pkg / "feat" / "feature.py").write_text("def cli():\n    from . import cli\n")
    (pkg / "feat" / "cli.py").write_text("def run():\n    from .feature import X\n")
    (pkg / "feat" / "settings.py").write_text("X = 1\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [[f"{ROOT_NAME}.feat.cli", f"{ROOT_NAME}.feat.feature"]]
    (pkg / "feat" / "cli.py").write_text("from .settings import X\nfrom .. import feat\n")
    assert cycles(import_graph(pkg)) == []


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (move what both sides need into a module both import):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_features_never_import_each_other():
    wrong = []
    for mod, deps in import_graph().items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] in CORE:
            continue
        for dep in deps:
            other = dep.split(".")[1] if dep.count(".") else ""
            if other and other not in CORE and other != parts[1]:
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "feature packages import other feature packages:\n" + "\n".join(sorted(wrong))


def _imported_names(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_product_code_and_the_demo_import_nothing_from_tests():
    """The demo (scripts/) and the package are product code: what they share with the tests (the
    server launcher, the lock) lives in dspark_harden.devtools."""
    scripts = sorted((PKG.parents[1] / "scripts").glob("*.py"))
    assert scripts, "scripts/demo.py is expected"
    wrong = [
        f"{p.relative_to(PKG.parents[1])}: {n}"
        for p in [*scripts, *sorted(PKG.rglob("*.py"))]
        for n in sorted(_imported_names(p))
        if n == "tests" or n.startswith(("tests.", "dspark_testsupport"))
    ]
    for p in scripts:
        assert "sys.path" not in p.read_text(), f"{p.name} must not put the repository (tests/) on sys.path"
    assert not wrong, "product code imports test modules:\n" + "\n".join(wrong)


def test_harness_aliases_are_the_package_modules():
    from dspark_harden.devtools import lock, server
    from tests.harness import lock as tlock
    from tests.harness import server as tserver

    assert tserver is server and tlock is lock
