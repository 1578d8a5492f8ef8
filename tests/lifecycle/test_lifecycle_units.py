"""Lifecycle pieces without a server: real processes, real signals, real gloo, real /dev/shm.

* every patch binds on the real sglang 0.5.23 (fingerprints), verifies, reverts to the stock
  object and re-applies (forked);
* the DP controller's monitor against real child processes: SIGKILL, an exception exit, a clean
  shutdown;
* the scheduler's run_event_loop wrap in a real child process (the stand-in here is the loop body,
  a function that raises: a real Scheduler needs a server, see test_server_drills.py);
* the shutdown barrier on a real two-process gloo group, with and without a dead peer;
* the resource tracker against a real process that maps /dev/shm files and binds a unix socket,
  SIGKILLed;
* the drain gate (ASGI middleware) on a real FastAPI app; the health verdict naming a dead rank;
* the detokenizer's shutdown-aware loop on real ZMQ sockets;
* the GC freezer and ``dspark-harden bench gc --json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from dspark_harden.lifecycle import controller, records, resources
from dspark_harden.lifecycle import settings as S
from tests.harness import warm

PY = sys.executable


# -- patches on the real classes -----------------------------------------------------------------


@pytest.mark.forked
def test_every_patch_binds_verifies_and_reverts_on_real_sglang(monkeypatch):
    from dspark_harden.core.manager import feature_settings, make_manager
    from dspark_harden.core.patch import Role, raw_attr, resolve_owner
    from dspark_harden.lifecycle import feature

    env = {S.GATE_CONTROL: "armed", S.STRICT_VMM_SWITCH: "1"}
    pm = make_manager(load_extensions=False)
    seen = set()
    for role in Role:
        specs = {}
        for name in (S.SHUTDOWN, S.GC_FREEZE, S.HICACHE_GATE, S.HOSTPOOL, S.STRICT_VMM):
            specs.update(feature_settings(pm, name, env).values)
        from dspark_harden.core.settings import Settings

        settings = Settings(values=specs)
        patches = feature.dspark_patches(role=role, settings=settings)
        for p in patches:
            owner, attr = (None, None)
            stock = None
            if p.fingerprint:
                owner, attr = resolve_owner(p.target)
                stock = raw_attr(owner, attr)
            p.apply()
            p.apply()  # idempotent
            assert p.live_check() is None, p.key
            if p.fingerprint:
                assert p.found_fingerprint == p.fingerprint, p.target
            p.revert()
            if p.fingerprint:
                assert raw_attr(owner, attr) is stock, p.target
            p.apply()
            assert p.live_check() is None
            p.revert()
            seen.add(p.key)
    assert len(seen) == 19, sorted(seen)  # 19th: Engine.shutdown (the offline Engine path's cleanup)


# -- controller monitor --------------------------------------------------------------------------


def _sleeper(seconds):
    time.sleep(seconds)


def _exit_with(code):
    os._exit(code)


def _procs(n, target, args):
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=target, args=args, daemon=True) for _ in range(n)]
    for p in ps:
        p.start()
    return ps


def test_controller_records_a_sigkilled_scheduler_and_stops_its_peers(tmp_path):
    procs = _procs(2, _sleeper, (60,))
    for i, p in enumerate(procs):
        records.write(str(tmp_path), "rank", p.pid, {"dp_rank": i, "tp_rank": i})
    codes = []
    os.kill(procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    controller.monitor(procs, str(tmp_path), exit_fn=codes.append)
    assert codes == [controller.SCHEDULER_DIED_EXIT]
    assert time.monotonic() - t0 < 10
    death = records.read(str(tmp_path), "death")
    assert death[procs[1].pid]["exitcode"] == -signal.SIGKILL and death[procs[1].pid]["dp_rank"] == 1
    assert not procs[0].is_alive()  # the peer was stopped


def test_controller_names_an_exception_exit(tmp_path, caplog):
    procs = _procs(1, _exit_with, (1,))
    records.write(str(tmp_path), "rank", procs[0].pid, {"dp_rank": 1, "tp_rank": 1})
    records.write(str(tmp_path), "fault", procs[0].pid, {"type": "RuntimeError", "message": "boom"})
    codes = []
    with caplog.at_level("ERROR", logger="dspark_harden.lifecycle"):
        controller.monitor(procs, str(tmp_path), exit_fn=codes.append)
    assert codes == [3]
    assert (
        "DP rank 1 scheduler" in caplog.text
        and "exited with code 1" in caplog.text
        and "RuntimeError: boom" in caplog.text
    )


def test_controller_exits_0_when_every_scheduler_shut_down(tmp_path):
    procs = _procs(2, _exit_with, (0,))
    for p in procs:
        records.write(str(tmp_path), "shutdown", p.pid, {})
    codes = []
    controller.monitor(procs, str(tmp_path), exit_fn=codes.append)
    assert codes == [0]


def test_controller_calls_an_unrequested_exit_0_a_death(tmp_path):
    procs = _procs(1, _exit_with, (0,))
    codes = []
    controller.monitor(procs, str(tmp_path), exit_fn=codes.append)
    assert codes == [3]


def test_controller_of_prelaunched_schedulers_exits_0_only_after_shutdown(tmp_path):
    """Under DP attention the main process owns the schedulers; the controller watches their pids."""
    procs = _procs(2, _exit_with, (0,))
    for p in procs:
        p.join(10)  # reaped by us (their parent), like the main process would
        records.write(str(tmp_path), "shutdown", p.pid, {})
    codes = []
    controller.monitor_pids([p.pid for p in procs], str(tmp_path), exit_fn=codes.append)
    assert codes == [0]
    died = _procs(1, _sleeper, (60,))
    os.kill(died[0].pid, signal.SIGKILL)
    codes = []
    controller.monitor_pids([died[0].pid], str(tmp_path / "other"), exit_fn=codes.append)
    assert codes == []  # a death is the main process's to report


# -- scheduler event-loop wrap in a real process ---------------------------------------------------

_CHILD_LOOP = r"""
import os, sys
from dspark_harden.lifecycle import scheduler
def loop(self):
    raise ValueError("the loop body failed")
