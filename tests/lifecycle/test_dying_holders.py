"""Leftover removal when the last holder of a segment is dying or holds it where no fd table shows it.

Real parts: real processes, real /dev/shm, real /proc, real kernel write leases, a real unix socket.

* A process whose thread-group leader exited while another of its threads still runs: the leader is
  ``Z`` in ``/proc/<pid>/stat`` and its own ``maps`` and ``fd`` are empty, but the address space is
  still there and the kernel refuses a write lease on what it maps. A SIGKILLed multi-threaded
  scheduler looks like that while its threads tear down, and stock ``kill_process_tree`` already counts
  it as gone: the offline Engine's cleanup then found every leftover "open in a process /proc does not
  show" and kept all four (reproduced here under load in 2 of 5 runs before this fix). The tracker and
  the holder inspection read such a process through a live thread's ``/proc/<pid>/task/<tid>``.
* A file that is open only inside the kernel (an fd in flight in a unix socket's queue, in no fd
  table): the lease is refused and /proc shows nobody; it is tried again for ``LEASE_SETTLE_S`` and
  removed once released, kept (and the refusals counted in the reason) while it stays held.
"""

from __future__ import annotations

import array
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dspark_harden.lifecycle import proctree, resources

# the leader leaves with SYS_exit (this thread only); a second thread keeps the mapping until stdin
# closes. SYS_exit is 60 on x86_64, 93 on aarch64.
LEADER_EXITS = textwrap.dedent("""
    import ctypes, mmap, os, sys, threading
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    os.close(fd)
    for n in os.listdir("/proc/self/fd"):  # the dup mmap keeps: mapped only, as a scheduler's segments
        try:
            if os.readlink(f"/proc/self/fd/{n}") == sys.argv[1]:
                os.close(int(n))
        except OSError:
            pass

    def hold():
        sys.stdin.read()  # until the test closes the pipe
        os._exit(0)

    threading.Thread(target=hold).start()
    print("ready", flush=True)
    ctypes.CDLL(None).syscall(93 if os.uname().machine == "aarch64" else 60, 0)
""")


def _name(tag: str) -> str:
    return f"/dev/shm/dspark-test-{tag}-{os.getpid()}-{time.time_ns()}"


@pytest.fixture
def leader_exited():
    """A process that maps a fresh /dev/shm file and whose leader already exited: ``(proc, path)``."""
    path = _name("dying")
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER_EXITS, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while (st := proctree.stat(proc.pid)) is not None and st.state != "Z":
            assert time.monotonic() < deadline, "the leader did not exit"
            time.sleep(0.01)
        assert st is not None and st.state == "Z", st
        with open(f"/proc/{proc.pid}/maps") as f:
            assert f.read() == ""  # what /proc/<pid> shows of it: nothing
        yield proc, path
    finally:
        proc.stdin.close()
        proc.wait(10)
        if os.path.exists(path):
            os.unlink(path)


def test_live_tid_finds_the_thread_that_outlived_its_leader(leader_exited):
    proc, _path = leader_exited
    tid = proctree.live_tid(proctree.stat(proc.pid))
    assert tid is not None and tid != proc.pid
    assert resources.proc_dir(proctree.stat(proc.pid)) == f"/proc/{proc.pid}/task/{tid}"


def test_the_tracker_records_what_a_process_with_an_exited_leader_maps(leader_exited):
    proc, path = leader_exited
    tracker = resources.ResourceTracker(root=proc.pid)
    tracker.scan()
    assert path in tracker.shm, sorted(tracker.shm)


def test_a_holder_outside_the_tree_whose_leader_exited_is_named(leader_exited):
    """Outside the tree it is another process using the segment: kept, naming it (not "/proc does not
    show"), and without waiting out the lease retries."""
    proc, path = leader_exited
    other_root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tracker = resources.ResourceTracker(root=other_root.pid)  # a tree the holder is not in
        tracker.add_paths(shm=[path])
        t0 = time.monotonic()
        result = resources.remove_leftovers(tracker)
        assert path in result["kept"], result
        assert result["why"][path] == f"mapped by pid {proc.pid} (python)", result
        assert time.monotonic() - t0 < resources.LEASE_SETTLE_S, "a visible holder does not need the retries"
        assert os.path.exists(path)
    finally:
        other_root.kill()
        other_root.wait(10)


def test_a_killed_tree_process_whose_leader_exited_counts_as_the_trees(leader_exited):
    """In the tree (the tracker's root is its parent) it is a killed process that has not finished
    dying: what it holds is the tree's (``ours``), decided from /proc at once, never "open in a process
    /proc does not show" after the retries. (Whether the name is then removed depends on whether every
    other process could be inspected: on a host where pid 1 is unreadable it is kept, "may be in use".)"""
    proc, path = leader_exited
    tracker = resources.ResourceTracker(root=os.getpid())
    tracker.scan()
    assert path in tracker.shm
    key = tracker.candidates()[path]
    found = resources.holders({path: key}, {(proc.pid, proctree.stat(proc.pid).start)})
    assert key in found.ours and path not in found.in_use, found
    t0 = time.monotonic()
    result = resources.remove_leftovers(tracker)
    assert time.monotonic() - t0 < resources.LEASE_SETTLE_S, "decided from /proc, not by waiting"
    if path in result["kept"]:
        assert result["why"][path].startswith("may be in use: "), result
        assert found.doubt is not None
    else:
        assert path in result["removed"] and not os.path.exists(path), result


