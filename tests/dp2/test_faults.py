"""Fault injection for the native DP2 exchange: real shared memory, real futexes, real processes.

Peers are separate Python processes (tests/dp2/peer.py); the local end lives in the test process.
Every test checks that nothing is left in /dev/shm afterwards.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from dspark_harden.dp2 import native
from dspark_harden.dp2.native import Channel, Dp2Error, shm_name_for

# host_exclusive: every test checks that no dspark_dp2_ segment appeared on the host (a DP2 server of the other
# pytest-xdist worker creates its own meanwhile: the second two-worker run; tests/conftest.py)
pytestmark = pytest.mark.host_exclusive

PEER = os.path.join(os.path.dirname(__file__), "peer.py")
W = 11


def _session() -> str:
    return f"fault-{uuid.uuid4().hex}"


def _shm_entries() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("dspark_dp2_")}


@pytest.fixture(autouse=True)
def no_shm_leftovers():
    before = _shm_entries()
    yield
    leaked = _shm_entries() - before
    assert not leaked, f"/dev/shm leftovers: {leaked}"


class Peer:
    def __init__(self, mode: str, session: str, rank: int, *args, env=None, timeout_ms: int = 20000):
        e = dict(os.environ)
        e["PEER_TIMEOUT_MS"] = str(timeout_ms)  # both ends must agree (checked at open)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, PEER, mode, session, str(rank), *map(str, args)],
            stdout=subprocess.PIPE,
            text=True,
            env=e,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def event(self, timeout: float = 60.0) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("peer produced no output in time") from None
        assert line, f"peer exited (rc {self.proc.poll()}) without output"
        return json.loads(line)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


def _open(session: str, rank: int = 0, **kw) -> Channel:
    kw.setdefault("width", W)
    kw.setdefault("timeout_ms", 20000)
    kw.setdefault("config_digest", 7)
    return Channel(session, "mlp", rank=rank, **kw)


def test_lockstep_values_and_unlink_after_both_attached():
    s = _session()
    ch = _open(s)
    assert os.path.exists("/dev/shm" + ch.shm_name)  # only rank 0 attached: the name exists
    peer = Peer("exchange-then-close", s, 1, 50)
    try:
        assert peer.event()["event"] == "opened"
        for i in range(50):
            out = ch.exchange([i] * W)
            assert out == [i] * W + [1000 + i] * W
            assert ch.stats.sequence == i + 1
        assert peer.event()["event"] == "closed"
        assert not os.path.exists("/dev/shm" + ch.shm_name)  # unlinked once both were mapped
    finally:
        ch.close()
        peer.finish()


def test_peer_sigkilled_mid_run_is_detected_within_the_wait_slice():
    s = _session()
    ch = _open(s, timeout_ms=30000)
    peer = Peer("exchange-then-sleep", s, 1, 20, timeout_ms=30000)
    try:
        assert peer.event()["event"] == "opened"
        for i in range(20):
            ch.exchange([i] * W)
        assert peer.event()["event"] == "ready"
        killer = threading.Timer(0.3, lambda: os.kill(peer.proc.pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(Dp2Error, match="peer died") as info:
            ch.exchange([0] * W)
        elapsed = time.monotonic() - t0
        killer.join()
        assert info.value.name == "peer_died"
        # detection is bounded by the 20 ms wait slice, not by the 30 s timeout
        assert elapsed < 10.0, elapsed
        assert ch.shared_error() == native.lib.DSPARK_DP2_E_PEER_DIED
        with pytest.raises(Dp2Error, match="poisoned") as again:
            ch.exchange([0] * W)
        assert again.value.name == "poisoned"
    finally:
        ch.close()
        peer.finish()


def test_peer_never_attaches_times_out_and_close_unlinks():
    s = _session()
    ch = _open(s, timeout_ms=300)
    name = ch.shm_name
    t0 = time.monotonic()
    with pytest.raises(Dp2Error, match="never attached") as info:
        ch.exchange([1] * W)
    assert time.monotonic() - t0 >= 0.29
    assert info.value.name == "timeout"
    ch.close()
    assert not os.path.exists("/dev/shm" + name)


def test_peer_alive_but_stalled_is_reported_and_fails_only_at_the_hard_limit():
    """Item 6: a live peer that does not arrive is a stall, reported every timeout period (callback),
    not a failure; the exchange fails (code timeout, channel poisoned) only at the hard limit."""
    s = _session()
    stalls = []
    ch = _open(s, timeout_ms=300, hard_timeout_ms=900, on_stall=lambda msg, waited: stalls.append((msg, waited)))
    peer = Peer("exchange-then-sleep", s, 1, 3, timeout_ms=300)
    try:
        peer.event()
        for i in range(3):
            ch.exchange([i] * W)
        peer.event()
        t0 = time.monotonic()
        with pytest.raises(Dp2Error, match=r"has not reached sequence 4 .*peer at 3.*hard limit of 900 ms") as info:
            ch.exchange([0] * W)
        assert info.value.name == "timeout"
        assert time.monotonic() - t0 >= 0.85
        assert [round(w, 1) for _, w in stalls] == [0.3, 0.6, 0.9]
        assert all("alive but has not reached sequence 4" in m for m, _ in stalls)
        assert ch.shared_error() == native.lib.DSPARK_DP2_E_CALLER  # published: the peer stops too
    finally:
        ch.close()
        peer.finish()


def test_peer_alive_and_late_completes_after_stall_warnings():
    """A peer that is alive and arrives after several timeout periods completes the exchange with
    its data: a long one-rank stall (e.g. a slow step) no longer kills both schedulers."""
    s = _session()
    stalls = []
    ch = _open(s, timeout_ms=200, hard_timeout_ms=0, on_stall=lambda msg, waited: stalls.append(waited))
    peer = Peer("exchange-then-late", s, 1, 2, 1.0, timeout_ms=200)
    try:
        assert peer.event()["event"] == "opened"
        for i in range(2):
            ch.exchange([i] * W)
        assert peer.event()["event"] == "ready"
        assert ch.exchange([7] * W) == [7] * W + [1002] * W
        assert ch.stats.sequence == 3 and len(stalls) >= 2
        assert ch.stats.total_ns >= 0.9e9  # stats span every wait period of the exchange
        assert peer.event()["event"] == "late_exchange_done"
    finally:
        ch.close()
        peer.finish()


def test_never_attached_peer_still_times_out_after_one_period():
    s = _session()
    ch = _open(s, timeout_ms=300, hard_timeout_ms=0, on_stall=lambda *a: pytest.fail("not a stall"))
    with pytest.raises(Dp2Error, match="never attached"):
        ch.exchange([1] * W)
    ch.close()


def test_pid_reuse_is_detected_through_process_start_time():
    """Simulated reuse: the peer's recorded start time no longer matches the process now holding
    its pid (exactly what a recycled pid looks like); kill(pid, 0) alone would call it alive."""
    s = _session()
    ch = _open(s, timeout_ms=30000)
    peer = Peer("exchange-then-sleep", s, 1, 0, timeout_ms=30000)
    try:
        peer.event()
        peer.event()  # ready
        os.kill(peer.proc.pid, 0)  # the pid is alive
        ch.debug_set_start_time(1, 12345)
        with pytest.raises(Dp2Error, match="peer died.*reused by another process") as info:
            ch.exchange([0] * W)
        assert info.value.name == "peer_died"
    finally:
        ch.close()
        peer.finish()


@pytest.mark.parametrize("publish", [True, False])
def test_sequence_divergence_stops_both_ranks(publish, tmp_path):
    s = _session()
    ch = _open(s)
    go = tmp_path / "go"
    # publish: the peer jumps 3 ahead (legal lead is 1); else only its local count diverges. It skips only
    # once we have read its last row (go file): jumping while we still copy that row is a different error
    peer = Peer(
        "exchange-then-skip", s, 1, 5, 3 if publish else 1, "1" if publish else "0", env={"PEER_GO_FILE": str(go)}
    )
    try:
        peer.event()
        for i in range(5):
            ch.exchange([i] * W)
        go.touch()
        assert peer.event()["event"] == "skipped"
        with pytest.raises(Dp2Error) as info:
            ch.exchange([0] * W)
        peer_ev = peer.event()
        assert peer_ev["event"] == "error"
        if publish:  # peer jumped ahead: we see it lapping us, the peer sees the poisoned channel
            assert info.value.name == "lapped" and "more than one ahead" in str(info.value)
            assert peer_ev["code"] == "poisoned" and "sequence lapped" in peer_ev["message"]
        else:  # peer's own count diverged from what it published: it reports, we are poisoned
            assert peer_ev["code"] == "sequence_divergence"
            assert info.value.name == "poisoned" and "sequence divergence" in str(info.value)
    finally:
        ch.close()
        peer.finish()


def test_wrong_width_at_open_fails_and_poisons_the_creator():
    s = _session()
    ch = _open(s, width=W)
    peer = Peer("exchange-then-sleep", s, 1, 0, env={"PEER_WIDTH": "7"})
    try:
        ev = peer.event()
        assert ev["event"] == "open_failed" and ev["code"] == "mismatch"
        assert "payload width mismatch: peer opened with 11, this rank with 7" in ev["message"]
        with pytest.raises(Dp2Error, match="poisoned.*width mismatch"):
            ch.exchange([0] * W)
    finally:
        ch.close()
        peer.finish()


def test_config_disagreement_at_open_fails():
    s = _session()
    ch = _open(s, config_digest=1)
    peer = Peer("exchange-then-sleep", s, 1, 0, env={"PEER_DIGEST": "2"})
    try:
        ev = peer.event()
        assert ev["event"] == "open_failed" and ev["code"] == "mismatch"
        assert "configuration mismatch" in ev["message"]
        with pytest.raises(Dp2Error, match="poisoned"):
            ch.exchange([0] * W)
    finally:
        ch.close()
        peer.finish()


def test_wrong_abi_segment_is_rejected():
    s = _session()
    name = shm_name_for(s, "mlp")
    path = "/dev/shm" + name
    ch = _open(s)  # creates a valid segment; we then corrupt its header's ABI field
    try:
        with open(path, "r+b") as fh:
            fh.seek(8)
            fh.write((99).to_bytes(4, "little"))
        with pytest.raises(Dp2Error, match=r"header mismatch: .* abi 99") as info:
            _open(s, rank=1)
        assert info.value.name == "mismatch"
    finally:
        ch.close()
    # a segment of the wrong size (another layout) is rejected as well
    with open(path, "wb") as fh:
        fh.write(b"\0" * 100)
    os.chmod(path, 0o600)  # this user's, private: only the size is wrong
    try:
        with pytest.raises(Dp2Error, match="has size 100"):
            _open(s)
    finally:
        os.unlink(path)


def test_python_wrapper_refuses_a_mismatched_library():
    stale = native.EXPECTED_ABI + 1
    with pytest.raises(ImportError, match=f"ABI {stale} does not match"):
        native.verify_abi(stale, stale)
    native.verify_abi(native.EXPECTED_ABI, native.EXPECTED_ABI)


def test_handle_used_after_fork_fails_in_the_child_and_leaves_the_parent_intact():
    s = _session()
    ch = _open(s)
    peer = Peer("exchange-then-close", s, 1, 3)
    try:
        peer.event()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: must be refused, and closing must not touch shared state
            os.close(r)
            try:
                ch.exchange([0] * W)
                msg = "unexpected success"
            except Dp2Error as exc:
                msg = f"{exc.name}|{exc}"
            ch.close()
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        msg = os.read(r, 4096).decode()
        os.close(r)
        assert msg.startswith("used_after_fork|") and "handle used after fork" in msg, msg
        assert ch.shared_error() == 0
        for i in range(3):  # the parent's channel still works with its peer
            assert ch.exchange([i] * W)[W:] == [1000 + i] * W
        assert peer.event()["event"] == "closed"
    finally:
        ch.close()
        peer.finish()


def test_ownership_change_is_published():
    s = _session()
    ch = _open(s)
    peer = Peer("exchange-then-wait", s, 1, 0)
    try:
        peer.event()
        peer.event()
        ch.debug_set_pid(0, 1)  # someone else now claims our slot
        with pytest.raises(Dp2Error, match="ownership changed") as info:
            ch.exchange([0] * W)
        assert info.value.name == "ownership_changed"
        ev = peer.event()
        assert ev["code"] == "poisoned" and "ownership changed" in ev["message"]
        ch.debug_set_pid(0, os.getpid())
    finally:
        ch.close()
        peer.finish()


def test_peer_closing_while_we_wait_is_reported():
    s = _session()
    ch = _open(s)
    peer = Peer("exchange-then-close", s, 1, 2)
    try:
        peer.event()
        for i in range(2):
            ch.exchange([i] * W)
        assert peer.event()["event"] == "closed"
        with pytest.raises(Dp2Error, match="closed the channel") as info:
            ch.exchange([0] * W)
        assert info.value.name == "peer_closed"
    finally:
        ch.close()
        peer.finish()


def test_rank_already_owned_and_bad_arguments():
    s = _session()
    ch = _open(s)
    try:
        with pytest.raises(Dp2Error, match="rank 0 is already owned by pid") as info:
            _open(s, rank=0)
        assert info.value.name == "owned"
    finally:
        ch.close()
    with pytest.raises(Dp2Error, match="rank must be 0 or 1"):
        _open(_session(), rank=2)
    with pytest.raises(Dp2Error, match="timeout must be positive"):
        _open(_session(), timeout_ms=0)
    with pytest.raises(Dp2Error, match="session id must be non-empty"):
        _open("")
    with pytest.raises(Dp2Error, match="payload width must be in 1..32"):
        _open(_session(), width=33)
    with pytest.raises(Dp2Error, match="world size must be 2"):
        _open(_session(), world_size=3)


def test_closed_handle_is_refused():
    ch = _open(_session(), timeout_ms=100)
    ch.close()
    ch.close()  # idempotent
    with pytest.raises(Dp2Error, match="already closed"):
        ch.exchange([0] * W)


# -- item 0 of "Fail closed and bounded everywhere": publish-then-close/die while the other rank waits --


@pytest.mark.parametrize(
    "mode,gone",
    [("exchange-then-close", "closed"), ("exchange-then-exit", "exiting"), ("exchange-then-poison", "poisoned")],
)
def test_data_published_before_close_or_death_completes_the_exchange(mode, gone):
    """Deterministic: the waiter is held (native fault hook) between its stale read of the peer's
    sequence and its state checks until the peer has published the awaited sequence and closed (or
    exited without closing). The exchange must complete with the peer's data; close or death is
    reported only for the next sequence, which the peer never reached. Before the fix this raised
    'peer closed ... at sequence 2 while rank 0 waits for 2'."""
    s = _session()
    ch = _open(s)
    peer = Peer(mode, s, 1, 2)
    try:
        assert peer.event()["event"] == "opened"
        assert ch.exchange([0] * W) == [0] * W + [1000] * W
        ch.debug_hold_until_peer_closed()
        assert ch.exchange([1] * W) == [1] * W + [1001] * W
        assert peer.event()["event"] == gone
        want = {
            "closed": "closed the channel at sequence 2 while rank 0 waits for 3",
            "exiting": "peer died",
            "poisoned": "channel poisoned: rank 1 published error 18",
        }[gone]
        with pytest.raises(Dp2Error, match=want):
            ch.exchange([2] * W)
    finally:
        ch.close()
        peer.finish()


def test_last_exchange_before_close_never_fails_under_stress():
    """Stress (real threads, real shm + futex; cffi releases the GIL in the native call): rank 1 closes
    right after its last exchange while rank 0 is still waiting for it. Every round's last exchange
    must complete; only an exchange past the peer's last sequence may report the close."""
    rounds, steps = 1000, 3
    for r in range(rounds):
        s = _session()
        a = _open(s, rank=0, spin_ns=0 if r % 2 else 50_000)
        b = _open(s, rank=1, spin_ns=0 if r % 2 else 50_000)
        failures: list = []

        def rank1():
            try:
                for i in range(steps):
                    b.exchange([1000 + i] * W)
            except Dp2Error as exc:  # pragma: no cover - reported below
                failures.append(("rank1", str(exc)))
            finally:
                b.close()

        t = threading.Thread(target=rank1)
        t.start()
        try:
            for i in range(steps):
                if r % 3 == 0 and i == steps - 1:
                    time.sleep(0)  # let rank 1 run ahead into its close
                try:
                    assert a.exchange([i] * W) == [i] * W + [1000 + i] * W
                except Dp2Error as exc:
                    failures.append(("rank0", i + 1, str(exc)))
            with pytest.raises(Dp2Error, match=f"closed the channel at sequence {steps} "):
                a.exchange([0] * W)
        finally:
            t.join(30)
            a.close()
        assert not failures, f"round {r}: {failures}"


