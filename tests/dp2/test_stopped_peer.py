"""Issue 21 item 7: a DP2 peer that is alive but never arrives (stopped, traced, wedged in the kernel).

Real processes (tests/dp2/peer.py), real shared memory and futexes, real SIGSTOP / ptrace stops. A
peer whose process stays in state T / t / D longer than ``peer_stop_ms`` fails both ranks like a dead
one (code ``peer_died``, published); until then each stall period names the peer's process state; a
peer stopped for less than the limit just completes late. The waiting rank also publishes the stall
on the health board (dp2/board.py), which another process reads through /proc.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dspark_harden.core import procfs
from dspark_harden.dp2 import board as B
from dspark_harden.dp2 import native
from dspark_harden.dp2.channels import Dp2Runtime
from dspark_harden.dp2.native import Dp2Error
from tests.dp2.test_faults import Peer, W, _open, _session, no_shm_leftovers  # noqa: F401 - autouse fixture


def _state(pid: int) -> str:
    return procfs.stat(pid).state


def _wait_state(pid: int, want: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _state(pid) != want:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {want} (is {_state(pid)})"
        time.sleep(0.01)


def test_stopped_peer_fails_both_ranks_like_a_dead_one():
    s = _session()
    stalls = []
    # (hard limit far above the stop limit: without the stop check this fails as a timeout, never hangs)
    ch = _open(
        s, timeout_ms=300, hard_timeout_ms=30000, peer_stop_ms=1500, on_stall=lambda msg, waited: stalls.append(msg)
    )
    peer = Peer("exchange-then-late", s, 1, 3, 4.0, timeout_ms=300)
    try:
        assert peer.event()["event"] == "opened"
        for i in range(3):
            ch.exchange([i] * W)
        assert peer.event()["event"] == "ready"  # now sleeping 4 s before its next exchange
        os.kill(peer.proc.pid, signal.SIGSTOP)
        _wait_state(peer.proc.pid, "T")
        t0 = time.monotonic()
        with pytest.raises(
            Dp2Error,
            match=r"peer died: rank 1 pid \d+ is stopped \(state T\) for 1\.\d s, longer "
            r"than the limit of 1500 ms \(SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS\)",
        ) as info:
            ch.exchange([9] * W)
        elapsed = time.monotonic() - t0
        assert info.value.name == "peer_died"
        assert 1.4 <= elapsed < 25.0, elapsed  # the stop limit, not the hard timeout
        # every stall period before it named the peer's state
        assert stalls and all("process state T: stopped" in m for m in stalls), stalls
        assert ch.shared_error() == native.lib.DSPARK_DP2_E_PEER_DIED  # published: the peer stops too
        os.kill(peer.proc.pid, signal.SIGCONT)
        ev = peer.event()
        assert ev["event"] == "error" and ev["code"] == "poisoned", ev
        assert "peer died" in ev["message"] and "is stopped (state T)" in ev["message"], ev
    finally:
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        ch.close()
        peer.finish()


def test_peer_stopped_shorter_than_the_limit_completes_late():
    s = _session()
    stalls = []
    ch = _open(
        s, timeout_ms=200, hard_timeout_ms=0, peer_stop_ms=20000, on_stall=lambda msg, waited: stalls.append(msg)
    )
    peer = Peer("exchange-then-late", s, 1, 2, 0.2, timeout_ms=200)
    try:
        assert peer.event()["event"] == "opened"
        for i in range(2):
            ch.exchange([i] * W)
        assert peer.event()["event"] == "ready"
        os.kill(peer.proc.pid, signal.SIGSTOP)
        _wait_state(peer.proc.pid, "T")
        cont = subprocess.Popen(
            [sys.executable, "-c", f"import os,signal,time; time.sleep(1.0); os.kill({peer.proc.pid}, signal.SIGCONT)"]
        )
        assert ch.exchange([5] * W) == [5] * W + [1002] * W
        cont.wait(timeout=30)
        assert any("process state T: stopped" in m for m in stalls), stalls
        assert ch.shared_error() == 0
        assert peer.event()["event"] == "late_exchange_done"
    finally:
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        ch.close()
        peer.finish()


def test_zero_disables_the_stop_limit_and_a_negative_one_is_refused():
    s = _session()
    ch = _open(s, timeout_ms=200, hard_timeout_ms=1000, peer_stop_ms=0, on_stall=lambda *a: None)
    peer = Peer("exchange-then-late", s, 1, 1, 3.0, timeout_ms=200)
    try:
        assert peer.event()["event"] == "opened"
        ch.exchange([0] * W)
        assert peer.event()["event"] == "ready"
        os.kill(peer.proc.pid, signal.SIGSTOP)
        _wait_state(peer.proc.pid, "T")
        with pytest.raises(Dp2Error, match="hard limit of 1000 ms") as info:  # a stall like any other
            ch.exchange([0] * W)
        assert info.value.name == "timeout"
    finally:
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        ch.close()
        peer.finish()
    with pytest.raises(ValueError, match="peer_stop_ms must be >= 0"):
        _open(_session(), peer_stop_ms=-1)


PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH = 0x4206, 0x4207, 17


def test_traced_peer_counts_as_stopped():
    """A tracer holding the peer in a ptrace stop (state t, e.g. a debugger) is the same as SIGSTOP."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    s = _session()
    ch = _open(s, timeout_ms=300, hard_timeout_ms=30000, peer_stop_ms=1000, on_stall=lambda *a: None)
    peer = Peer("exchange-then-late", s, 1, 1, 5.0, timeout_ms=300)
    pid = peer.proc.pid
    seized = False
    try:
        assert peer.event()["event"] == "opened"
        ch.exchange([0] * W)
        assert peer.event()["event"] == "ready"
        if libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
            pytest.skip(f"ptrace not permitted here: {os.strerror(ctypes.get_errno())}")
        seized = True
        assert libc.ptrace(PTRACE_INTERRUPT, pid, None, None) == 0
        os.waitpid(pid, os.WUNTRACED | getattr(os, "__WALL", 0x40000000))
        assert _state(pid) == "t"
        with pytest.raises(Dp2Error, match=r"is stopped by a tracer \(state t\)") as info:
            ch.exchange([0] * W)
        assert info.value.name == "peer_died"
    finally:
        if seized:
            libc.ptrace(PTRACE_DETACH, pid, None, None)
        ch.close()
        peer.finish()


