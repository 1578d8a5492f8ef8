"""Subprocesses of the suite forked from a warm interpreter instead of started fresh (issue 42).

A snippet, CLI or helper subprocess of a test spends ~15 CPU-seconds importing SGLang before it does
anything (10 s for ``sglang.srt.server_args``, 17 s for the scheduler's modules, on the 2-core CI
host), and the suite starts a few hundred. :func:`run` runs such a command (``python -c``, ``python
-m``, or a console script of this environment) in a child of a multiprocessing *forkserver* (stdlib)
that imported SGLang's modules once (:data:`PRELOAD`, the modules SGLang calls ``load_plugins()`` from)
and nothing of the plugin. The child takes the command's environment, directory, argv, standard streams
(to files, read back), ``__main__``, multiprocessing identity and resource tracker of a fresh
interpreter, runs the command, then the interpreter's exit sequence (non-daemon threads, atexit).

What a fresh interpreter reads **at import** must be what the warm one read: a command runs warm only
when its environment equals the warm interpreter's on every variable except the ones read after import
(:data:`AFTER_IMPORT`: the plugin's own settings, which its modules read when they bind -- the warm
interpreter never imports the plugin, which is checked --, and ``SGLANG_PLUGINS``, which SGLang's loader
reads when ``load_plugins()`` runs). Any other difference (a platform switch, a ``TORCH_``/``OMP_``
setting, ``TMPDIR``, ...) runs the command fresh, as does every command of a process other than the
one that started the warm interpreter (a forked test), a command with another interpreter, and every
command when ``DSPARK_TEST_FRESH=1``. The end-of-run section ``warm subprocesses`` counts both paths and
names the variables that sent commands fresh.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading

from dspark_harden.cli import _check_child

# the child module, then the modules SGLang calls load_plugins() from (the check child's own list)
PRELOAD = ("tests._warm_child", *_check_child.PRELOAD)
AFTER_IMPORT = ("DSPARK_HARDEN_", "SGLANG_DSPARK_", "DSPARK_TESTFEATURE")
# TORCHINDUCTOR_CACHE_DIR: read (and set to its default when unset) by torch's ``cache_dir()`` when inductor
# first needs its cache, never at import; a test process that compiled something has it set.
# SGLANG_HTTP_SERVER_APP_PATH, SGLANG_SCHEDULER_SKIP_ALL_GATHER: read by SGLang through ``envs.X.get()`` (which
# reads os.environ at each call) inside functions only -- a server's launch of its HTTP workers, the DP
# attention sync -- never at import (the only module-level reads of os.environ at import are whole-environment
# scans for deprecated names: sglang.srt.environ, tqdm, networkx)
AFTER_IMPORT_EXACT = (
    "SGLANG_PLUGINS",
    "PYTEST_CURRENT_TEST",
    "TORCHINDUCTOR_CACHE_DIR",
    "SGLANG_HTTP_SERVER_APP_PATH",
    "SGLANG_SCHEDULER_SKIP_ALL_GATHER",
)

STATS = {"warm": 0, "fresh": 0, "why_fresh": collections.Counter()}
_LOCK = threading.Lock()
_STATE: dict = {}  # owner pid, context, import env, fresh sys.path; or "disabled": reason


def _after_import(key: str) -> bool:
    return key.startswith(AFTER_IMPORT) or key in AFTER_IMPORT_EXACT


def _differs(a: dict, b: dict, skip=_after_import) -> list:
    return sorted(k for k in set(a) | set(b) if not skip(k) and a.get(k) != b.get(k))


def _lost_reason():
    """Why this process's warm interpreter can no longer serve (killed, reaped by someone else, or its
    listener socket removed), else ``None``."""
    from multiprocessing import forkserver

    pid, address = forkserver._forkserver._forkserver_pid, forkserver._forkserver._forkserver_address
    try:
        if pid is None or os.waitpid(pid, os.WNOHANG)[0] != 0:
            return f"warm interpreter lost (pid {pid} exited or was reaped by another)"
    except ChildProcessError:
        return f"warm interpreter lost (pid {pid} exited or was reaped by another)"
    if address and not os.path.exists(address):
        return f"warm interpreter lost (its listener {address} was removed)"
    return None


def _forget_locked(why: str) -> None:
    """A lost warm interpreter (``_LOCK`` held): replaced at the next command, at most
    ``MAX_RESTARTS`` times per process, then every command runs fresh."""
    _STATE.clear()
    _LOST.append(why)
    if _RESTARTS[0] < MAX_RESTARTS:
        _RESTARTS[0] += 1
        _new_forkserver()
    else:
        _STATE["disabled"] = why


MAX_RESTARTS = 3
_RESTARTS = [0]
_LOST: list = []  # why each warm interpreter of this process was lost (the end-of-run section names them)


def _new_forkserver() -> None:
    """Kill the lost forkserver if it still runs and forget it (multiprocessing keeps one per process)
    and the temporary directory its listener lived in, so that the next command starts a new one. A
    test that tracks this process's whole tree and removes what it left
    (tests/lifecycle/test_dying_holders.py) removes the listener."""
    import signal
    from multiprocessing import forkserver, process

    pid = forkserver._forkserver._forkserver_pid
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    fs = forkserver.ForkServer()
    forkserver._forkserver = fs
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload"):
        setattr(forkserver, name, getattr(fs, name))
    process.current_process()._config.pop("tempdir", None)


def _as_imported(env: dict, state: dict) -> dict:
    """``env`` with the variables SGLang's import sets (to the value it sets them to) put back as they
    were before the import: such a value came from an import of SGLang in the calling process, and a
    fresh interpreter's import ends with the same."""
    out = dict(env)
    for k, v in state["import_set"].items():
        if out.get(k) == v:
            if k in state["env"]:
                out[k] = state["env"][k]
            else:
                out.pop(k)
    return out