wrapped = scheduler.build_run_event_loop(loop)
wrapped(object())
"""


def test_event_loop_exception_is_recorded_and_exits_1(tmp_path):
    env = {**os.environ, records.RUN_DIR_ENV: str(tmp_path)}
    proc = warm.run([PY, "-c", _CHILD_LOOP], env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    fault = list(records.read(str(tmp_path), "fault").values())
    assert fault and fault[0]["type"] == "ValueError" and fault[0]["message"] == "the loop body failed"
    assert "Traceback" in fault[0]["traceback"]


# -- the shutdown barrier on real gloo -------------------------------------------------------------


def _barrier_rank(rank, store_path, timeout_s, skip, out):
    import datetime

    import torch.distributed as dist

    from dspark_harden.lifecycle.scheduler import shutdown_barrier

    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    if rank == 1 and skip:
        time.sleep(timeout_s + 3)  # alive but never arrives, like a peer stuck or dying
        out.put((rank, "absent", 0.0))
        return
    t0 = time.monotonic()
    result = shutdown_barrier(timeout_s, group=dist.group.WORLD)
    out.put((rank, result, time.monotonic() - t0))


@pytest.mark.parametrize("peer_absent", [False, True])
def test_shutdown_barrier_passes_and_never_hangs_on_an_absent_peer(tmp_path, peer_absent):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = tmp_path / "store"
    ps = [ctx.Process(target=_barrier_rank, args=(r, str(store), 2.0, peer_absent, out)) for r in (0, 1)]
    for p in ps:
        p.start()
    got = {}
    for _ in range(2):
        rank, result, dt = out.get(timeout=120)
        got[rank] = (result, dt)
    for p in ps:
        p.join(30)
    if not peer_absent:
        assert got[0][0].startswith("passed (2 ranks") and got[1][0].startswith("passed (2 ranks"), got
    else:
        assert got[0][0] == "timeout" and got[0][1] < 10, got


# -- resource tracker --------------------------------------------------------------------------------

_CHILD_RES = r"""
import _multiprocessing, mmap, os, socket, sys, time
shm, sock = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:  # a named POSIX semaphore, as multiprocessing makes them (sem.mp-*), no tracker
    sem = _multiprocessing.SemLock(1, 1, 1, sys.argv[3], False)
