"""DP controller dispatch with real ZMQ: the real ``DataParallelController`` class (built without
schedulers by :mod:`dspark_harden.ingress.harness`, see its docstring for the stand-ins), real
``init_dispatcher``, real IPC sockets, real ``TokenizedGenerateReqInput`` /
``BatchTokenizedGenerateReqInput`` messages. Every test that binds a patch runs forked.
"""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
from sglang.srt.managers import data_parallel_controller as dpc  # noqa: F401 - import once (forks start warm)
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchTokenizedGenerateReqInput,
    TokenizedGenerateReqInput,
    unwrap_from_pickle,
)
from sglang.srt.observability.req_time_stats import DPControllerReqTimeStats

from dspark_harden.core.patch import Role
from dspark_harden.core.settings import Settings
from dspark_harden.ingress import controller as C
from dspark_harden.ingress import feature as F
from dspark_harden.ingress.harness import Endpoints, Peer, build_controller, close_controller, make_batch, make_request


def bind(atomic=True, loop=True, poll_ms=100, spin_us=F.DEFAULT_SPIN_US):
    settings = Settings(values={F.ATOMIC_SWITCH: atomic, F.LOOP_SWITCH: loop, F.POLL_MS: poll_ms, F.SPIN_US: spin_us})
    bound = F.patches(Role.CONTROLLER, settings)
    for p in bound:
        p.apply()
    return bound


def rig(_tmp_path, dp=2, **kw):
    # a short private directory (AF_UNIX paths are limited to ~107 bytes; pytest's are long)
    eps = Endpoints.new(dp, tempfile.mkdtemp(prefix="dpc-"))
    ctrl = build_controller(eps, dp_size=dp, **kw)
    peer = Peer(eps).open()
    _KEEP.append((ctrl, peer))  # never left to the GC mid-test (zmq term() could block)
    time.sleep(0.2)  # let the IPC connections establish
    return ctrl, peer


_KEEP: list = []


def close(ctrl, peer):
    close_controller(ctrl)
    peer.close()


def drain(peer, timeout_ms=500):
    """All messages that arrive until ``timeout_ms`` of silence: list of (who, msg)."""
    out = []
    while True:
        got = peer.recv_any(timeout_ms)
        if got is None:
            return out
        out.append(got)


def run_loop(ctrl):
    threading.Thread(target=ctrl.event_loop, daemon=True).start()


# ---------------------------------------------------------------------------------------------


@pytest.mark.forked
def test_stock_sends_a_routed_batch_item_by_item_ours_sends_one_message(tmp_path):
    rids = [f"r{i}" for i in range(64)]
    # stock, same inputs
    ctrl, peer = rig(tmp_path / "stock")
    ctrl.dispatch_batch_generate(make_batch(rids, [1] * 64))
    stock = drain(peer)
    assert [who for who, _ in stock] == [1] * 64
    assert all(isinstance(m, TokenizedGenerateReqInput) for _, m in stock)
    close(ctrl, peer)

    bind()
    ctrl, peer = rig(tmp_path / "ours")
    batch = make_batch(rids, [1] * 64)
    ctrl.dispatch_batch_generate(batch)
    ours = drain(peer)
    assert len(ours) == 1, f"expected ONE message, got {len(ours)}"
    who, msg = ours[0]
    assert who == 1 and isinstance(msg, BatchTokenizedGenerateReqInput)
    assert [r.rid for r in msg.batch] == rids == [r.rid for _, r in stock]  # same requests, same order
    # per-item time stats: converted to DPControllerReqTimeStats on the wire like stock ...
    assert all(isinstance(unwrap_from_pickle(r.time_stats), DPControllerReqTimeStats) for r in msg.batch)
    # ... and stamped in the controller: dispatch time before the send, finish time after
    for item in batch.batch:
        ts = item.time_stats
        assert isinstance(ts, DPControllerReqTimeStats)
        assert ts.dpc_dispatch_time > 0 and ts.dpc_dispatch_finish_time >= ts.dpc_dispatch_time
    from dspark_harden.core import metrics

    assert metrics.get("dspark_harden_atomic_batches_total").labels("1")._value.get() == 1
    assert metrics.get("dspark_harden_atomic_batch_requests").labels("1")._sum.get() == 64


