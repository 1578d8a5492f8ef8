"""Which SGLang process are we in? Decided from the caller of ``load_plugins()``."""

from __future__ import annotations

import os
import sys
from typing import Optional

from .patch import Role

# function that calls sglang.srt.plugins.load_plugins() -> role (sglang 0.5.23)
_CALLERS = {
    "run_scheduler_process": Role.SCHEDULER,
    "run_data_parallel_controller_process": Role.CONTROLLER,
    "run_detokenizer_process": Role.DETOKENIZER,
}


def detect_role(forced: Optional[str] = None) -> Role:
    if forced:
        return Role(forced)
    env = os.environ.get("DSPARK_HARDEN_ROLE")
    if env:
        return Role(env)
    frame = sys._getframe(1)
    while frame is not None:
        role = _CALLERS.get(frame.f_code.co_name)
        if role is not None and frame.f_globals.get("__name__", "").startswith("sglang."):
            return role
        frame = frame.f_back
    return Role.MAIN