def test_bad_out_tensor_is_refused_before_the_rank_slot_is_taken():
    """Item 9: the C side writes through ``data_ptr()``; a non-CPU / wrong-dtype / wrong-size buffer is
    refused before open, so the rank slot stays free for a correct retry."""
    import torch

    s = _session()
    for bad, why in [
        (torch.zeros(2 * W, dtype=torch.int64, device="meta"), "device meta"),
        (torch.zeros(2 * W, dtype=torch.int32), "dtype torch.int32"),
        (torch.zeros(2 * W + 1, dtype=torch.int64), "23 elements"),
        (torch.zeros(4 * W, dtype=torch.int64)[::2], "not contiguous"),
    ]:
        with pytest.raises(ValueError, match=why):
            _open(s, out_tensor=bad)
    good = torch.zeros(2 * W, dtype=torch.int64)
    ch = _open(s, out_tensor=good)  # the slot was never taken by the refused attempts
    ch.close()


SHIM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
int mlock(const void *addr, size_t len) {
    (void)addr; (void)len;
    const char *flag = getenv("SHIM_INSIDE_FILE");
    if (flag) { int fd = open(flag, O_WRONLY | O_CREAT, 0600); if (fd >= 0) close(fd); }
    usleep(1500000); /* hold the channel's flock while the other rank blocks on it */
    errno = ENOMEM;
    return -1;
}
"""


def test_creator_failing_after_init_fails_a_blocked_peer_at_once(tmp_path):
    """Item 10: the creating rank fails after initialising the segment (mlock refused) while the other
    rank is blocked on the segment's flock. The creator clears the magic before unlinking, so the peer
    fails at once naming the abandoned segment instead of attaching to an orphaned inode and waiting for
    its first timeout. Stand-in: as root mlock cannot be made to fail through RLIMIT_MEMLOCK, so an
    LD_PRELOAD shim makes the creator's mlock fail (after 1.5 s, holding the flock)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, lib = tmp_path / "shim.c", tmp_path / "shim.so"
    src.write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    inside = tmp_path / "inside"
    s = _session()
    creator = Peer(
        "exchange-then-close", s, 0, 0, env={"LD_PRELOAD": str(lib), "SHIM_INSIDE_FILE": str(inside)}, timeout_ms=5000
    )
    try:
        deadline = time.monotonic() + 30
        while not inside.exists():
            assert time.monotonic() < deadline, "creator never reached mlock"
            assert creator.proc.poll() is None, "creator exited early"
            time.sleep(0.005)
        t0 = time.monotonic()
        with pytest.raises(Dp2Error, match="abandoned by the rank that created it"):
            _open(s, rank=1, timeout_ms=5000)
        assert time.monotonic() - t0 < 4.0  # at once after the creator let go, not after a timeout
        ev = creator.event()
        assert ev["event"] == "open_failed" and "mlock" in ev["message"], ev
    finally:
        creator.finish()
