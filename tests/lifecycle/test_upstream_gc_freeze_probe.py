"""Issue 41 item 5: the upstream probe ``stock-gc-freeze-after-warmup`` (dspark_harden.upstream) sees stock
0.5.23's freeze after server warm-up (``http_server._wait_and_warmup`` -> ``_freeze_gc_after_server_warmup``
-> ``POST /freeze_gc`` -> ``TokenizerManager.freeze_gc`` / ``Scheduler.handle_freeze_gc`` -> ``gc.freeze()``),
and turns red when a release drops any link. Each mutation patches SGLang, so each runs forked."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from dspark_harden import upstream as U


def _mutant(owner, name: str, old: str, new: str):
    """``owner.name`` compiled from its own source with ``old`` replaced by ``new``, in its module."""
    stock = inspect.getattr_static(owner, name)
    src = textwrap.dedent(inspect.getsource(stock))
    src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("@"))
    assert src.count(old) == 1, f"{name} no longer contains {old!r}"
    ns: dict = {}
    module = inspect.getmodule(stock)
    exec(compile(src.replace(old, new), inspect.getsourcefile(stock), "exec"), vars(module), ns)  # noqa: S102
    return ns[name]


def test_probe_passes_on_stock_and_is_wired():
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert present, detail
    feat = next(f for f in U.UPSTREAM if f.name == "stock-gc-freeze-after-warmup")
    assert feat.upstream_probe is U._probe_gc_freeze_after_server_warmup and feat.area == "lifecycle"


@pytest.mark.forked
def test_red_when_the_warmup_thread_no_longer_freezes(monkeypatch):
    from sglang.srt.entrypoints import http_server as H

    monkeypatch.setattr(
        H,
        "_wait_and_warmup",
        _mutant(H, "_wait_and_warmup", "    _freeze_gc_after_server_warmup(server_args)\n", "\n"),
    )
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert not present and "no longer freezes the GC after server warm-up" in detail, detail


@pytest.mark.forked
def test_red_when_the_freeze_request_is_gone(monkeypatch):
    from sglang.srt.entrypoints import http_server as H

    monkeypatch.setattr(H, "_freeze_gc_after_server_warmup", lambda server_args: None)
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert not present and "expected one POST /freeze_gc" in detail, detail


@pytest.mark.forked
def test_red_when_the_route_is_gone(monkeypatch):
    from sglang.srt.entrypoints import http_server as H

    routes = [r for r in H.app.router.routes if getattr(r, "path", None) != "/freeze_gc"]
    monkeypatch.setattr(H.app.router, "routes", routes)
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert not present and "0 POST /freeze_gc routes" in detail, detail


@pytest.mark.forked
def test_red_when_stock_freeze_gc_no_longer_freezes(monkeypatch):
    from sglang.srt.utils import common as C

    monkeypatch.setattr(C, "freeze_gc", _mutant(C, "freeze_gc", "    gc.freeze()\n", "    pass\n"))
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert not present and "TokenizerManager.freeze_gc: gc.freeze() ran 0 times" in detail, detail


@pytest.mark.forked
def test_red_when_the_scheduler_is_not_told(monkeypatch):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    monkeypatch.setattr(
        TokenizerManager,
        "freeze_gc",
        _mutant(
            TokenizerManager,
            "freeze_gc",
            "self._dispatch_to_scheduler(FreezeGCReq(gc_threshold=gc_threshold))",
            "pass",
        ),
    )
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert not present and "dispatched []" in detail, detail


@pytest.mark.forked
def test_red_when_the_scheduler_does_not_forward_to_the_detokenizer(monkeypatch):
    from sglang.srt.managers.scheduler import Scheduler

    monkeypatch.setattr(
        Scheduler,
        "handle_freeze_gc",
        _mutant(
            Scheduler,
            "handle_freeze_gc",
            "self.ipc_channels.send_to_detokenizer.send_output(recv_req, recv_req)",
            "pass",
        ),
    )
    present, detail = U._probe_gc_freeze_after_server_warmup()
    assert not present and "forwarded 0 requests to the detokenizer" in detail, detail