BOARD_WRITER = r"""
import json, sys
from dspark_harden.dp2 import board as B
b = B.Board.open(sys.argv[1])
b.publish_stall(rank=1, peer_rank=0, channel="mlp", waited_s=3.0, period_s=1.0, message="from the child")
print(json.dumps(b.read()), flush=True)
sys.stdin.readline()  # stay alive (a record of a dead writer is not current)
"""


def test_board_reached_through_proc_and_refused_when_not_ours():
    board = B.Board.create()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", BOARD_WRITER, board.spec], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
        )
        try:
            seen_by_child = json.loads(child.stdout.readline())
            assert [r["message"] for r in seen_by_child] == ["from the child"]
            (rec,) = B.current_stalls(board)
            assert (rec["rank"], rec["peer_rank"], rec["pid"]) == (1, 0, child.pid)
        finally:
            child.stdin.close()
            child.wait(timeout=30)
        assert B.current_stalls(board) == []  # its writer is gone
        board.clear(1)
        assert board.read() == []
        # the spec must name a board of this server: wrong token, mode, malformed
        pid, fd, _tok = board.spec.split(":")
        with pytest.raises(B.BoardError, match="is not this server's: header"):
            B.Board.open(f"{pid}:{fd}:{'0' * 32}")
        os.fchmod(board.fd, 0o644)
        with pytest.raises(B.BoardError, match="is not this server's: mode 0644, expected 0600"):
            B.Board.open(board.spec)
        os.fchmod(board.fd, 0o600)
        with pytest.raises(B.BoardError, match="is not <pid>:<fd>:<32-hex token>"):
            B.Board.open("12:x")
        # another uid cannot even open it (a forked child that setuid()s to nobody)
        r, w = os.pipe()
        kid = os.fork()
        if kid == 0:  # pragma: no cover - child
            os.close(r)
            try:
                os.setgid(65534)
                os.setuid(65534)
                B.Board.open(board.spec)
                os.write(w, b"opened")
            except B.BoardError as exc:
                os.write(w, str(exc).encode()[:400])
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(kid, 0)
        answer = os.read(r, 1000).decode()
        os.close(r)
        assert "cannot be opened" in answer, answer
    finally:
        board.close()