def _start() -> dict:
    """The warm interpreter of this pytest process (started on first use, from the environment the
    process started with; ``{"disabled": reason}`` when it cannot serve)."""
    import multiprocessing as mp

    if os.environ.get("DSPARK_TEST_FRESH") == "1":
        return {"disabled": "DSPARK_TEST_FRESH=1"}
    before = dict(os.environ)  # the warm interpreter starts with it (and imports under it)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    r, w = ctx.Pipe(duplex=False)
    from tests import _warm_child

    p = ctx.Process(target=_warm_child.probe, args=(w,), name="warm-probe")
    p.start()
    w.close()
    if not r.poll(600):
        p.kill()
        return {"disabled": "the warm interpreter did not answer its probe in 600 s"}
    found = r.recv()
    p.join()
    if found["plugin_modules"]:
        return {"disabled": f"importing SGLang imported the plugin's modules: {found['plugin_modules'][:5]}"}
    if not found["sglang"]:
        return {"disabled": "the warm interpreter could not import SGLang's scheduler"}
    fresh = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
        env=before,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    after = found["env"]
    return {
        "pid": os.getpid(),
        "ctx": ctx,
        "env": before,
        # what importing SGLang itself set in os.environ (cache directories): a fresh interpreter's import
        # sets the same, so each job gets them on top of its own environment
        "import_set": {k: v for k, v in after.items() if before.get(k) != v},
        "import_unset": [k for k in before if k not in after],
        "path": json.loads(fresh.stdout)[1:],
    }


def _state() -> dict:
    """This process's warm interpreter, alive (a lost one is replaced here), or ``{"disabled": why}``."""
    with _LOCK:
        if _STATE.get("pid") == os.getpid():  # (a forked test's copy of the state is not its own: left alone)
            why = _lost_reason()
            if why:
                _forget_locked(why)
        if not _STATE:
            # start it only from an environment the rest of the run shares (not inside a test's
            # monkeypatched one): until then commands run fresh
            now = dict(os.environ)
            if [k for k in _differs(now, _BASE_ENV) if k in _BASE_ENV or k.startswith(("SGLANG_", "DSPARK_"))]:
                return {"disabled": "not started yet"}  # (variables an import added, as SGLang's does, count not)
            _STATE.update(_start())
        return _STATE


_BASE_ENV = dict(os.environ)  # the environment this pytest process started with


@functools.lru_cache(maxsize=None)
def _console_script(name: str):
    from importlib.metadata import entry_points

    base = os.path.basename(name)
    for ep in entry_points(group="console_scripts"):
        if ep.name == base:
            return ep.value
    return None


def _split(argv: list):
    """``(kind, target, args)`` of a command the warm interpreter can run, else ``None``."""
    exe = argv[0]
    if exe == sys.executable and len(argv) >= 3 and argv[1] in ("-c", "-m"):
        return argv[1], argv[2], list(argv[3:])
    if os.sep not in exe or os.path.dirname(exe) == os.path.dirname(sys.executable):
        value = _console_script(exe)
        if value:
            return "ep", value, [os.path.join(os.path.dirname(sys.executable), os.path.basename(exe)), *argv[1:]]
    return None


