"""The wheel: ``python -m build`` makes an sdist and, from it, a ``cp310-abi3`` wheel carrying every
compiled native module; installed into a scratch ``--target`` (first on ``sys.path``, in front of the
editable checkout) beside the venv's sglang==0.5.23, SGLang's own plugin loader finds its entry point
and ``dspark-harden check`` passes. ``.ci/run`` runs this as part of ``make test``.

Offline: ``--no-isolation`` builds with the venv's setuptools/wheel/cffi (scripts/install.sh
installs them), pip installs the local file with ``--no-index``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _native_modules() -> list:
    """Every cffi module native/build.py defines (``ffi.set_source("dspark_harden._x", ...)``): what
    the wheel must carry, independent of which of them setup.py remembers to build."""
    tree = ast.parse(open(os.path.join(ROOT, "native", "build.py")).read())
    mods = sorted(
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "_builder"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    )
    assert mods, "no _builder(...) call found in native/build.py"
    return mods


def _checkout_copy(dest: str) -> str:
    """The checkout's files as a clean clone has them (tracked and untracked-but-not-ignored, from git),
    copied to ``dest``: the build runs there, so it neither reads a build/ or egg-info of the working
    tree nor writes its release tree, egg-info and build/ into it while the other pytest-xdist worker's
    tests read the editable install from it (a CI run failed in build_sdist on its own release tree's
    README.md vanishing under it)."""
    ls = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ls.returncode == 0, f"the wheel test builds from the checkout's git file list: {ls.stderr}"
    for rel in filter(None, ls.stdout.split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):  # a tracked file deleted in the working tree is not built
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    src = _checkout_copy(str(tmp_path_factory.mktemp("checkout")))
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), src],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    wheels = sorted(p for p in os.listdir(out) if p.endswith(".whl"))
    sdists = sorted(p for p in os.listdir(out) if p.endswith(".tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, os.listdir(out)
    # without --sdist/--wheel, build makes the sdist first and the wheel *from the sdist*: the sdist builds them
    assert f"Successfully built {sdists[0]} and {wheels[0]}" in proc.stdout
    return os.path.join(out, wheels[0]), os.path.join(out, sdists[0])


def test_wheel_is_abi3_and_carries_every_native_module_and_the_entry_points(built):
    wheel, _ = built
    name = os.path.basename(wheel)
    assert name.startswith("dspark_harden-") and "-cp310-abi3-linux_" in name, name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = zf.read(info).decode()
        wheel_meta = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    for mod in _native_modules():
        so = mod.replace(".", "/") + ".abi3.so"
        assert so in names, f"{so} missing from {name}"
    assert "Root-Is-Purelib: false" in wheel_meta and "Tag: cp310-abi3-linux_" in wheel_meta
    assert "[sglang.srt.plugins]\ndspark_harden = dspark_harden.entry:load" in entry_points
    assert "[console_scripts]\ndspark-harden = dspark_harden.cli:main" in entry_points
    assert not any(n.startswith(("tests/", "native/")) for n in names)
    # the device-side planner guard's CUDA source, compiled by SGLang's JIT at run time
    assert "dspark_harden/dsv4_memory/csrc/guarded_c_plan.cuh" in names


def test_sdist_carries_the_native_sources_and_no_compiled_module(built):
    _, sdist = built
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for f in (
        "setup.py",
        "pyproject.toml",
        "native/build.py",
        "native/dp2_exchange.c",
        "native/dp2_exchange.h",
        "native/draft_traverse.c",
        "native/draft_traverse.h",
        "native/native_common.h",
        "native/tvm_ffi_abi.h",
    ):
        assert f in names, f"{f} missing from the sdist"
    assert not [n for n in names if n.endswith((".so", ".o"))]


_PROBE = r"""
import importlib.metadata as md, inspect, json, os, sys
target = os.environ["TARGET"]
import dspark_harden, dspark_harden.entry
mods = {}
for name in sys.argv[1:]:
    m = __import__(name, fromlist=["lib"])
    mods[name] = m.__file__
dist = md.distribution("dspark-harden")
from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)  # SGLang's own discovery: loads, does not call
func, dist_name = found["dspark_harden"]
print(json.dumps({"package": dspark_harden.__file__, "native": mods, "dist": str(dist.locate_file("")),
                  "loader_func": inspect.getfile(func), "loader_is_entry": func is dspark_harden.entry.load,
                  "dist_name": dist_name, "sglang": md.version("sglang")}))
"""


def test_wheel_installed_in_a_scratch_target_is_found_by_sglangs_loader_and_check_passes(built, tmp_path):
    wheel, _ = built
    target = tmp_path / "target"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), wheel],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    env = dict(os.environ, PYTHONPATH=str(target), TARGET=str(target), SGLANG_PLUGINS="dspark_harden")
    env.pop("DSPARK_HARDEN_ROLE", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *_native_modules()],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    inside = lambda p: os.path.realpath(p).startswith(os.path.realpath(target) + os.sep)  # noqa: E731
    assert inside(got["package"]), got  # the wheel's copy, not the editable checkout
    assert all(inside(p) and p.endswith(".abi3.so") for p in got["native"].values()), got
    assert os.path.realpath(got["dist"]) == os.path.realpath(target), got
    assert got["loader_is_entry"] and inside(got["loader_func"]) and got["dist_name"] == "dspark-harden", got
    assert got["sglang"] == "0.5.23"

    script = target / "bin" / "dspark-harden"  # the wheel's console script
    proc = subprocess.run(
        [str(script), "check", "--json"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] and result["plugin_loaded"], (proc.stdout[-4000:], proc.stderr[-2000:])
    assert result["sglang_version"] == "0.5.23" and result["verdict"] is None and not result["problems"]
    assert {f["status"] for f in result["features"]} <= {"bound", "upstream", "disabled", "unavailable"}
    assert [f["name"] for f in result["features"] if f["status"] == "bound"], "check bound nothing"