@pytest.mark.forked
def test_mixed_and_unrouted_batches_keep_stock_per_request_dispatch(tmp_path):
    bind()
    ctrl, peer = rig(tmp_path)
    fallback_calls = []
    stock_single = dpc.DataParallelController.dispatching_with_trace

    def spy(self, req, refresh_load_budget=True):
        fallback_calls.append(req.rid)
        return stock_single(self, req, refresh_load_budget)

    dpc.DataParallelController.dispatching_with_trace = spy
    ctrl.dispatch_batch_generate(make_batch(["a", "b", "c", "d"], [0, 1, 1, 0]))
    mixed = drain(peer)
    assert sorted((who, m.rid) for who, m in mixed) == [(0, "a"), (0, "d"), (1, "b"), (1, "c")]
    assert all(isinstance(m, TokenizedGenerateReqInput) for _, m in mixed)
    assert fallback_calls == ["a", "b", "c", "d"]

    fallback_calls.clear()
    ctrl.dispatch_batch_generate(make_batch(["e", "f", "g", "h"], [None] * 4))
    unrouted = drain(peer)
    assert len(unrouted) == 4 and {who for who, _ in unrouted} == {0, 1}  # round robin
    assert fallback_calls == ["e", "f", "g", "h"]


@pytest.mark.forked
def test_stock_raises_on_bad_rank_which_kills_the_server(tmp_path):
    ctrl, peer = rig(tmp_path)
    with pytest.raises(ValueError, match="DP rank 7 is not active"):
        ctrl.dispatch_batch_generate(make_batch(["x", "y"], [7, 7]))
    # (in run_data_parallel_controller_process this exception SIGQUITs the whole server)


@pytest.mark.forked
def test_bad_rank_batch_gets_per_request_400_and_loop_keeps_serving(tmp_path):
    bind()
    ctrl, peer = rig(tmp_path)
    run_loop(ctrl)
    peer.send(make_batch([f"bad{i}" for i in range(8)], [7] * 8))
    got = drain(peer)
    assert {who for who, _ in got} == {"tokenizer"} and len(got) == 8
    for _, abort in got:
        assert isinstance(abort, AbortReq)
        assert abort.finished_reason["status_code"] == 400
        assert abort.finished_reason["type"] == "abort"
        assert "DP rank 7 is not active" in abort.finished_reason["message"]
        assert "out of range" in abort.finished_reason["message"]
    assert sorted(a.rid for _, a in got) == sorted(f"bad{i}" for i in range(8))
    # the controller is still serving: a routed batch and a single request go through
    peer.send(make_batch(["ok0", "ok1"], [0, 0]))
    peer.send(make_request("single", routed_dp_rank=1))
    after = drain(peer)
    assert sorted((who, type(m).__name__) for who, m in after) == [
        (0, "BatchTokenizedGenerateReqInput"),
        (1, "TokenizedGenerateReqInput"),
    ]
    from dspark_harden.core import metrics

    assert metrics.get("dspark_harden_route_rejections_total").labels("out_of_range")._value.get() == 8


@pytest.mark.forked
def test_inactive_rank_and_single_requests_are_rejected_not_fatal(tmp_path):
    bind()
    ctrl, peer = rig(tmp_path, active=[True, False])
    run_loop(ctrl)
    peer.send(make_batch(["i0", "i1"], [1, 1]))
    peer.send(make_request("s-bad", routed_dp_rank=1))
    peer.send(make_request("s-neg", routed_dp_rank=-1))
    got = drain(peer)
    assert all(who == "tokenizer" for who, _ in got) and len(got) == 4
    msgs = {a.rid: a.finished_reason["message"] for _, a in got}
    assert "marked inactive" in msgs["i0"] and "marked inactive" in msgs["s-bad"]
    assert "out of range" in msgs["s-neg"]
    ctrl.workers[0] = None  # a rank without a socket
    ctrl._active_workers = [0]
    assert C.route_problem(ctrl, 0)[0] == C.NO_SOCKET


