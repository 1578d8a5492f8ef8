"""The C source alone: strict C11 compile, and a two-process C harness (>= 100k exchanges, every
value checked) under AddressSanitizer and ThreadSanitizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "native")
SRC = os.path.join(NATIVE, "dp2_exchange.c")
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c_harness.c")
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def test_compiles_alone_with_strict_warnings(tmp_path):
    out = tmp_path / "libdp2.so"
    r = subprocess.run(
        [
            CC,
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O3",
            "-fPIC",
            "-shared",
            "-I",
            NATIVE,
            SRC,
            "-o",
            str(out),
            "-lrt",
            "-lpthread",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert out.exists()


def _sanitizer_available(tmp_path, flag: str) -> bool:
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void){return 0;}\n")
    exe = tmp_path / "probe"
    r = subprocess.run([CC, f"-fsanitize={flag}", str(probe), "-o", str(exe)], capture_output=True)
    return r.returncode == 0 and subprocess.run([str(exe)], capture_output=True).returncode == 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_two_process_harness_under_sanitizer(tmp_path, sanitizer):
    if not _sanitizer_available(tmp_path, sanitizer):
        pytest.skip(f"{sanitizer} sanitizer runtime not available")
    exe = tmp_path / f"harness_{sanitizer}"
    r = subprocess.run(
        [
            CC,
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O1",
            "-g",
            f"-fsanitize={sanitizer}",
            "-fno-omit-frame-pointer",
            "-I",
            NATIVE,
            HARNESS,
            SRC,
            "-o",
            str(exe),
            "-lrt",
            "-lpthread",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1", TSAN_OPTIONS="halt_on_error=1")
    run = subprocess.run(
        [str(exe), f"san-{uuid.uuid4().hex}", "100000"], capture_output=True, text=True, env=env, timeout=880
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok 100000 exchanges" in run.stdout
    assert "ERROR: AddressSanitizer" not in run.stderr and "WARNING: ThreadSanitizer" not in run.stderr
    name = run.stdout.splitlines()[0].strip()
    assert name.startswith("/dspark_dp2_") and not os.path.exists("/dev/shm" + name)