fd = os.open(shm, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sock)
s.listen()
print("ready", flush=True)
time.sleep(120)
"""


def test_tracker_removes_what_a_killed_process_left_and_keeps_what_is_in_use(tmp_path):
    tag = f"dspark-test-{os.getpid()}-{time.time_ns()}"
    shm = f"/dev/shm/{tag}-left"
    shared = f"/dev/shm/{tag}-shared"
    sock = str(tmp_path / "ipc.sock")
    sem_name = f"/{tag}-sem"
    sem = f"/dev/shm/sem.{tag}-sem"
    child = subprocess.Popen([PY, "-c", _CHILD_RES, shm, sock, sem_name], stdout=subprocess.PIPE, text=True)
    # another live process outside the tree maps a second segment -> must be kept
    other = subprocess.Popen(
        [PY, "-c", _CHILD_RES, shared, str(tmp_path / "other.sock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert other.stdout.readline().strip() == "ready"
        tracker = resources.ResourceTracker(root=child.pid)
        tracker.scan()
        assert shm in tracker.shm and sock in tracker.sockets
        assert sem in tracker.shm, "a semaphore is mapped under sem_open's unlinked temporary name: found by inode"
        tracker.add_paths(shm=[shared])
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert os.path.exists(shm) and os.path.exists(sock)  # SIGKILL unlinks nothing
        result = resources.remove_leftovers(tracker)
        assert shm in result["removed"] and sock in result["removed"] and sem in result["removed"], result
        assert shared in result["kept"], result
        assert not os.path.exists(shm) and not os.path.exists(sock) and os.path.exists(shared)
    finally:
        other.kill()
        other.wait(10)
        for p in (shm, shared, sem, str(tmp_path / "other.sock")):
            if os.path.exists(p):
                os.unlink(p)
        if child.poll() is None:
            child.kill()


# -- records -> cause ---------------------------------------------------------------------------------


def test_cause_names_the_rank_and_how_it_died(tmp_path):
    from dspark_harden.lifecycle.main import MainLifecycle

    m = MainLifecycle()
    m.run_dir = str(tmp_path)
    records.write(m.run_dir, "rank", 110, {"dp_rank": 0, "tp_rank": 0})
    records.write(m.run_dir, "rank", 111, {"dp_rank": 1, "tp_rank": 1})
    # DP attention: the main process is the schedulers' parent. DP1 was SIGKILLed; DP0's loop then
    # failed on the dead peer (a secondary fault) -- both are dead when the watchdog looks
    records.write(
        m.run_dir, "fault", 110, {"type": "RuntimeError", "message": "Connection closed by peer", "secondary": True}
    )
    cause = m.cause_of([("scheduler_1", 110, 1), ("scheduler_2", 111, -9)])
    assert cause["role"] == "scheduler" and cause["dp_rank"] == 1
    assert cause["message"] == "DP rank 1 scheduler (pid 111) was killed by SIGKILL"
    # an exception in DP1's own loop is the cause even when DP0 died too
    records.write(m.run_dir, "fault", 111, {"type": "RuntimeError", "message": "boom"})
    assert m.cause_of([("scheduler_1", 110, 1), ("scheduler_2", 111, 1)])["message"] == (
        "DP rank 1 scheduler (pid 111) exited with code 1 after its event loop raised RuntimeError: boom"
    )
    # a controller that owns its schedulers recorded the death, then exited 3
    own = MainLifecycle()
    own.run_dir = str(tmp_path / "own")
    records.write(own.run_dir, "death", 222, {"exitcode": -9, "dp_rank": 1, "tp_rank": 1})
    assert own.cause_of([("scheduler_0", 99, 3)])["message"] == "DP rank 1 scheduler (pid 222) was killed by SIGKILL"
    empty = MainLifecycle()
    empty.run_dir = str(tmp_path / "none")
    assert empty.cause_of([("detokenizer", 5, -9)])["message"] == "detokenizer (pid 5) was killed by SIGKILL"
    assert empty.cause_of([("scheduler_0", 6, 1)]) == {
        "role": "controller",
        "who": "DP controller",
        "pid": 6,
        "exitcode": 1,
        "dp_rank": None,
        "message": "DP controller (pid 6) exited with code 1",
    }


def test_health_verdict_names_the_dead_rank():
    from dspark_harden.health import verdict as V

    class TM:
        gracefully_exit = True
        dspark_harden_fault = {"message": "DP rank 1 scheduler (pid 7) was killed by SIGKILL", "dp_rank": 1}

    v = V.evaluate_server(TM(), now_fn=time.time, max_staleness_s=30, max_future_skew_s=5)
    assert v.status_code == 503 and v.reason == V.CHILD_DIED and v.bad_ranks == [1]
    assert "DP rank 1 scheduler (pid 7) was killed by SIGKILL" in v.message


# -- drain gate on a real ASGI app ---------------------------------------------------------------------


def test_drain_gate_refuses_new_work_but_serves_reads_and_aborts():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from dspark_harden.lifecycle import main

    app = FastAPI()

    @app.post("/generate")
    def gen():
        return {"ok": True}

    @app.post("/abort_request")
    def abort():
        return {"ok": True}

    @app.get("/metrics")
    def m():
        return {"ok": True}

    app.add_middleware(main.DrainGate)
    client = TestClient(app)
    saved = (main.MAIN.shutdown_started, main.MAIN.fault)
    try:
        assert client.post("/generate").status_code == 200
        main.MAIN.shutdown_started = time.time()
        r = client.post("/generate")
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert client.post("/abort_request").status_code == 200
        assert client.get("/metrics").status_code == 200
        main.MAIN.shutdown_started, main.MAIN.fault = (
            None,
            {"message": "DP rank 1 scheduler (pid 1) was killed by SIGKILL"},
        )
        r = client.post("/generate")
        assert r.status_code == 503 and "DP rank 1 scheduler" in r.text
    finally:
        main.MAIN.shutdown_started, main.MAIN.fault = saved


def test_middleware_patch_round_trip_on_a_fastapi_app(monkeypatch):
    import types

    from fastapi import FastAPI

    from dspark_harden.core.patch import Kind, Role
    from dspark_harden.lifecycle.main import DrainGate
    from dspark_harden.lifecycle.middleware import MiddlewarePatch

    mod = types.ModuleType("dspark_test_app_mod")
    mod.app = FastAPI()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    p = MiddlewarePatch(
        feature=S.SHUTDOWN,
        target=f"{mod.__name__}:app",
        kind=Kind.ROUTE,
        roles={Role.MAIN},
        build=lambda _s: DrainGate,
        fingerprint=None,
        why="t",
        retire_when="t",
    )
    p.apply()
    p.apply()
    assert p.live_check() is None
    p.revert()
    assert not [m for m in mod.app.user_middleware if m.cls is DrainGate]
    p.apply()
    assert p.live_check() is None


# -- detokenizer loop on real ZMQ ---------------------------------------------------------------------


def test_detokenizer_loop_leaves_on_shutdown_and_still_dispatches(tmp_path):
    import zmq
    from sglang.srt.managers.io_struct import ConfigureLoggingReq, ShutdownReq, sock_send
    from sglang.utils import TypeBasedDispatcher

    from dspark_harden.lifecycle.scheduler import build_detokenizer_event_loop

    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/detok"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(addr)
    push.connect(addr)
    handled = []

    class Watch:
        def disable(self):
            import contextlib

            return contextlib.nullcontext()

        def feed(self):
            pass

    class Detok:
        recv_from_scheduler = pull
        send_to_tokenizer = None
        soft_watchdog = Watch()
        _request_dispatcher = TypeBasedDispatcher([(ConfigureLoggingReq, lambda r: handled.append(r) or None)])

    sock_send(push, ConfigureLoggingReq(log_level="info"))
    sock_send(push, ShutdownReq())
    t0 = time.monotonic()
    build_detokenizer_event_loop(None)(Detok())
    assert time.monotonic() - t0 < 5 and len(handled) == 1
    pull.close(0)
    push.close(0)
    ctx.term()


# -- GC ------------------------------------------------------------------------------------------------


@pytest.mark.forked
def test_freezer_measures_pauses_and_freezes_after_warmup():
    import gc

    from dspark_harden.lifecycle.gc_freeze import GcFreezer, summarize

    f = GcFreezer()
    f.after_batches = 3
    f.recorder.install()
    junk = [[{} for _ in range(10)] for _ in range(20000)]
    gc.collect()
    batches = [0]
    f.watch(lambda: batches[0])
    time.sleep(0.6)
    assert gc.get_freeze_count() == 0  # not warmed up yet
    batches[0] = 3
    deadline = time.monotonic() + 10
    while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f.frozen_objects > 200000 and gc.get_freeze_count() > 0.99 * f.frozen_objects
    pauses = f.recorder.drain()
    s = summarize(pauses)
    assert s["gen2_pauses"] >= 2 and s["max_ms"] > 0
    assert any(p[2] is False for p in pauses) and f.recorder.frozen
    del junk
    gc.unfreeze()


def test_bench_gc_json_shape_and_effect():
    proc = warm.run(
        [PY, "-m", "dspark_harden", "bench", "gc", "--json", "--objects", "400000", "--seconds", "1.5"], timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    for phase in ("unfrozen", "stock", "plugin"):
        assert isinstance(out[phase]["gen2_pauses"], int)
        assert isinstance(out[phase]["p99_ms"], float) and isinstance(out[phase]["max_ms"], float)
    assert out["tracked_objects"] >= 400000
    assert isinstance(out["frozen_objects"], int) and out["frozen_objects"] >= 400000
    assert out["stock_frozen_objects"] >= 400000  # stock's own freeze_gc ran (sglang.srt.utils.common)
    assert out["unfrozen"]["gen2_pauses"] > 0
    # the freezer's pacer (gc_freeze.Gen2Pacer): after the plugin's freeze no more full collections per serving
    # step than with no freeze or with stock's freeze (counts, allocation-driven; tests/lifecycle/test_gc_pacer.py
    # has the deterministic ones)
    assert out["plugin"]["gen2_per_kstep"] <= out["unfrozen"]["gen2_per_kstep"], out
    assert out["plugin"]["gen2_per_kstep"] <= out["stock"]["gen2_per_kstep"], out
    # The effect, deterministically: a frozen heap leaves what a gen-2 collection traverses (a
    # mutation check: without gc.freeze() in the bench both counts hold the heap and this fails).
    # The pause times themselves are the bench's report, not an assertion: on a loaded 2-core host
    # the p50 ratio was measured at 2.7-3.5x, so a timed bound here failed CI (docs/lifecycle.md).
    assert out["unfrozen"]["gen2_objects"] >= 400000, out
    for frozen in ("stock", "plugin"):
        assert out[frozen]["gen2_objects"] <= out["unfrozen"]["gen2_objects"] - 400000, out


@pytest.mark.forked
@pytest.mark.parametrize("owns", [True, False])
def test_only_a_process_the_server_owns_becomes_a_subreaper(owns, tmp_path, monkeypatch):
    """Issue 39: launch_server / ``sglang serve`` own their main process and adopt the tree's orphans
    (PR_SET_CHILD_SUBREAPER); an offline ``sglang.Engine`` runs in the caller's own process, which must
    not become a subreaper (it never reaps adopted orphans). The role detection that feeds ``owns_process``
    is core.roles (main_entry): tests/plugin/test_roles.py."""
    from dspark_harden.lifecycle import proctree
    from dspark_harden.lifecycle.main import MainLifecycle

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert not proctree.is_subreaper()  # a forked pytest worker starts as none
    life = MainLifecycle()
    life.configure(drain_s=1.0, death_grace_s=1.0, barrier_timeout_s=1.0, owns_process=owns)
    assert life.subreaper is owns and proctree.is_subreaper() is owns