def test_runtime_publishes_a_stopped_peer_on_the_board_and_clears_it(monkeypatch):
    """The waiting rank's loop (not the stuck one) writes 'rank 0 waits for rank 1' each stall period;
    the health verdict turns it into dp2_stalled naming rank 1; the record goes when the exchange ends."""
    from dspark_harden.health import verdict as V

    board = B.Board.create()
    monkeypatch.setattr(B, "CURRENT", board)
    monkeypatch.setenv(B.ENV, board.spec)
    rt = Dp2Runtime()
    s = _session()
    rt.configure(
        session_id=s,
        timeout_ms=300,
        spin_us=50,
        export=False,
        rank=0,
        dp_label="0",
        hard_timeout_ms=30000,
        peer_stop_ms=2500,
    )
    assert rt.board is board
    ch = rt.open("mlp", width=W, digest=7)
    peer = Peer("exchange-then-late", s, 1, 2, 5.0, timeout_ms=300)
    seen = []
    try:
        assert peer.event()["event"] == "opened"
        for i in range(2):
            ch.exchange([i] * W)
        assert peer.event()["event"] == "ready"
        os.kill(peer.proc.pid, signal.SIGSTOP)
        _wait_state(peer.proc.pid, "T")

        def watch():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not ch.closed:
                recs = B.current_stalls(board)
                if recs:
                    seen.append(recs)
                    return
                time.sleep(0.02)

        t = threading.Thread(target=watch)
        t.start()
        with pytest.raises(Dp2Error, match="is stopped"):
            ch.exchange([0] * W)
        t.join()
        assert seen, "the stall never reached the board"
        (rec,) = seen[0]
        assert (rec["rank"], rec["peer_rank"], rec["channel"], rec["pid"]) == (0, 1, "mlp", os.getpid())
        assert "process state T: stopped" in rec["message"]
        v = V.evaluate_dp2_stalls(seen[0])
        assert (v.status_code, v.reason, v.bad_ranks) == (503, V.DP2_STALLED, [1])
        assert v.message.startswith("DP rank 1 stalled") and "DP rank 0 has waited" in v.message
        assert board.read() == []  # cleared when the exchange ended (here: failed)
    finally:
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        rt.close_all()
        peer.finish()
        board.close()


WATCHED_RANK = r"""
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from dspark_harden.dp2.channels import Dp2Runtime
session, stop_ms = sys.argv[1], int(sys.argv[2])
rt = Dp2Runtime()
rt.configure(session_id=session, timeout_ms=300, spin_us=50, export=False, rank=0, dp_label="0", hard_timeout_ms=0,
             peer_stop_ms=stop_ms)
ch = rt.open("mlp", width=11, digest=7)
for i in range(2):
    ch.exchange([i] * 11)
rt.start_watch("mlp")
print(json.dumps({"event": "blocked"}), flush=True)
time.sleep(120)  # blocked outside the exchange, like a scheduler inside stock's gloo control broadcast
print(json.dumps({"event": "not_ended"}), flush=True)
"""


def test_peer_watch_names_and_ends_a_rank_blocked_outside_the_exchange():
    """The scheduler thread is not in the exchange (stock's gloo control broadcast holds it under DP
    attention): the peer watch thread still publishes the stall on the board (naming the stopped peer)
    after one period, then publishes peer_died (the peer fails when it resumes) and, since the blocked
    thread cannot fail on its own, ends the process with a CRITICAL line naming the error."""
    board = B.Board.create()
    s = _session()
    env = dict(os.environ, **{B.ENV: board.spec})
    rank0 = subprocess.Popen(
        [sys.executable, "-c", WATCHED_RANK, s, "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peer = Peer("exchange-then-late", s, 1, 2, 15.0, timeout_ms=300)
    try:
        assert peer.event()["event"] == "opened"
        assert json.loads(rank0.stdout.readline())["event"] == "blocked"
        assert peer.event()["event"] == "ready"
        os.kill(peer.proc.pid, signal.SIGSTOP)
        _wait_state(peer.proc.pid, "T")
        t0 = time.monotonic()
        recs = []
        while not recs and rank0.poll() is None and time.monotonic() < t0 + 30:
            recs = B.current_stalls(board)
            time.sleep(0.02)
        assert recs, "the peer watch never published the stall"
        (rec,) = recs
        assert (rec["rank"], rec["peer_rank"], rec["channel"], rec["pid"]) == (0, 1, "mlp", rank0.pid)
        assert rec["message"].startswith(f"peer rank 1 (pid {peer.proc.pid}) is stopped (process state T) for ")
        assert rank0.wait(timeout=60) == 1
        elapsed = time.monotonic() - t0
        err = rank0.stderr.read()
        assert 2.0 <= elapsed < 60, elapsed
        assert f"peer died: rank 1 pid {peer.proc.pid} is stopped (state T) for " in err, err
        assert "longer than the limit of 2000 ms (SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS)" in err
        assert "CRITICAL" in err and "blocked outside the DP2 exchange" in err and "exiting with code 1" in err
        os.kill(peer.proc.pid, signal.SIGCONT)
        ev = peer.event()  # its next exchange: the published error, not a wait for a rank that is gone
        assert ev["event"] == "error" and ev["code"] == "poisoned" and "is stopped (state T)" in ev["message"], ev
    finally:
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if rank0.poll() is None:
            rank0.kill()
        rank0.wait(timeout=30)
        rank0.stdout.close()
        rank0.stderr.close()
        peer.finish()
        board.close()
