"""The child side of tests/harness/warm.py: runs one ``python -c`` / ``python -m`` / console-script
command inside a process forked from the warm interpreter, as a fresh interpreter would run it.

Standard library only, and nothing of dspark_harden: this module is imported by the warm interpreter
before any job's environment is applied (unpickling the job), so whatever it imported would have been
imported under the wrong environment.
"""

from __future__ import annotations

import os
import sys
import types


def probe(conn) -> None:
    """The warm interpreter's first child: what its parent imported, under which environment."""
    conn.send(
        {
            "env": dict(os.environ),
            "plugin_modules": sorted(
                m for m in sys.modules if m.split(".")[0] in ("dspark_harden", "tests") and m not in ("tests", __name__)
            ),
            "sglang": "sglang.srt.managers.scheduler" in sys.modules,
        }
    )
    conn.close()


def _set_environ(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)


def call(env: dict, target, *args):
    """A multiprocessing target run with the environment its parent had when it started the process
    (what a spawned child inherits; a forkserver child would get the warm interpreter's)."""
    _set_environ(env)
    return target(*args)


def _fresh_process_state(env: dict, cwd, out_path: str, err_path: str) -> None:
    """Environment, directory, standard streams and multiprocessing identity of a fresh interpreter."""
    _set_environ(env)
    if cwd:
        os.chdir(cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 is /dev/null for the job's whole life
    import multiprocessing.process as mp_process
    from multiprocessing import resource_tracker

    # the job is a main process (multiprocessing.current_process(), parent_process()), with a resource
    # tracker of its own started on first use, as a fresh interpreter has: the warm interpreter's tracker
    # would keep the job's leaked shared-memory registrations until the pytest process ends
    main_cls = next(c for c in mp_process.BaseProcess.__subclasses__() if c.__name__ == "_MainProcess")
    mp_process._current_process = main_cls()
    mp_process._parent_process = None
    mp_process._children = set()
    resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


def run_job(kind: str, target: str, args: list, env: dict, cwd, out_path: str, err_path: str, path: list) -> None:
    """``kind``: ``-c`` (``target`` is the code), ``-m`` (a module name) or ``ep`` (``module:attr`` of
    a console script, ``args[0]`` its path). Ends the process with the command's exit code after the
    interpreter's own exit sequence (non-daemon threads, atexit handlers, stream flush)."""
    import atexit
    import threading
    import traceback

    _fresh_process_state(env, cwd, out_path, err_path)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.path[:] = list(path)
    code = 0
    try:
        if (kind, target) in (("ep", "dspark_harden.cli:main"), ("-m", "dspark_harden.cli"), ("-m", "dspark_harden")):
            _check_children_forked_here()
        if kind == "-c":
            sys.argv[:] = ["-c", *args]
            exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own snippet
        elif kind == "-m":
            import runpy

            sys.argv[:] = [target, *args]
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            import importlib

            module, _, attr = target.partition(":")
            func = importlib.import_module(module)
            for part in attr.split("."):
                func = getattr(func, part)
            sys.argv[:] = list(args)
            code = func()
            code = _exit_code(SystemExit(code))
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # from the command's frame on
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF if code >= 0 else 1)


def _check_children_forked_here() -> None:
    """``dspark-harden check`` starts one child interpreter (``python -m dspark_harden.cli._check_child``)
    that imports SGLang and forks a child per role. Run warm, the CLI's process already holds SGLang's
    modules (the warm interpreter's), so that child is forked from here instead (its environment,
    argv, standard streams and exit code as ``subprocess.run`` would give them). The CLI's own process
    imported only the CLI and ``core.feature`` (under the same environment minus the role and launch
    variables, which are read when the child runs). Only this one call is redirected; every other
    subprocess of the CLI runs as it would."""
    import subprocess

    from dspark_harden.cli import check

    real_run = subprocess.run

    def run(argv, *, env=None, capture_output=False, text=False, timeout=None, **kw):
        argv = list(argv)
        if argv[:3] != [sys.executable, "-m", "dspark_harden.cli._check_child"] or kw or not capture_output:
            return real_run(argv, env=env, capture_output=capture_output, text=text, timeout=timeout, **kw)
        import tempfile
        import time

        with tempfile.TemporaryDirectory(prefix="dsh-warm-check-") as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the check child
                import weakref

                for fin in list(weakref.finalize._registry):  # the CLI's objects (this temporary directory)
                    weakref.finalize._registry[fin].atexit = False  # are not the child's to finalize at exit
                child_env = dict(os.environ if env is None else env)
                run_job("-m", argv[2], argv[3:], child_env, None, out, err, [os.getcwd(), *sys.path[1:]])
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    raise subprocess.TimeoutExpired(argv, timeout)
                time.sleep(0.02)
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            mode = {"encoding": "utf-8", "errors": "replace"} if text else {}
            with open(out, "r" if text else "rb", **mode) as f_out, open(err, "r" if text else "rb", **mode) as f_err:
                return subprocess.CompletedProcess(argv, rc, f_out.read(), f_err.read())

    check.subprocess = types.SimpleNamespace(run=run)  # check.py calls subprocess.run only
