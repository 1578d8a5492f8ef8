"""Which SGLang process are we in? Decided from the caller of ``load_plugins()``.

The caller's frame also carries the process's ``server_args`` and ranks (scheduler, DP controller
and detokenizer are started with them), which features use to validate geometry at bind time.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from .patch import Role

# function that calls sglang.srt.plugins.load_plugins() -> role (sglang 0.5.23)
_CALLERS = {
    "run_scheduler_process": Role.SCHEDULER,
    "run_data_parallel_controller_process": Role.CONTROLLER,
    "run_detokenizer_process": Role.DETOKENIZER,
}
# main-process callers of load_plugins() in sglang 0.5.23: (file path suffix, function); "<module>"
# is module-level code (python -m sglang.launch_server; our multi-tokenizer HTTP worker app)
_MAIN_CALLERS = frozenset(
    {
        ("sglang/launch_server.py", "<module>"),
        ("sglang/cli/serve.py", "serve"),
        ("sglang/srt/entrypoints/engine.py", "__init__"),
        ("sglang/srt/entrypoints/engine.py", "_launch_subprocesses"),
        ("dspark_harden/ingress/app.py", "<module>"),
    }
)
ROLE_ENV = "DSPARK_HARDEN_ROLE"


class RoleError(SystemExit):
    """The process role cannot be trusted: stop instead of binding the wrong patches (a SystemExit,
    so SGLang's ``except Exception`` around plugins cannot swallow it)."""

    def __init__(self, message: str):
        super().__init__(f"dspark-harden: {message}")


@dataclass(frozen=True)
class ProcessContext:
    role: Role
    server_args: Any = None  # sglang ServerArgs where the caller had it (not in the main process)
    tp_rank: Optional[int] = None
    dp_rank: Optional[int] = None  # DP (attention) rank of a scheduler, None elsewhere
    #: main process only: "engine" when the offline ``sglang.Engine`` API (the user's own process) called
    #: ``load_plugins()`` first, "server" for launch_server / ``sglang serve`` / our HTTP worker app
    main_entry: Optional[str] = None

    @property
    def dp_label(self) -> str:
        """Value for the ``dp_rank`` metric label ("none" outside DP schedulers)."""
        return "none" if self.dp_rank is None else str(self.dp_rank)


def _dp_rank_of(server_args: Any, tp_rank: Optional[int], dp_rank: Optional[int]) -> Optional[int]:
    if dp_rank is not None:
        return dp_rank
    if server_args is None or tp_rank is None:
        return None
    # 0.5.23 resolves --dp-size N --enable-dp-attention into attn_dp_size (dp_size may read 1)
    attn_dp = getattr(server_args, "attn_dp_size", None) or 0
    if not attn_dp and getattr(server_args, "enable_dp_attention", False):
        attn_dp = getattr(server_args, "dp_size", 1) or 1
    if attn_dp <= 1:
        return None
    attn_tp = max(1, server_args.tp_size // attn_dp)
    return tp_rank // attn_tp


def _main_caller(frame) -> Optional[str]:
    """ "engine" / "server" when ``frame`` is a main-process caller of ``load_plugins()``, else None."""
    path = frame.f_code.co_filename.replace("\\", "/")
    for suffix, fn in _MAIN_CALLERS:
        if path.endswith(suffix) and frame.f_code.co_name == fn:
            return "engine" if suffix.endswith("entrypoints/engine.py") else "server"
    return None


def detect_context(forced: Optional[str] = None) -> ProcessContext:
    """The role of this process, from the SGLang function that called ``load_plugins()``.

    ``forced`` (the entry point's argument) or ``DSPARK_HARDEN_ROLE`` decide only where no SGLang
    process caller is on the stack (``dspark-harden check`` children, test interpreters). In a
    process SGLang started, a role variable that disagrees with it stops startup (the variable is
    inherited by every child of a launch that left it exported), and a caller that is neither a
    known SGLang process function nor a known main-process entry point stops startup too, instead
    of falling back to ``main`` and silently skipping the scheduler's patches."""
    frame = sys._getframe(1)
    found_role, found_locals, callers, main_entry = None, {}, [], None
    while frame is not None:
        role = _CALLERS.get(frame.f_code.co_name)
        if role is not None and frame.f_globals.get("__name__", "").startswith("sglang."):
            found_role, found_locals = role, dict(frame.f_locals)
            break
        main_entry = _main_caller(frame)
        if main_entry:
            found_role = Role.MAIN
            break
        callers.append(f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}")
        frame = frame.f_back
    name = forced or os.environ.get(ROLE_ENV)
    if name:
        try:
            wanted = Role(name)
        except ValueError:
            raise RoleError(f"{ROLE_ENV}={name!r} is not a role (main, controller, scheduler, detokenizer)") from None
        if found_role is not None and wanted is not found_role:
            raise RoleError(
                f"{ROLE_ENV}={name} is set, but SGLang started this process as its {found_role.value} (pid "
                f"{os.getpid()}): the variable is only for `dspark-harden check` children and would bind the "
                f"wrong patches here. Unset {ROLE_ENV} in the server's environment."
            )
        role = wanted
    elif found_role is not None:
        role = found_role
    else:
        raise RoleError(
            "cannot tell which SGLang process called load_plugins() (no scheduler, DP controller, "
            "detokenizer or main-process entry point of sglang 0.5.23 on the stack; innermost callers: "
            f"{', '.join(callers[1:5]) or '?'}). Refusing to bind as 'main', which would skip the patches "
            f"of any other role. Start SGLang through its own entry points, or set {ROLE_ENV} for a check."
        )
    server_args = found_locals.get("server_args")
    tp_rank = found_locals.get("tp_rank")
    return ProcessContext(
        role=role,
        server_args=server_args,
        tp_rank=tp_rank,
        dp_rank=_dp_rank_of(server_args, tp_rank, found_locals.get("dp_rank")),
        main_entry=main_entry,
    )


CONTEXT: Optional[ProcessContext] = None  # set by the entry point once per process
#: set only in a `dspark-harden check -- <launch arguments>` child: the ServerArgs parsed from them. Kept
#: out of CONTEXT.server_args, which tells features that they run in a real server (and may start things)
CHECK_SERVER_ARGS: Any = None


def judged_server_args() -> Any:
    """The server arguments a feature's preconditions are judged against at bind time: the process's
    own (a real SGLang process), else those `check -- <launch arguments>` parsed, else ``None`` (a plain
    `check` child binds every target to prove it)."""
    ctx = CONTEXT
    if ctx is not None and ctx.server_args is not None:
        return ctx.server_args
    return CHECK_SERVER_ARGS
