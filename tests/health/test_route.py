"""GET /health_scheduler registered once on SGLang's real FastAPI app, answering over HTTP.

The route is bound through the feature's own RoutePatch (as the binder does) in a forked child,
and exercised with FastAPI's TestClient (no lifespan: the HTTP global state is set by hand with a
stand-in tokenizer manager that holds a real ShmLoadSnapshotReader; see test_verdict.py).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from sglang.srt.entrypoints import http_server  # noqa: F401 - import once in the parent
from sglang.srt.managers.load_snapshot import LoadSnapshot, ShmLoadSnapshotReader, ShmLoadSnapshotWriter
from sglang.srt.managers.tokenizer_manager import ServerStatus

from dspark_harden.core.settings import Settings
from dspark_harden.health import feature as H


def _settings(**kw):
    values = {H.SWITCH: True, H.MAX_STALENESS: 30.0, H.MAX_FUTURE_SKEW: 5.0}
    values.update(kw)
    return Settings(values=values)


@pytest.mark.forked
def test_route_registered_once_get_only_and_answers(tmp_path):
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints.http_server import app, set_global_state

    patch = H.route_patch(_settings())
    patch.apply()
    patch.apply()  # idempotent
    routes = [r for r in app.router.routes if getattr(r, "path", None) == H.PATH]
    assert len(routes) == 1 and routes[0].methods == {"GET"}
    assert patch.live_check() is None

    client = TestClient(app)
    set_global_state(None)
    r = client.get(H.PATH)
    assert r.status_code == 503 and r.json()["reason"] == "no_state"

    path = str(tmp_path / "loads.shm")
    writers = [ShmLoadSnapshotWriter(path, 2, rank) for rank in range(2)]
    for rank, w in enumerate(writers):
        w.write(LoadSnapshot(timestamp=time.time(), dp_rank=rank))
    tm = SimpleNamespace(
        server_status=ServerStatus.Up,
        gracefully_exit=False,
        load_snapshot_reader=ShmLoadSnapshotReader(path, 2),
        elastic_worker_count=2,
    )
    set_global_state(SimpleNamespace(tokenizer_manager=tm))
    r = client.get(H.PATH)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok" and r.json()["expected_dp_ranks"] == 2
    assert client.post(H.PATH).status_code == 405

    writers[1].write(LoadSnapshot(timestamp=time.time() - 31.0, dp_rank=1))
    r = client.get(H.PATH)
    assert r.status_code == 503 and r.json()["reason"] == "stale" and r.json()["bad_ranks"] == [1]

    tm.server_status = ServerStatus.Starting
    assert client.get(H.PATH).json()["reason"] == "starting"
    tm.server_status, tm.gracefully_exit = ServerStatus.Up, True
    assert client.get(H.PATH).json()["reason"] == "shutting_down"

    patch.revert()
    assert not [r for r in app.router.routes if getattr(r, "path", None) == H.PATH]
    assert client.get(H.PATH).status_code == 404
    patch.apply()
    assert len([r for r in app.router.routes if getattr(r, "path", None) == H.PATH]) == 1


@pytest.mark.forked
def test_thresholds_come_from_settings(tmp_path):
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints.http_server import app, set_global_state

    patch = H.route_patch(_settings(**{H.MAX_STALENESS: 2.0}))
    patch.apply()
    path = str(tmp_path / "loads.shm")
    w = ShmLoadSnapshotWriter(path, 1, 0)
    w.write(LoadSnapshot(timestamp=time.time() - 3.0, dp_rank=0))
    tm = SimpleNamespace(
        server_status=ServerStatus.Up,
        gracefully_exit=False,
        load_snapshot_reader=ShmLoadSnapshotReader(path, 1),
        elastic_worker_count=1,
    )
    set_global_state(SimpleNamespace(tokenizer_manager=tm))
    body = TestClient(app).get(H.PATH).json()
    assert body["reason"] == "stale" and "limit 2 s" in body["message"]


def test_disabled_feature_binds_no_route():
    from dspark_harden.core.patch import Role

    assert H.dspark_patches(role=Role.MAIN, settings=_settings(**{H.SWITCH: False})) == []
    assert H.dspark_patches(role=Role.SCHEDULER, settings=_settings()) == []
    assert len(H.dspark_patches(role=Role.MAIN, settings=_settings())) == 1
