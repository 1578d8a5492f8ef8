"""The ``dspark-harden`` CLI with a third-party feature (entry-point group ``dspark_harden.features``) that
does not import: one clear line naming it and exit 2 (no traceback), and DSPARK_HARDEN_STRICT_EXTENSIONS=0
honoured as documented (skipped with an ERROR log). The extension is a real distribution on disk (a
dist-info with an entry point to a module that does not exist), first on PYTHONPATH of a CLI subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(tmp_path, *args, **env_extra):
    dist = tmp_path / "brokenext-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenext\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dspark_harden.features]\nbrokenext = no_such_module_for_dspark_test\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_HARDEN_")}
    env.update(PYTHONPATH=str(tmp_path), **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "dspark_harden", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_broken_extension_is_one_clear_line_and_exit_2(tmp_path):
    proc = _run(tmp_path, "env", "--json")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "dspark-harden: third-party dspark-harden feature 'brokenext' (no_such_module_for_dspark_test) failed to "
        "load: ModuleNotFoundError: No module named 'no_such_module_for_dspark_test' "
        "(DSPARK_HARDEN_STRICT_EXTENSIONS=0 skips it, with an ERROR log)"
    )


def test_strict_extensions_0_skips_it_in_the_cli(tmp_path):
    proc = _run(tmp_path, "env", "--json", DSPARK_HARDEN_STRICT_EXTENSIONS="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'brokenext'" in proc.stderr and "skipped: DSPARK_HARDEN_STRICT_EXTENSIONS=0" in proc.stderr
    assert proc.stdout.startswith("[")