def _in_flight(path: str):
    """Open ``path`` and leave the only open file in a unix socket's queue (SCM_RIGHTS, not received):
    open in the kernel, in no process's fd table. Returns the socket pair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(path, os.O_RDONLY)
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)
    return a, b


def _receive_and_close(b: socket.socket) -> None:
    _msg, anc, _flags, _addr = b.recvmsg(1, socket.CMSG_SPACE(4))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for fd in array.array("i", data[:4]):
                os.close(fd)


@pytest.fixture
def in_flight():
    """A fresh /dev/shm file open only in a unix socket's queue, recorded by a tracker of this
    process's tree: ``(path, tracker, receiving_socket)``."""
    path = _name("inflight")
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    a, b = _in_flight(path)
    tracker = resources.ResourceTracker(root=os.getpid())
    tracker.add_paths(shm=[path])
    try:
        yield path, tracker, b
    finally:
        a.close()
        b.close()
        if os.path.exists(path):
            os.unlink(path)


def test_a_lease_refused_with_no_holder_in_proc_is_tried_again_until_released(in_flight):
    path, tracker, b = in_flight
    assert resources.holders(tracker.candidates(), set()).in_use == {}  # /proc shows nobody
    timer = threading.Timer(0.3, _receive_and_close, (b,))
    timer.start()
    t0 = time.monotonic()
    result = resources.remove_leftovers(tracker)
    timer.join()
    assert path in result["removed"], result
    assert 0.25 < time.monotonic() - t0 < resources.LEASE_SETTLE_S, "removed only once released"
    assert not os.path.exists(path)


def test_a_lease_still_refused_after_the_retries_is_kept_and_says_so(in_flight):
    path, tracker, _b = in_flight
    t0 = time.monotonic()
    result = resources.remove_leftovers(tracker)
    waited = time.monotonic() - t0
    assert path in result["kept"], result
    why = result["why"][path]
    assert "the kernel refused a write lease" in why and "time(s) in" in why, why
    assert int(why.rsplit("lease ", 1)[1].split()[0]) > 3, why  # tried again, not once
    assert waited >= resources.LEASE_SETTLE_S - 0.6, waited
    assert os.path.exists(path)


def test_stock_counts_a_process_whose_leader_exited_as_gone_and_a_pidfd_does_not(leader_exited):
    """Stock ``kill_process_tree`` waits with ``_still_holding_resources`` ("a zombie has already had
    its resources freed"): it calls this process gone while the kernel still refuses a write lease on
    what it maps. The pidfd the Engine's shutdown pins each child with turns readable only when the
    whole thread group exited."""
    import fcntl

    import psutil
    from sglang.srt.utils.common import _still_holding_resources

    proc, path = leader_exited
    assert _still_holding_resources([psutil.Process(proc.pid)]) == []  # stock: gone
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.fcntl(fd, resources.F_SETLEASE, fcntl.F_WRLCK)  # the kernel: still open
    finally:
        os.close(fd)
    handle = proctree.open_handle(proctree.stat(proc.pid))
    try:
        assert proctree.wait_exited([handle], 0.3) == [handle]  # ours: not exited
        proc.stdin.close()
        assert proctree.wait_exited([handle], 10) == []
    finally:
        handle.close()


_WRAPPER_PROBE = textwrap.dedent("""
    import json, os, subprocess, sys, threading, time
    from dspark_harden.lifecycle import main as lm, proctree, resources

    path = sys.argv[1]
    proc = subprocess.Popen([sys.executable, "-c", sys.argv[2], path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    while proctree.stat(proc.pid).state != "Z":
        time.sleep(0.01)
    lm.MAIN.tracker = resources.ResourceTracker()
    lm.MAIN.tracker.scan()
    assert path in lm.MAIN.tracker.shm

    def stock(self):  # stock's effect on this tree: it returns while the leader is a zombie
        threading.Timer(0.5, proc.stdin.close).start()

    class Engine:
        pass

    t0 = time.monotonic()
    lm.build_engine_shutdown(stock)(Engine())
    print("PROBE " + json.dumps({"waited_s": time.monotonic() - t0, "left": os.path.exists(path)}), flush=True)
    proc.wait(10)
""")


def test_engine_shutdown_cleans_up_only_after_the_tree_really_exited(tmp_path):
    """The wrapped ``Engine.shutdown`` with a stand-in for stock's part (a real sglang Engine needs a
    server, test_engine_shutdown.py runs one): stock returns while a child's leader is a zombie and its
    other thread still maps a segment for 0.5 s more. The wrapper waits on the child's pidfd, then the
    cleanup gets a write lease and removes the segment. Without the wait the cleanup runs while the
    segment is still mapped and keeps it."""
    import json

    path = _name("engine")
    try:
        r = subprocess.run(
            [sys.executable, "-c", _WRAPPER_PROBE, path, LEADER_EXITS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
        assert r.returncode == 0 and lines, (r.stdout[-1500:], r.stderr[-3000:])
        report = json.loads(lines[-1][6:])
        assert report["left"] is False, (report, r.stderr[-3000:])
        assert report["waited_s"] >= 0.45, report
    finally:
        if os.path.exists(path):
            os.unlink(path)
