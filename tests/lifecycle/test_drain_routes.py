"""The drain gate decides by route, not by method, over the real stock 0.5.23 HTTP app (issue 21 item 6).

* every route of the real ``sglang.srt.entrypoints.http_server.app`` that accepts GET (plus stock's
  Prometheus mount and the GET routes this plugin adds in the main process) is in exactly one class
  of :mod:`dspark_harden.lifecycle.drain_routes`; a new unclassified GET route fails here;
* the real :class:`DrainGate`, installed on the real stock app by the lifecycle feature's own
  MiddlewarePatch, is driven with Starlette's TestClient over every route and method of that app
  while ``MAIN`` refuses (draining; a child died): work routes (the 16 GET ones included) and
  probes get the gate's 503 naming the cause and never reach stock; read-only routes reach stock;
  scheduler round trips reach stock only while no child died; a WebSocket session is refused.
"""

from __future__ import annotations

import os
import time

import pytest


def _flatten(routes, prefix=""):
    """(path, methods, route) for every route of a FastAPI app, included routers expanded."""
    for r in routes:
        if type(r).__name__ == "_IncludedRouter":
            yield from _flatten(r.original_router.routes, prefix + (r.include_context.prefix or ""))
            continue
        path = getattr(r, "path", None)
        if path is None:
            continue
        yield prefix + path, frozenset(getattr(r, "methods", None) or ()), r


def _stock_app():
    from sglang.srt.entrypoints import http_server

    return http_server.app


def _plugin_main_routes():
    """(path, methods) of the RoutePatches this plugin binds in the main process (all features on)."""
    from dspark_harden.core.manager import all_setting_specs, make_manager
    from dspark_harden.core.patch import Role, RoutePatch
    from dspark_harden.core.settings import load_settings

    pm = make_manager(load_extensions=False)
    settings = load_settings(all_setting_specs(pm), {})
    out = []
    for group in pm.hook.dspark_patches(role=Role.MAIN, settings=settings):
        for p in group or []:
            if isinstance(p, RoutePatch):
                out.append((p.path, frozenset(p.methods)))
    return out


def test_every_get_route_of_the_real_stock_app_is_classified():
    from dspark_harden.lifecycle import drain_routes as R

    routes = [(p, m) for p, m, _r in _flatten(_stock_app().routes)]
    routes += _plugin_main_routes()
    routes.append(("/metrics", frozenset({"GET"})))  # stock's Mount, added at launch (add_prometheus_middleware)
    get_paths = sorted({p for p, m in routes if "GET" in m})
    unclassified = [p for p in get_paths if R.classify_route(p) is None]
    assert not unclassified, (
        f"stock (or this plugin) has GET route(s) the drain gate does not know: {unclassified}; read each "
        "handler and add it to READ / SCHEDULER_READ / PROBE / WORK_GET in lifecycle/drain_routes.py"
    )
    # the classes are disjoint, and none names a route that does not exist (a stale entry is a hole too)
    classes = [R.READ, R.SCHEDULER_READ, R.PROBE, R.WORK_GET]
    for i, a in enumerate(classes):
        for b in classes[i + 1 :]:
            assert not (a & b), a & b
    known = set(get_paths)
    stale = sorted(p for c in classes for p in c if p not in known)
    assert not stale, f"classified paths with no GET route in stock 0.5.23: {stale}"
    # the count: 16 stock routes accept GET and do work
    work_get = sorted(p for p in get_paths if R.classify_route(p) == "work_get")
    assert len(work_get) == 16, work_get
    both = sorted(p for p, m in routes if {"GET", "POST"} <= m)
    assert set(both) <= R.WORK_GET, sorted(set(both) - R.WORK_GET)
    # OPTIONS is passed on every path because no stock route accepts it (no endpoint runs)
    assert not [p for p, m in routes if "OPTIONS" in m]


def _concrete(path: str) -> str:
    return path.replace("{model:path}", "some-model").replace("{response_id}", "resp_x").replace("{method}", "x")


_EXPECTED_CLASS = {"read", "scheduler_read"}


