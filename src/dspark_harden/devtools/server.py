"""Start, probe and stop a real, unmodified ``python -m sglang.launch_server`` on this CPU machine.

Facts this is built on are in shared/design/cpu-e2e.md. Every server:

- runs the tiny local model (:mod:`dspark_harden.devtools.tiny_models`) on the CPU platform of
  the separate test-support distribution (``DSPARK_TEST_CPU_PLATFORM=1``,
  ``SGLANG_PLATFORM=dspark_test_cpu``; ``pip install -e tests/support``, which ``make install``
  does). Nothing here imports it: SGLang discovers it through its own ``sglang.srt.platforms``
  entry-point group, and :func:`cpu_platform_problem` says how to install it when it is missing.
  The plugin under test is selected with ``SGLANG_PLUGINS=dspark_harden`` unless the config says
  otherwise;
- is started in its own session (``start_new_session``) with its own ``TMPDIR`` (SGLang leaves ZMQ
  IPC sockets and temp files there), a free port, and its output in ``<workdir>/server.log``;
- holds the machine-wide server lock (:mod:`dspark_harden.devtools.lock`) from start to stop;
- is ready when ``/model_info`` and then ``/health_generate`` answer 200 (deadline
  ``DSPARK_SERVER_READY_TIMEOUT``, default 600 s); if the process exits or the deadline passes,
  :class:`ServerError` is raised with the tail of the log;
- is stopped by SIGTERM to the main PID (SGLang tears its children down cleanly from there;
  SIGTERM to the whole group would send it down its crash path), then SIGKILL of the process group
  as a fallback.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from ..core import procfs
from . import lock as _lock

PLATFORM_ENV = {"DSPARK_TEST_CPU_PLATFORM": "1", "SGLANG_PLATFORM": "dspark_test_cpu"}
PLATFORM_ENTRY_POINT = ("sglang.srt.platforms", "dspark_test_cpu")

BASE_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "8192",
    "--grammar-backend",
    "xgrammar",
    "--constrained-json-disable-any-whitespace",
    "--enable-metrics",
    "--sleep-on-idle",
)

# Inherited variables that would change how a test server behaves (or that SGLang must own).
_SCRUB_ENV = (
    "DSPARK_HARDEN_ROLE",
    "PROMETHEUS_MULTIPROC_DIR",
    "SGLANG_USE_CPU_ENGINE",
    "CUDA_VISIBLE_DEVICES",
    "PYTEST_CURRENT_TEST",
)

#: SGLANG_PLUGINS for a stock server: an allow-list that names no installed plugin
STOCK_PLUGINS = "dspark_harden_disabled_for_stock_comparison"

PLUGIN_ACTIVE_RE = re.compile(r"dspark-harden \S+ active in (\w+) process \(pid (\d+)\)")

LOG_TAIL_CHARS = 20000


class ServerError(RuntimeError):
    """A server failed to start / stop as expected; the message ends with the server log tail."""


class PortRaceError(ServerError):
    """SGLang could not bind a port it was given or derived: it was taken after it was chosen."""


def cpu_platform_problem() -> Optional[str]:
    """None when SGLang can find the CPU platform the servers run on, else what to do."""
    import importlib.metadata

    group, name = PLATFORM_ENTRY_POINT
    if any(ep.name == name for ep in importlib.metadata.entry_points(group=group)):
        return None
    return (
        f"the CPU platform for SGLang ({group} entry point {name!r}) is not installed: these servers "
        f"run on CPU through the test-support distribution; install it with `pip install -e tests/support` "
        f"(`make install` does)"
    )


def ready_timeout() -> float:
    return _lock.env_seconds("DSPARK_SERVER_READY_TIMEOUT", "600")


#: sglang.srt.server_args.ZMQ_TCP_PORT_DELTA in 0.5.23: without --dist-init-addr, SGLang puts its
#: dist-init port at --port + 233 and the ZMQ TCP ports it derives (tokenizer, detokenizer, rpc,
#: metrics, scheduler input, load collector) right above it (tests/integration checks the value).
SGLANG_PORT_DELTA = 233
SGLANG_DERIVED_PORTS = 10


def port_bindable(port: int) -> bool:
    """SGLang's own test (``is_port_available``): a wildcard bind with SO_REUSEADDR succeeds on every
    configured address family. A plain bind to 127.0.0.1 is not enough: a socket the kernel still
    holds after its process died (FIN_WAIT2, LAST_ACK: no owning pid) blocks SGLang's check, and
    SGLang waits 30 s for it and exits ("metrics_port at N is not available in 30 seconds")."""
    try:
        infos = socket.getaddrinfo(
            None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_ADDRCONFIG | socket.AI_PASSIVE
        )
    except socket.gaierror:
        infos = [(socket.AF_INET, socket.SOCK_STREAM, 0, "", ("0.0.0.0", port))]
    seen = set()
    for family, socktype, proto, _, addr in infos:
        if family in seen:
            continue
        seen.add(family)
        with socket.socket(family, socktype, proto) as s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError:
                return False
    return True


#: log lines of SGLang 0.5.23 when a port was taken between choice and bind: uvicorn's (the main
#: process then hangs), SGLang's own 30 s port wait, a ZMQ bind
PORT_RACE_MARKERS = (
    "error while attempting to bind on address",
    "is not available in 30 seconds",
    "Address already in use",
)

#: the lowest port :func:`free_port` hands out (below it lie well-known services)
LOWEST_PORT = 10000
_handed_out: list[range] = []


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``net.ipv4.ip_local_port_range``; Linux's default if
    unreadable). Ports bound to 0 and outgoing connections get ports from it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _port_footprint(port: int, span: int) -> list[range]:
    return [range(port, port + span), range(port + SGLANG_PORT_DELTA, port + SGLANG_PORT_DELTA + SGLANG_DERIVED_PORTS)]


def _candidate_ports(lowest: int, top: int) -> Iterator[int]:
    rng = random.SystemRandom()
    while True:
        yield rng.randrange(lowest, top)


def free_port(span: int = 16) -> int:
    """A port P such that P .. P+span-1 and the ports SGLang derives from it (P+233 ...) pass
    SGLang's own availability test now, all of them below the kernel's ephemeral range.

    Below it, because a port is only checked now and bound by SGLang many seconds later: a CI run
    once failed when uvicorn could not bind its HTTP port 17 s after the check (``[Errno 98] error
    while attempting to bind``, after which SGLang hangs instead of exiting): a port drawn from the
    ephemeral range (a bind to port 0) can meanwhile be handed by the kernel to any process's
    outgoing connection or port-0 bind (ZMQ, gloo). The kernel never auto-assigns a port outside
    that range, so only another explicit chooser can still take one; ranges this process has
    handed out are never handed out again (two servers launched before either binds)."""
    low, high = ephemeral_range()
    footprint = SGLANG_PORT_DELTA + SGLANG_DERIVED_PORTS
    top = low - footprint
    if top - LOWEST_PORT < 1000:  # an unusual ephemeral range: use the ports above it
        lowest, top = high + 1, 65535 - footprint
    else:
        lowest = LOWEST_PORT
    candidates = _candidate_ports(lowest, top)
    for _ in range(500):
        port = next(candidates)
        ranges = _port_footprint(port, span)
        if any(r.start < h.stop and h.start < r.stop for r in ranges for h in _handed_out):
            continue
        if all(port_bindable(p) for r in ranges for p in r):
            _handed_out.extend(ranges)
            return port
    raise ServerError(f"no free port range found in [{lowest}, {top}) (ephemeral range {low}-{high})")


@dataclass(frozen=True)
class ServerConfig:
    """What to launch. ``arch`` is a tiny model (deepseek_v3 / qwen3 / llama) or ``model_path`` is given."""

    arch: str = "deepseek_v3"
    model_path: Optional[str] = None
    dp_size: int = 1
    tp_size: int = 1
    dp_attention: bool = False
    extra_args: tuple = ()
    #: extra environment for the server tree (wins over the defaults below)
    env: tuple = ()
    #: SGLANG_PLUGINS value; None: stock SGLang, no general plugin at all (see STOCK_PLUGINS)
    plugins: Optional[str] = "dspark_harden"
    name: str = "sglang"
    #: the stock entry point: "launch_server" (``python -m sglang.launch_server``) or "serve" (the
    #: ``sglang serve`` console script of this interpreter's environment)
    launcher: str = "launch_server"

    @property
    def ranks(self) -> int:
        """Scheduler processes: tp_size under DP attention (DP ranks live inside TP), else dp*tp."""
        return self.tp_size if self.dp_attention else self.dp_size * self.tp_size

    def with_env(self, **env: str) -> "ServerConfig":
        merged = dict(self.env)
        merged.update(env)
        return ServerConfig(**{**self.__dict__, "env": tuple(sorted(merged.items()))})


#: The configuration every e2e test shares: DeepseekV3 (MLA + MoE), DP2 attention over TP2.
DP2_CONFIG = ServerConfig(arch="deepseek_v3", dp_size=2, tp_size=2, dp_attention=True, name="dp2")


def launcher_command(launcher: str) -> list:
    """The argv prefix that starts SGLang through ``launcher`` (see :attr:`ServerConfig.launcher`)."""
    if launcher == "launch_server":
        return [sys.executable, "-m", "sglang.launch_server"]
    if launcher == "serve":
        script = Path(sys.executable).with_name("sglang")
        if not script.is_file():
            raise ServerError(f"no 'sglang' console script beside {sys.executable}: is sglang installed here?")
        return [str(script), "serve"]
    raise ServerError(f"unknown launcher {launcher!r} (launch_server or serve)")


def model_path(config: ServerConfig) -> str:
    """The model directory the server loads (its tokenizer included)."""
    if config.model_path:
        return config.model_path
    from dspark_harden.devtools.tiny_models import ensure_model

    return ensure_model(config.arch)


_LIVE: "set[SGLangServer]" = set()


@atexit.register
def _stop_leftovers() -> None:  # pragma: no cover - safety net for aborted runs
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001
            pass


@dataclass(eq=False)
class SGLangServer:
    config: ServerConfig
    port: int = 0
    workdir: Path = field(default=None)  # type: ignore[assignment]
    proc: Optional[subprocess.Popen] = None
    ready_seconds: Optional[float] = None
    returncode: Optional[int] = None
    _log_file: Any = None
    _locked: bool = False
    #: watch the /dev/shm entries the server's processes map or hold (:mod:`.shmwatch`): ``shm_before`` is the
    #: directory at its first launch, ``shm_watch`` the tracker of its tree (a drill's leftover check)
    watch_shm: bool = False
    shm_before: Optional[set] = None
    shm_watch: Any = None

    # -- paths --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def process_titled(self, prefix: str) -> int:
        """The pid of the server's process (its process group: the harness starts each server in its
        own session) whose title starts with ``prefix``, e.g. ``sglang::scheduler_DP1_``."""
        for pid in procfs.group_pids(self.pid):
            cmd = procfs.cmdline(pid)
            if cmd is not None and cmd.startswith(prefix):
                return pid
        raise ServerError(f"no process titled {prefix!r} in process group {self.pid}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log_text()
        return text[-chars:]

    def plugin_roles(self) -> list[str]:
        """Roles whose processes logged 'dspark-harden <v> active in <role> process' (one per process)."""
        return [m.group(1) for m in PLUGIN_ACTIVE_RE.finditer(self.log_text())]

    # -- lifecycle ----------------------------------------------------------------------------
    def command(self) -> list[str]:
        c = self.config
        cmd = [
            *launcher_command(c.launcher),
            "--model-path",
            model_path(c),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *BASE_FLAGS,
        ]
        if c.tp_size != 1:
            cmd += ["--tp-size", str(c.tp_size)]
        if c.dp_size != 1:
            cmd += ["--dp-size", str(c.dp_size)]
        if c.dp_attention:
            cmd += ["--enable-dp-attention"]
        cmd += list(c.extra_args)
        return cmd

    def environment(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB_ENV}
        # Strip DSPARK_* switches a developer may have exported; a test passes what it needs.
        env = {k: v for k, v in env.items() if not (k.startswith("DSPARK_") and k not in _KEEP_DSPARK)}
        tmp = self.workdir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env.update(PLATFORM_ENV)
        # TorchInductor's cache lives under TMPDIR by default: every server would rebuild the C++
        # precompiled header and kernels its first CPU forward compiles (~150 MB, ~10 s of a 2-core
        # start). One cache for every server of this user (inductor locks its entries) keeps the
        # servers' own TMPDIR private without paying that per start.
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "dspark-harden" / "torchinductor"))
        env.update(
            TMPDIR=str(tmp),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            SGLANG_PYSPY_DUMP_BEFORE_CRASH="0",
            SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0",
        )
        if self.config.ranks > 1:
            ncpu = os.cpu_count() or 1
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % ncpu) for i in range(self.config.ranks))
        if self.config.plugins is None:
            # Unset or empty SGLANG_PLUGINS means "load every installed plugin" (dspark_harden
            # included); an allow-list naming no installed plugin is what gives stock SGLang.
            env["SGLANG_PLUGINS"] = STOCK_PLUGINS
        else:
            env["SGLANG_PLUGINS"] = self.config.plugins
        # "{workdir}" in a configured value: this server's own workdir (a cache directory that is fresh
        # for every start and removed with the workdir)
        env.update({k: v.replace("{workdir}", str(self.workdir)) for k, v in self.config.env})
        return env

    def launch(self) -> "SGLangServer":
        """Start the process (holding the server lock); does not wait for readiness."""
        if self.proc is not None:
            raise ServerError("server already launched")
        problem = cpu_platform_problem()
        if problem:
            raise ServerError(problem)
        if self.watch_shm and self.shm_before is None:
            from .shmwatch import entries

            self.shm_before = entries()
        _lock.acquire()
        self._locked = True
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"dsh-{self.config.name}-", dir="/tmp"))
            self.port = free_port()
            cmd = self.command()
            env = self.environment()
            (self.workdir / "command.json").write_text(
                json.dumps(
                    {
                        "cmd": cmd,
                        "env": {k: v for k, v in env.items() if k.startswith(("DSPARK_", "SGLANG_", "TMPDIR"))},
                    },
                    indent=2,
                )
            )
            self._log_file = open(self.log_path, "ab", buffering=0)
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=str(self.workdir),
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._t0 = time.monotonic()
            _LIVE.add(self)
            if self.watch_shm:
                self._watch_shm()
        except BaseException:
            self._release()
            raise
        return self

    def _watch_shm(self) -> None:
        from .shmwatch import watch

        if self.shm_watch is None:  # a start retried after a port race keeps its first baseline and inodes
            self.shm_watch = watch(self.proc.pid)
        else:
            self.shm_watch.root = self.proc.pid

    def _http_ok(self, path: str, timeout: float) -> bool:
        import requests

        try:
            r = requests.get(self.url + path, timeout=timeout)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def lost_port_race(self) -> Optional[str]:
        """The log line saying SGLang could not get a port it was given or derived, if any."""
        text = self.log_tail(20000)
        for marker in PORT_RACE_MARKERS:
            at = text.find(marker)
            if at >= 0:
                start = text.rfind("\n", 0, at) + 1
                end = text.find("\n", at)
                return text[start : end if end >= 0 else len(text)].strip()
        return None

    def wait_ready(self, timeout: Optional[float] = None) -> "SGLangServer":
        """Wait until the server serves. Raises :class:`PortRaceError` at once when the log shows a
        lost port race (uvicorn cannot bind: SGLang's main process then hangs instead of exiting),
        :class:`ServerError` when the process exits or the deadline passes; the server is stopped."""
        timeout = ready_timeout() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        stage = "/model_info"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            race = self.lost_port_race()
            if race is not None:
                self.stop()
                raise PortRaceError(self._failure(f"lost a port race ({race})"))
            if rc is not None:
                self.returncode = rc
                self._cleanup_after_exit()
                raise ServerError(self._failure(f"exited with code {rc} before it was ready"))
            if self._http_ok(stage, timeout=5):
                if stage == "/model_info":
                    stage = "/health_generate"
                    continue
                self.ready_seconds = time.monotonic() - self._t0
                sys.stderr.write(
                    f"[harness] SGLang server {self.config.name!r} ready in {self.ready_seconds:.0f}s "
                    f"(pid {self.pid}, {self.url}, workdir {self.workdir})\n"
                )
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(self._failure(f"was not ready after {timeout:.0f}s (waiting for {stage})"))

    def start(
        self, timeout: Optional[float] = None, attempts: int = 3, while_starting: Optional[Any] = None
    ) -> "SGLangServer":
        """Launch and wait; a start that lost a port race is retried on a new port (``attempts``
        in all), with the earlier attempt's log kept in the new workdir's ``port-race-<n>.log``.
        ``while_starting(server)``: called after each launch, before the wait (a caller observing
        the server as it starts)."""
        races = []
        for attempt in range(attempts):
            self.launch()
            for n, text in enumerate(races):
                (self.workdir / f"port-race-{n}.log").write_text(text)
            try:
                if while_starting is not None:
                    while_starting(self)
                return self.wait_ready(timeout)
            except PortRaceError as exc:
                if attempt + 1 == attempts:
                    raise
                races.append(self.log_text())
                sys.stderr.write(f"[harness] {str(exc).splitlines()[0]}; retrying on a new port\n")
                self.remove_workdir()
                self.proc = self.returncode = None  # the next attempt is a fresh launch
        raise AssertionError("unreachable")

    def wait_exit(self, timeout: float) -> Optional[int]:
        """Wait for the main process to exit on its own; None if it is still running."""
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode

    def stop(self, term_timeout: float = 45.0) -> Optional[int]:
        """SIGTERM the main PID, wait; then SIGKILL whatever is left of the process group."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the main PID leads its own group
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=term_timeout)
            except subprocess.TimeoutExpired:
                pass
        # children tear down after the main exits; give them a moment, then kill the rest
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.25)
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.returncode = self.proc.wait()
        self._cleanup_after_exit()
        return self.returncode

    def _cleanup_after_exit(self) -> None:
        pgid = self.proc.pid
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.shm_watch is not None:
            self.shm_watch.stop()  # what it recorded stays for ``shmwatch.leftovers``
        _LIVE.discard(self)
        self._release()

    def _release(self) -> None:
        if self._locked:
            self._locked = False
            _lock.release()

    def remove_workdir(self) -> None:
        if self.workdir and self.workdir.exists() and (self.proc is None or self.proc.poll() is not None):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _failure(self, what: str) -> str:
        return (
            f"SGLang server {self.config.name!r} (pid {self.pid}, port {self.port}) {what}\n"
            f"command: {' '.join(self.command())}\nworkdir: {self.workdir}\n"
            f"----- server log tail -----\n{self.log_tail()}"
        )

    # -- requests -----------------------------------------------------------------------------
    def request(self, method: str, path: str, *, timeout: float = 120.0, **kw):
        import requests

        return requests.request(method, self.url + path, timeout=timeout, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def post(self, path: str, json: Any = None, **kw):
        return self.request("POST", path, json=json, **kw)

    def generate(
        self,
        text: str = "def main():",
        *,
        max_new_tokens: int = 8,
        timeout: float = 120.0,
        sampling_params: Optional[dict] = None,
        **body,
    ) -> dict:
        """POST /generate (greedy by default); raises with the log tail on a non-200 answer."""
        sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        sp.update(sampling_params or {})
        r = self.post("/generate", {"text": text, "sampling_params": sp, **body}, timeout=timeout)
        if r.status_code != 200:
            raise ServerError(self._failure(f"answered /generate with HTTP {r.status_code}: {r.text[:2000]}"))
        return r.json()

    def metrics_text(self, timeout: float = 30.0) -> str:
        r = self.get("/metrics", timeout=timeout)
        r.raise_for_status()
        return r.text


# DSPARK_* variables of the harness itself, kept when scrubbing the developer's environment.
_KEEP_DSPARK = (
    "DSPARK_HARDEN_MODEL_CACHE",
    "DSPARK_SERVER_LOCK",
    "DSPARK_SERVER_LOCK_TIMEOUT",
    "DSPARK_SERVER_READY_TIMEOUT",
)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie main process still counts; reap-aware check through /proc
    return _group_has_live_members(pgid)


def _group_has_live_members(pgid: int) -> bool:
    return bool(procfs.group_pids(pgid))


def start_server(config: ServerConfig, timeout: Optional[float] = None) -> SGLangServer:
    """Start ``config`` and wait until it serves; raises :class:`ServerError` with the log tail."""
    return SGLangServer(config).start(timeout)


def start_expect_failure(config: ServerConfig, timeout: Optional[float] = None) -> tuple[int, str]:
    """Start ``config``, which must FAIL to start: returns ``(exit_code, log)``.

    Raises :class:`ServerError` if it becomes ready instead, or is still running at the deadline.
    """
    timeout = ready_timeout() if timeout is None else timeout
    server = SGLangServer(config).launch()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = server.wait_exit(timeout=2.0)
            if rc is not None:
                server.stop()  # reap leftovers of the group, release the lock
                log = server.log_text()
                server.remove_workdir()
                return rc, log
            if server._http_ok("/model_info", timeout=5):
                server.stop()
                raise ServerError(server._failure("started, but it was expected to refuse to start"))
        server.stop()
        raise ServerError(server._failure(f"neither failed nor became ready within {timeout:.0f}s"))
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
