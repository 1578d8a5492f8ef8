"""A real Prometheus server (Debian package ``prometheus``) started by a test on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import pytest

from dspark_harden.devtools.server import free_port
from dspark_harden.observability.lint import prometheus_query

INSTALL = "apt-get update && apt-get install -y prometheus"


def ensure_prometheus() -> tuple[str, str]:
    """Paths of ``prometheus`` and ``promtool``; installs the Debian package when missing (as root)."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus",
            shell=True,
            timeout=1200,
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        prom, tool = shutil.which("prometheus"), shutil.which("promtool")
        if prom and tool:
            return prom, tool
    pytest.fail(
        f"prometheus/promtool are not installed and could not be installed here: run `{INSTALL}` (or `make install`)"
    )


class Prometheus:
    def __init__(self, targets: list, *, scrape_interval: str = "1s") -> None:
        self.binary, self.promtool = ensure_prometheus()
        self.workdir = Path(tempfile.mkdtemp(prefix="dsh-prometheus-", dir="/tmp"))
        self.port = free_port(span=1)
        self.config = self.workdir / "prometheus.yml"
        target_list = ", ".join(f'"{t}"' for t in targets)
        self.config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  scrape_timeout: {scrape_interval}\n"
            "scrape_configs:\n"
            "  - job_name: sglang\n"
            "    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: [{target_list}]\n"
        )
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "Prometheus":
        check = subprocess.run([self.promtool, "check", "config", str(self.config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self._log = open(self.workdir / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=2h",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return (self.workdir / "prometheus.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def query(self, expr: str) -> list:
        return prometheus_query(self.url, expr)

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float = 180.0, every: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.workdir, ignore_errors=True)
