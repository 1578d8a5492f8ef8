"""Child process of ``dspark-harden check``: runs SGLang's own ``load_plugins()`` for one role, or
(``--roles a,b,...``) imports the modules from which SGLang calls ``load_plugins()`` once and forks one
child per role from there, so the ~8 s SGLang import is paid once instead of once per role."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys

from .check import _MARK, LAUNCH_ENV, failed_report


def _report() -> dict:
    role = os.environ["DSPARK_HARDEN_ROLE"]
    from ..core import binder
    from ..entry import PLUGIN_NAME

    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == PLUGIN_NAME]
    base = {
        "role": role,
        "sglang_version": binder.sglang_version(),
        "plugin_loaded": False,
        "features": [],
        "errors": [],
    }
    if not eps:
        base["errors"].append(
            f"no entry point {PLUGIN_NAME!r} in group sglang.srt.plugins: is dspark-harden installed in this environment?"
        )
        return base
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        base["errors"].append(
            f"SGLANG_PLUGINS={allowed!r} does not name {PLUGIN_NAME}: SGLang would not load the plugin at all "
            f"(set SGLANG_PLUGINS={PLUGIN_NAME} or include it in the list)"
        )
        return base
    from sglang.srt.plugins import load_plugins

    error = None
    try:
        load_plugins()
    except binder.BindError as exc:
        error = exc
    if binder.STATE.report is None:
        base["errors"].append(
            str(error) if error else "load_plugins() returned without running the dspark_harden entry point"
        )
        return base
    rep = binder.STATE.report.to_dict()
    rep["plugin_loaded"] = True
    if LAUNCH is not None:
        rep["launch"] = LAUNCH
    return rep


LAUNCH = None  # {"argv", "resolution", "loaded_because"} of `check -- <launch arguments>`


def parse_launch(argv: list) -> tuple:
    """``(server_args, resolution)`` for sglang launch arguments, parsed with SGLang's own parser
    (``prepare_server_args``) and resolved the way a launch resolves them (``resolve_once``). Where
    resolution cannot run on this host (no accelerator, a hub model path offline) the arguments are
    judged as given, and ``resolution`` says so."""
    import contextlib
    import io

    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            server_args = prepare_server_args(list(argv))
    except SystemExit as exc:  # argparse: name what it printed
        raise ValueError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else exc) from None
    try:
        server_args.resolve_once()
        return server_args, "resolved as a launch on this host resolves them"
    except Exception as exc:  # noqa: BLE001 - judge the unresolved arguments, and say why
        return prepare_server_args(list(argv)), (
            f"not resolvable on this host ({type(exc).__name__}: {str(exc)[:200]}): judged as given, before resolution"
        )


# the modules each role's process has imported when it calls load_plugins(): SGLang calls it from
# inside these (engine.py for the main process, scheduler.py, data_parallel_controller.py,
# detokenizer_manager.py); a role child binds in the same state, after their import
PRELOAD = (
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.data_parallel_controller",
    "sglang.srt.managers.detokenizer_manager",
)


def _safe_report() -> dict:
    try:
        return _report()
    except BaseException as exc:  # noqa: BLE001 - the parent needs a report whatever happens
        return failed_report(os.environ.get("DSPARK_HARDEN_ROLE", "?"), f"{type(exc).__name__}: {exc}")


def _emit(rep: dict) -> None:
    sys.stdout.write(_MARK + json.dumps(rep) + "\n")
    sys.stdout.flush()


def _fork_roles(roles: list) -> list:
    """One forked child per role from this process (SGLang's modules imported, nothing bound, no
    Python thread started): each reports through its own pipe. A child that dies without a report is an
    error report naming its exit status."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the role child's own load_plugins() reports it
            pass
    children = []
    for role in roles:
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the forked child
            os.close(r)
            code = 0
            try:
                os.environ["DSPARK_HARDEN_ROLE"] = role
                data = json.dumps(_safe_report()).encode()
                with os.fdopen(w, "wb") as f:
                    f.write(data)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(w)
        children.append((role, pid, r))
    reports = []
    for role, pid, r in children:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        try:
            reports.append(json.loads(data))
        except ValueError:
            reports.append(
                failed_report(role, f"check child for role {role} ended ({_status(status)}) without a report")
            )
    return reports


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _judge_launch() -> None:
    """``check -- <launch arguments>``: parse them once, before forking the role children, so every
    feature's preconditions are judged against them (core.roles.judged_server_args)."""
    global LAUNCH
    raw = os.environ.get(LAUNCH_ENV)
    if not raw:
        return
    from ..core import roles
    from ..entry import load_reason

    argv = json.loads(raw)
    roles.CHECK_SERVER_ARGS, resolution = parse_launch(argv)
    LAUNCH = {"argv": argv, "resolution": resolution, "loaded_because": load_reason()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _judge_launch()
    except BaseException as exc:  # noqa: BLE001 - bad launch arguments: every role reports why
        for role in argv[1].split(",") if argv[:1] == ["--roles"] and len(argv) == 2 else ["?"]:
            _emit(failed_report(role, f"the launch arguments do not parse: {type(exc).__name__}: {exc}"))
        return 0
    if argv[:1] == ["--roles"] and len(argv) == 2:
        for rep in _fork_roles([r for r in argv[1].split(",") if r]):
            _emit(rep)
        return 0
    _emit(_safe_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