@pytest.mark.forked
def test_drain_gate_over_every_real_stock_route(tmp_path):
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from dspark_harden.core.patch import Role
    from dspark_harden.lifecycle import drain_routes as R
    from dspark_harden.lifecycle import main
    from dspark_harden.lifecycle import settings as S
    from dspark_harden.lifecycle.feature import shutdown_patches
    from dspark_harden.lifecycle.middleware import MiddlewarePatch

    app = _stock_app()
    add_prometheus_middleware(app)  # stock's /metrics mount, as at launch with --enable-metrics
    reached = []

    class Reached:  # inside the gate: records what got through to stock
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] in ("http", "websocket"):
                reached.append((scope.get("method", "WS"), scope["path"]))
            await self.inner(scope, receive, send)

    app.add_middleware(Reached)
    gate = [p for p in shutdown_patches(Role.MAIN, {S.BARRIER_TIMEOUT_S: 10.0}) if isinstance(p, MiddlewarePatch)]
    assert len(gate) == 1
    gate[0].apply()  # the lifecycle feature's own patch: DrainGate outermost on the real app
    assert gate[0].live_check() is None
    client = TestClient(app, raise_server_exceptions=False)

    cases = []  # (method, concrete path, template)
    for path, methods, _r in _flatten(app.routes):
        for m in sorted(methods):
            cases.append((m, _concrete(path), path))
    cases.append(("GET", "/metrics", "/metrics"))
    cases.append(("GET", "/health_scheduler", "/health_scheduler"))  # the health feature's route (not bound here)
    cases.append(("POST", "/no_such_route", "/no_such_route"))
    cases.append(("GET", "/no_such_route", "/no_such_route"))
    assert len(cases) > 90

    def expect_served(method, template, child_died):
        if method == "OPTIONS" or template in R.ALWAYS_ALLOWED:
            return True
        if method not in ("GET", "HEAD"):
            return False
        cls = R.classify_route(template)
        return cls == "read" or (cls == "scheduler_read" and not child_died)

    saved = (main.MAIN.shutdown_started, main.MAIN.fault)
    try:
        for state in ("draining", "child_died"):
            if state == "draining":
                main.MAIN.shutdown_started, main.MAIN.fault = time.time(), None
                needle = "server is shutting down"
            else:
                main.MAIN.shutdown_started = None
                main.MAIN.fault = {"message": "DP rank 1 scheduler (pid 4242) was killed by SIGKILL", "dp_rank": 1}
                needle = "DP rank 1 scheduler (pid 4242) was killed by SIGKILL"
            wrong = []
            for method, path, template in cases:
                reached.clear()
                r = client.request(method, path, json={} if method in ("POST", "PUT") else None)
                served = expect_served(method, template, state == "child_died")
                gate_503 = r.status_code == 503 and needle in r.text and "ServiceUnavailable" in r.text
                if served and (gate_503 or reached != [(method, path)]):
                    wrong.append(f"{state}: {method} {path} should reach stock, got {r.status_code} {r.text[:80]!r}")
                if not served and (not gate_503 or reached):
                    wrong.append(
                        f"{state}: {method} {path} should get the gate's 503, got {r.status_code} "
                        f"{r.text[:80]!r} (reached stock: {bool(reached)})"
                    )
            assert not wrong, "\n".join(wrong)
            # the 16 GET work routes, explicitly (a method-based gate passes every one of them)
            for p in sorted(R.WORK_GET):
                r = client.get(p)
                assert r.status_code == 503 and needle in r.json()["error"]["message"], (p, r.status_code)
            # a new WebSocket session (/v1/realtime) is refused with the cause (ASGI denial response)
            reached.clear()
            with pytest.raises(WebSocketDenialResponse) as denied:
                with client.websocket_connect("/v1/realtime"):
                    pass
            assert denied.value.status_code == 503 and needle in denied.value.text and not reached
        # serving: the gate passes everything
        main.MAIN.shutdown_started, main.MAIN.fault = None, None
        for method, path in [("GET", "/flush_cache"), ("POST", "/generate"), ("GET", "/ready")]:
            reached.clear()
            client.request(method, path, json={} if method == "POST" else None)
            assert reached == [(method, path)]
    finally:
        main.MAIN.shutdown_started, main.MAIN.fault = saved
        gate[0].revert()


def test_route_path_strips_root_path_like_starlette():
    from dspark_harden.lifecycle import drain_routes as R

    assert R.route_path({"path": "/sglang/metrics", "root_path": "/sglang"}) == "/metrics"
    assert R.route_path({"path": "/sglangx/metrics", "root_path": "/sglang"}) == "/sglangx/metrics"
    assert R.route_path({"path": "/flush_cache"}) == "/flush_cache"
    assert R.served_while_refusing("http", "GET", R.route_path({"path": "/p/v1/models/m", "root_path": "/p"}), False)
    assert not R.served_while_refusing(
        "http", "GET", R.route_path({"path": "/p/flush_cache", "root_path": "/p"}), False
    )