def _fresh(why: str, argv, env, timeout, cwd) -> subprocess.CompletedProcess:
    STATS["fresh"] += 1
    STATS["why_fresh"][why] += 1
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def run(
    argv: list,
    env: dict | None = None,
    timeout: float | None = None,
    cwd=None,
    fresh: bool = False,
    capture_output: bool = True,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)``,
    forked from the warm interpreter when that is equivalent (module docstring). ``fresh=True``: a test
    that inspects what the interpreter imported (``sys.modules``) always gets a fresh one."""
    if not (capture_output and text):
        raise ValueError("warm.run captures text output only (capture_output=True, text=True)")
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    if fresh:
        return _fresh("the test inspects the interpreter's imports (fresh=True)", argv, env, timeout, cwd)
    split = _split(argv)
    if split is None:
        return _fresh("another interpreter or command", argv, env, timeout, cwd)
    state = _state()
    if "disabled" in state:
        return _fresh(state["disabled"], argv, env, timeout, cwd)
    if state["pid"] != os.getpid():
        return _fresh("a forked test", argv, env, timeout, cwd)
    differs = _differs(_as_imported(env, state), state["env"])
    if differs:
        return _fresh("environment differs in " + ", ".join(differs[:4]), argv, env, timeout, cwd)
    kind, target, args = split
    env = {k: v for k, v in {**env, **state["import_set"]}.items() if k not in state["import_unset"]}
    path = (
        ["" if kind == "-c" else os.path.abspath(cwd or os.getcwd())] if kind != "ep" else [os.path.dirname(args[0])]
    ) + state["path"]
    with tempfile.TemporaryDirectory(prefix="dsh-warm-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        from tests import _warm_child

        p = state["ctx"].Process(
            target=_warm_child.run_job, args=(kind, target, args, env, cwd, out, err, path), name="warm-job"
        )
        try:
            p.start()
        except (OSError, EOFError, ValueError) as exc:  # the warm interpreter is gone: this one runs fresh
            why = f"warm interpreter lost ({type(exc).__name__}: {exc})"
            with _LOCK:
                _forget_locked(why)
            return _fresh(why, argv, env, timeout, cwd)
        p.join(timeout)
        timed_out = p.exitcode is None
        if timed_out:
            p.kill()
            p.join()

        def read(path_):
            try:
                with open(path_, encoding="utf-8", errors="replace") as f:
                    return f.read()
            except OSError:
                return ""

        stdout, stderr = read(out), read(err)
    STATS["warm"] += 1
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(argv, p.exitcode, stdout, stderr)


class _Context:
    """The part of a multiprocessing context ``run_pair``-style harnesses use (``Queue``, ``Barrier``, ``Process``):
    processes forked from the warm interpreter, each started under its parent's environment of the
    moment, as a spawned one is."""

    def __init__(self, state: dict):
        self._state = state
        self._ctx = state["ctx"]

    def Queue(self, *a, **kw):  # noqa: N802 - multiprocessing's name
        return self._ctx.Queue(*a, **kw)

    def Barrier(self, *a, **kw):  # noqa: N802 - multiprocessing's name
        return self._ctx.Barrier(*a, **kw)

    def Process(self, target=None, args=(), kwargs=None, **kw):  # noqa: N802 - multiprocessing's name
        from tests import _warm_child

        env = {**os.environ, **self._state["import_set"]}
        STATS["warm"] += 1
        return self._ctx.Process(target=_warm_child.call, args=(env, target, *args), kwargs=kwargs or {}, **kw)


def mp_context():
    """A context for ``dspark_harden.dp2.harness.run_pair(..., ctx=)`` and the like: the warm one when
    this process's environment allows it (module docstring), else multiprocessing's spawn context."""
    import multiprocessing as mp

    state = _state()
    why = state.get("disabled") or ("a forked test" if state["pid"] != os.getpid() else None)
    if why is None:
        # the target's module is unpickled, so imported, before the child takes its parent's environment:
        # every variable must match here, the plugin's own too
        differs = _differs(
            _as_imported(dict(os.environ), state),
            state["env"],
            skip=lambda k: k in ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"),
        )
        why = differs and "environment differs in " + ", ".join(differs[:4])
    if why:
        STATS["fresh"] += 1
        STATS["why_fresh"][why] += 1
        return mp.get_context("spawn")
    return _Context(state)


def stats_json() -> dict:
    return {"warm": STATS["warm"], "fresh": STATS["fresh"], "why_fresh": dict(STATS["why_fresh"]), "lost": list(_LOST)}


def summary_lines(all_stats: list) -> list:
    """The end-of-run section: commands forked warm and started fresh (over every pytest process)."""
    warm_n = sum(s["warm"] for s in all_stats)
    why: collections.Counter = collections.Counter()
    for s in all_stats:
        why.update(s["why_fresh"])
    lines = [f"{warm_n} command(s) forked from the warm interpreter, {sum(why.values())} started fresh"]
    lines += [
        f"  lost (then restarted, at most {MAX_RESTARTS} times): {w}" for s in all_stats for w in s.get("lost", [])
    ]
    return lines + [f"  fresh: {n} x {reason}" for reason, n in why.most_common()]
