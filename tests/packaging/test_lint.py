"""The linters, as part of `make test` and `.ci/run` (docs/testing.md, "Linters").

* ruff (pinned by scripts/install.sh): ``ruff check`` (pyflakes, pycodestyle, bugbear, import order;
  pyproject.toml ``[tool.ruff]``) and ``ruff format --check`` over src/, tests/, scripts/, native/build.py
  and setup.py;
* C: ``clang-format --dry-run --Werror`` (the repository's .clang-format) over native/, and gcc with the
  warnings the build does not ask for (shadowing, prototypes, format strings, NULL dereference) plus its
  static analyzer (``-fanalyzer``), every warning an error.

Each check names the tool's own output when it fails. Mutations checked: an unused import, a misformatted
Python line, a misformatted C line, a shadowed C local, and an unchecked malloc() dereference (which only
the analyzer reports) each turned the matching test red."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
C_SOURCES = sorted(glob.glob(os.path.join(ROOT, "native", "*.c")))
C_FILES = C_SOURCES + sorted(glob.glob(os.path.join(ROOT, "native", "*.h")))
# beyond the build's -Wall -Wextra -Werror (native/build.py); -Wpedantic is left out on purpose: POSIX
# dlsym() returns object pointers that draft_traverse.c converts to function pointers
GCC_LINT = ["-std=c11", "-c", "-o", os.devnull, "-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes",
            "-Wmissing-prototypes", "-Wformat=2", "-Wundef", "-Wnull-dereference", "-Werror"]  # fmt: skip


def _tool(name: str) -> str:
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.fail(f"{name} is not installed in {BIN}: run scripts/install.sh (it pins the linters)")
    return path


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)


def test_ruff_check_clean():
    r = _run([_tool("ruff"), "check", "--no-cache"])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_ruff_format_clean():
    r = _run([_tool("ruff"), "format", "--check", "--no-cache"])
    assert r.returncode == 0, "ruff format would change:\n" + r.stdout[-6000:] + r.stderr[-2000:]


def test_clang_format_clean():
    assert C_FILES, "no C sources found under native/"
    r = _run([_tool("clang-format"), "--dry-run", "--Werror", *C_FILES])
    assert r.returncode == 0, r.stderr[-6000:]


@pytest.mark.parametrize("source", [os.path.basename(p) for p in C_SOURCES])
def test_gcc_warnings_and_analyzer_clean(source):
    gcc = shutil.which("gcc")
    assert gcc, "gcc is required (it builds the native modules)"
    path = os.path.join(ROOT, "native", source)
    # the analyzer runs on generated code (not under -fsyntax-only) and at -O0 (optimisation can remove the
    # very path it reports: a double free in a three-line function passes at -O1)
    for extra in ([], ["-O0", "-fanalyzer"]):
        r = _run([gcc, *GCC_LINT, *extra, "-I", os.path.join(ROOT, "native"), path])
        assert r.returncode == 0, f"gcc {' '.join(extra) or 'warnings'}:\n" + r.stderr[-6000:]