@pytest.mark.forked
def test_uniform_batch_with_health_check_uses_stock(tmp_path):
    from sglang.srt.managers.utils import HEALTH_CHECK_RID_PREFIX

    bind()
    ctrl, peer = rig(tmp_path)
    ctrl.dispatch_batch_generate(make_batch([f"{HEALTH_CHECK_RID_PREFIX}_1", "u"], [1, 1]))
    got = drain(peer)
    assert all(isinstance(m, TokenizedGenerateReqInput) for _, m in got) and len(got) == 2


@pytest.mark.forked
def test_blocking_loop_dispatches_and_feeds_the_watchdog_while_idle(tmp_path):
    bind(atomic=False, loop=True, poll_ms=100)
    ctrl, peer = rig(tmp_path, watchdog_timeout=0.4)
    assert C.effective_poll_ms(ctrl, 100) == 100
    assert C.effective_poll_ms(ctrl, 1000) == 100  # a quarter of the 0.4 s watchdog
    run_loop(ctrl)
    peer.send(make_request("first"))
    assert peer.recv_any(5000)[1].rid == "first"
    time.sleep(0.05)  # past the busy-poll window after the message (2 ms by default)
    c0 = ctrl.soft_watchdog._counter
    time.sleep(1.0)
    fed = ctrl.soft_watchdog._counter - c0
    # blocked in poll (at most ~1 s / 100 ms wakeups), yet fed: the stock loop feeds on every spin
    assert 1 <= fed <= 50, fed
    peer.send(make_request("second"))
    assert peer.recv_any(5000)[1].rid == "second"


@pytest.mark.forked
def test_loop_busy_polls_only_for_the_window_after_a_message(tmp_path):
    """After a message the loop keeps polling like stock (one feed per attempt) for SPIN_US, so a
    follow-up is picked up without a wake-up; then it blocks again (a few feeds per second)."""
    bind(atomic=False, loop=True, poll_ms=100, spin_us=400_000)
    ctrl, peer = rig(tmp_path, watchdog_timeout=0.4)
    run_loop(ctrl)
    peer.send(make_request("first"))
    assert peer.recv_any(5000)[1].rid == "first"
    c0 = ctrl.soft_watchdog._counter
    time.sleep(0.15)  # inside the 0.4 s window: spinning
    spinning = ctrl.soft_watchdog._counter - c0
    time.sleep(0.5)  # the window has passed
    c1 = ctrl.soft_watchdog._counter
    time.sleep(0.5)
    blocked = ctrl.soft_watchdog._counter - c1
    assert spinning > 1000 and blocked <= 25, (spinning, blocked)
    peer.send(make_request("second"))  # and it still wakes for the next one
    assert peer.recv_any(5000)[1].rid == "second"


@pytest.mark.forked
def test_stock_loop_spins(tmp_path):
    """The defect the blocking loop removes, shown on the stock loop with the same rig."""
    ctrl, peer = rig(tmp_path, watchdog_timeout=0.4)
    run_loop(ctrl)
    peer.send(make_request("first"))
    assert peer.recv_any(5000)[1].rid == "first"
    c0 = ctrl.soft_watchdog._counter
    time.sleep(1.0)
    assert ctrl.soft_watchdog._counter - c0 > 1000  # one feed per empty spin


def test_uniform_rank_and_route_problem_are_strict():
    assert C.uniform_rank([]) is None
    assert C.uniform_rank([make_request("a", routed_dp_rank=1), make_request("b", routed_dp_rank=1)]) == 1
    assert C.uniform_rank([make_request("a", routed_dp_rank=1), make_request("b", routed_dp_rank=0)]) is None
    assert C.uniform_rank([make_request("a"), make_request("b")]) is None
    assert C.uniform_rank([make_request("a", routed_dp_rank=0), make_request("b")]) is None
