"""Which HTTP routes a refusing server still serves: decided by route, not by method.

While the server drains after SIGTERM, and after a child died, :class:`~.main.DrainGate` answers
every request that is not on the read-only allow-list below with HTTP 503 naming the cause.
Deciding by method is wrong on stock 0.5.23: 16 of its routes accept GET and do work
(``/flush_cache``, ``/release_memory_occupation``, ``/open_session``, ``/start_profile`` ...).

Each stock route that accepts GET was read and classified (tests/lifecycle/test_drain_routes.py
enumerates the real app's routes and fails on a GET route that is in none of these sets, so a new
stock route is a loud test failure, not a silent hole):

* :data:`READ`: answered from the main process's own state (or, ``/remote_instance_transfer_engine_info``,
  from the bootstrap server with a 5 s timeout); served while draining **and** after a child died;
* :data:`SCHEDULER_READ`: read-only but they wait for every scheduler's reply through stock's
  communicators, which have no timeout: served while draining (the schedulers still run), 503 after a
  child died (a dead scheduler never answers; the request would hang until the server exits);
* :data:`PROBE`: health and readiness probes: 503 from the gate while refusing (stock answers
  ``/health`` and ``/ready`` with 503 during a drain too, but after a child died ``/ready``,
  ``/ping`` and a non-generating ``/health`` would still say 200, and ``/health_generate`` would send
  a generation to a dead scheduler). ``/health_scheduler`` (this plugin) is in :data:`READ`: it gives
  its own 503 verdict (``shutting_down`` / ``child_died``);
* :data:`WORK_GET`: stock routes that accept GET and do work: 503 like every other work route.

Every path not in :data:`READ`/:data:`SCHEDULER_READ` is refused, whatever its method (unknown paths
and routes other plugins add included: fail closed), except :data:`ALWAYS_ALLOWED` (it helps a drain
finish) and ``OPTIONS`` (no stock route accepts it: CORS preflights are answered by the CORS
middleware, anything else is a 405, so no endpoint runs). Read routes are served for ``GET`` and
``HEAD`` only: ``PUT``/``DELETE /hicache/storage-backend`` share a path with the read ``GET``.
WebSocket connections (``/v1/realtime``) are refused while refusing.
"""

from __future__ import annotations

import os
from typing import Optional

#: FastAPI's own documentation routes
_DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")

#: read-only, answered without the schedulers: served while draining and after a child died
READ = frozenset(
    _DOCS
    + (
        "/",  # "SGLang is running" (or SGLANG_OLLAMA_ROOT_ROUTE)
        os.environ.get("SGLANG_OLLAMA_ROOT_ROUTE") or "/",
        "/model_info",
        "/get_model_info",  # tokenizer manager's model config
        "/v1/models",
        "/v1/models/{model:path}",  # served model name / LoRA registry
        os.environ.get("SGLANG_OLLAMA_TAGS_ROUTE", "/api/tags"),  # served model name
        "/hicache/storage-backend",  # GET: tokenizer-side config values (PUT/DELETE are work)
        "/v1/responses/{response_id}",  # a stored response, from the response store
        "/v1/loads",  # the schedulers' shared-memory load snapshots
        "/is_scaling_elastic_ep",  # the tokenizer's mirrored elastic-EP state
        "/remote_instance_transfer_engine_info",
        "/get_remote_instance_transfer_engine_info",  # bootstrap server, 5 s timeout
        "/metrics",  # Prometheus (a Mount: /metrics and everything below it)
        "/health_scheduler",  # this plugin: its own 503 verdict (shutting_down / child_died)
    )
)

#: read-only, but wait for every scheduler's reply (stock communicators, no timeout): served while
#: draining, 503 after a child died
SCHEDULER_READ = frozenset(
    {
        "/server_info",
        "/get_server_info",  # get_internal_state from every scheduler
        "/get_hicache_l3_cache_layout",  # GetHiCacheL3LayoutReq to every scheduler
        "/list_external_corpora",  # ListExternalCorporaReqInput to every scheduler
    }
)

#: health / readiness probes: 503 from the gate while refusing (the body names the cause)
PROBE = frozenset({"/health", "/health_generate", "/ready", "/ping"})

#: stock routes that accept GET and do work: 503 while refusing, like every POST
WORK_GET = frozenset(
    {
        "/flush_cache",
        "/start_profile",
        "/stop_profile",
        "/set_trace_level",
        "/freeze_gc",
        "/start_expert_distribution_record",
        "/stop_expert_distribution_record",
        "/dump_expert_distribution_record",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/weights_checker",
        "/slow_down",
        "/open_session",
        "/close_session",
        "/configure_logging",
    }
)

#: work routes still accepted while refusing (they help a drain finish)
ALWAYS_ALLOWED = frozenset({"/abort_request"})

#: methods under which a read route is served (OPTIONS is served on every path: see the module doc)
READ_METHODS = frozenset({"GET", "HEAD"})

#: routes matched as a prefix (stock mounts the Prometheus app with the regex ``^/metrics(?P<path>.*)$``)
_PREFIXES = ("/metrics",)

_compiled: Optional[tuple] = None


def _compile() -> tuple:
    """(static read paths, [(regex, class)], ...) built once; templates with ``{param}`` use
    Starlette's own path compiler, so they match exactly what the stock routes match."""
    global _compiled
    if _compiled is None:
        from starlette.routing import compile_path

        static: dict = {}
        patterns = []
        for cls, paths in (("read", READ), ("scheduler_read", SCHEDULER_READ)):
            for p in paths:
                if "{" in p:
                    patterns.append((compile_path(p)[0], cls))
                else:
                    static[p] = cls
        _compiled = (static, patterns)
    return _compiled


def read_class(path: str) -> Optional[str]:
    """``"read"`` / ``"scheduler_read"`` for a read-only route's path, else None."""
    static, patterns = _compile()
    cls = static.get(path)
    if cls is not None:
        return cls
    for prefix in _PREFIXES:
        if path.startswith(prefix):
            return "read"
    for regex, cls in patterns:
        if regex.match(path):
            return cls
    return None


def route_path(scope: dict) -> str:
    """The path the app's routes match (Starlette's ``get_route_path``: ``root_path`` stripped)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


def served_while_refusing(scope_type: str, method: str, path: str, child_died: bool) -> bool:
    """True when a refusing server still passes this request to stock."""
    if scope_type != "http":
        return False  # a new WebSocket session (/v1/realtime) is new work
    if method == "OPTIONS":
        return True
    if path in ALWAYS_ALLOWED:
        return True
    if method not in READ_METHODS:
        return False
    cls = read_class(path)
    if cls == "read":
        return True
    if cls == "scheduler_read":
        return not child_died
    return False


def classify_route(path: str) -> Optional[str]:
    """The class of a route template (``read``, ``scheduler_read``, ``probe``, ``work_get``), else None."""
    if path in READ or any(path == p for p in _PREFIXES):
        return "read"
    if path in SCHEDULER_READ:
        return "scheduler_read"
    if path in PROBE:
        return "probe"
    if path in WORK_GET:
        return "work_get"
    return None
