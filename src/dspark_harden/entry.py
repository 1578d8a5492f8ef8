"""SGLang entry point (group ``sglang.srt.plugins``, name ``dspark_harden``).

``sglang.srt.plugins.load_plugins()`` calls :func:`load` in every engine process that loads
plugins (main, DP controller, each scheduler, detokenizer). ``load`` is re-entrant: the first call
binds and verifies the patches of this process's role; later calls only re-verify.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

from .core import binder, roles
from .core.patch import Role
from .core.roles import detect_context

logger = logging.getLogger("dspark_harden")

PLUGIN_NAME = "dspark_harden"


def load(role: Optional[Role] = None) -> binder.BindReport:
    with binder.STATE.lock:
        if binder.STATE.report is not None:
            report = binder.verify()
            binder.raise_if_failed(report)
            return report
        ctx = detect_context(role.value if role else None)
        roles.CONTEXT = ctx
        role = ctx.role
        report = binder.bind(role)
        binder.raise_if_failed(report)
        _install_post_apply_verifier()
        _notify_bound(role, report)
        _announce(presence_line(role, report))
        return report


def load_reason(environ=None) -> str:
    """Why SGLang loaded the plugin in this process: its loader loads every installed plugin unless
    ``SGLANG_PLUGINS`` names a subset (sglang/srt/plugins/__init__.py, load_plugins_by_group)."""
    env = os.environ if environ is None else environ
    allowed = [p.strip() for p in (env.get("SGLANG_PLUGINS") or "").split(",") if p.strip()]
    if PLUGIN_NAME in allowed:
        return f"SGLANG_PLUGINS names it ({','.join(allowed)})"
    return "SGLANG_PLUGINS is unset (stock SGLang loads every installed plugin)"


def presence_line(role: Role, report: binder.BindReport, environ=None) -> str:
    """The one INFO line per process: why the plugin is here, what applies, what does not and why."""
    active = [f.name for f in report.features if f.status == "bound"]
    skipped = [f"{f.name} ({f.detail})" for f in report.features if f.status == "unavailable" and not f.test_only]
    return "dspark-harden %s active in %s process (pid %d), loaded because %s: bound %s%s" % (
        _version(),
        role.value,
        os.getpid(),
        load_reason(environ),
        ", ".join(active) or "nothing",
        ("; unavailable here, stock behaviour: " + "; ".join(skipped)) if skipped else "",
    )


def _announce(message: str) -> None:
    """Log at INFO; if INFO is not enabled yet in this process (SGLang's processes call
    ``load_plugins()`` before ``configure_logger()`` sets the level, so the record would be
    dropped), write the line to stderr: the plugin's presence must always be visible."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(message)
        return
    sys.stderr.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def _notify_bound(role: Role, report: binder.BindReport) -> None:
    pm = binder.STATE.pm
    try:
        pm.hook.dspark_process_bound(role=role, settings=binder.STATE.settings, report=report)
    except binder.BindError:
        raise
    except Exception as exc:  # noqa: BLE001 - fail closed: a feature could not start
        msg = f"dspark-harden refuses to start ({role.value}): starting a feature failed: {type(exc).__name__}: {exc}"
        logger.critical(msg)
        report.errors.append(msg)  # so `dspark-harden check` (which reads the report) fails too
        raise binder.BindError(msg, report) from exc


_VERIFIER_INSTALLED = False


def _install_post_apply_verifier() -> None:
    """Re-verify after SGLang's HookRegistry.apply_hooks(), which runs after every plugin's
    entry point and swallows its own failures. Wrapping it (not replacing) keeps stock behaviour."""
    global _VERIFIER_INSTALLED
    if _VERIFIER_INSTALLED:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
    except Exception:  # noqa: BLE001 - no hook registry: nothing can replace us after this point
        return
    original = HookRegistry.__dict__["apply_hooks"]
    func = original.__func__ if isinstance(original, classmethod) else original

    def apply_hooks_then_verify(*args, **kwargs):
        result = func(*args, **kwargs)
        report = binder.verify()
        binder.raise_if_failed(report)
        return result

    apply_hooks_then_verify.__wrapped__ = func
    HookRegistry.apply_hooks = (
        classmethod(apply_hooks_then_verify) if isinstance(original, classmethod) else apply_hooks_then_verify
    )
    _VERIFIER_INSTALLED = True


def _version() -> str:
    from . import __version__

    return __version__
