"""Leftover removal deletes only what the server owns (issue 21, item 5) and the tracker's own
cost (item 3): real processes of two uids, real /dev/shm, real /proc, real kernel leases.

* a segment the server mapped and unlinked, re-created under the same name by another user's process
  that holds it open by fd, is not the server's: never deleted (stock trusted the recorded *path*);
* a recorded segment held open by fd only (no mapping) by another user's process is in use;
* a server that is not root cannot read another user's process: that process might hold the segment;
  the kernel decides (a write lease is refused while anybody has the file open): held -> kept,
  not held -> removed;
* what the removing process itself maps is confirmed through a lease on its own fd;
* the tracker scans when the children are ready, not every 3 s, and forgets what no longer exists.
"""

from __future__ import annotations

import mmap
import os
import signal
import time

import pytest

from dspark_harden.lifecycle import resources

from .uids import OTHER_UID, SERVER_UID, Proc, need_root, run_as


def _name(tag: str) -> str:
    return f"/dev/shm/dspark-test-{tag}-{os.getpid()}-{time.time_ns()}"


def _owner(conn, path: str, mode: int):
    """A process of the server's tree: creates and maps ``path``; on "unlink" unlinks it (the
    mapping stays), on "more" creates and maps 20 new segments and drops the previous ones."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    os.fchmod(fd, mode)
    os.ftruncate(fd, 4096)
    _mapped = [mmap.mmap(fd, 4096)]  # kept referenced: the mapping outlives the unlink
    os.close(fd)
    conn.say()
    batch: list = []
    while True:
        cmd = conn.hear()
        if cmd == "unlink":
            os.unlink(path)
        elif cmd.startswith("more "):
            for p, m in batch:
                m.close()
                os.unlink(p)
            batch = []
            for i in range(20):
                p = f"{cmd[5:]}-{i}"
                fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, 4096)
                batch.append((p, mmap.mmap(fd, 4096)))
                os.close(fd)
        conn.say("done")


def _holder(conn, path: str, how: str):
    """An unrelated process: ``create`` (a new file under that name, held open by fd), ``fd``
    (opens the existing file, holds the fd, no mapping) or ``map`` (maps it read-only, fd closed)."""
    if how in ("create", "create_closed"):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        if how == "create_closed":
            os.close(fd)
    else:
        fd = os.open(path, os.O_RDONLY)
        if how == "map":
            m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
            os.close(fd)
            assert m
    conn.say()
    while True:
        time.sleep(60)


def _dead(proc: Proc) -> None:
    proc.kill()
    os.waitpid(proc.pid, 0)


@pytest.fixture
def cleanup_paths():
    paths: list[str] = []
    yield paths
    for p in paths:
        for q in [p] + [f"{p}-{i}" for i in range(20)]:
            if os.path.lexists(q):
                os.unlink(q)


@pytest.mark.parametrize("how", ["create", "create_closed"])
def test_a_name_recreated_by_another_user_is_not_the_servers(cleanup_paths, how):
    """``create``: the other user holds it open by fd (the reproduced case); ``create_closed``: nobody
    holds it any more, so only its identity tells it is not the server's."""
    need_root()
    path = _name("recreated")
    cleanup_paths.append(path)
    owner = Proc(_owner, path, 0o600)
    holder = None
    try:
        assert owner.expect() == "ready"
        tracker = resources.ResourceTracker(root=owner.pid)
        tracker.scan()
        assert path in tracker.shm
        owner.tell("unlink")
        assert owner.expect() == "done"
        holder = Proc(_holder, path, how, uid=OTHER_UID)
        assert holder.expect() == "ready"
        theirs = os.stat(path)
        assert theirs.st_uid == OTHER_UID
        _dead(owner)
        result = resources.remove_leftovers(tracker)
        assert path not in result["removed"], result
        assert os.path.exists(path) and os.stat(path).st_ino == theirs.st_ino, "another user's file was deleted"
    finally:
        owner.reap()
        if holder is not None:
            holder.reap()


def test_a_segment_held_open_by_fd_only_is_in_use(cleanup_paths):
    need_root()
    path = _name("fdheld")
    cleanup_paths.append(path)
    owner = Proc(_owner, path, 0o666)
    holder = None
    try:
        assert owner.expect() == "ready"
        tracker = resources.ResourceTracker(root=owner.pid)
        tracker.scan()
        holder = Proc(_holder, path, "fd", uid=OTHER_UID)
        assert holder.expect() == "ready"
        _dead(owner)
        result = resources.remove_leftovers(tracker)
        assert path in result["kept"] and f"open in pid {holder.pid}" in result["why"][path], result
        assert os.path.exists(path)
    finally:
        owner.reap()
        if holder is not None:
            holder.reap()


def _remove_as_server(owner_pid: int) -> dict:
    tracker = resources.ResourceTracker(root=owner_pid)
    tracker.scan()
    os.kill(owner_pid, signal.SIGKILL)  # our own process (same uid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{owner_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    result = resources.remove_leftovers(tracker)
    result["recorded"] = sorted(tracker.shm)
    return result


def test_a_non_root_server_keeps_what_a_process_it_cannot_read_maps(cleanup_paths):
    """As a non-root server, another user's /proc/<pid>/maps is unreadable (stock swallowed the
    PermissionError and deleted the segment): the kernel refuses a write lease while that process has
    the file mapped, so it is kept."""
    need_root()
    path = _name("unreadable")
    cleanup_paths.append(path)
    owner = Proc(_owner, path, 0o666, uid=SERVER_UID)
    holder = None
    try:
        assert owner.expect() == "ready"
        holder = Proc(_holder, path, "map", uid=OTHER_UID)
        assert holder.expect() == "ready"
        result = run_as(SERVER_UID, _remove_as_server, owner.pid)
        assert path in result["recorded"], result
        assert path in result["kept"] and path not in result["removed"], result
        assert "the kernel refused a write lease" in result["why"][path], result
        assert os.path.exists(path)
    finally:
        owner.reap()
        if holder is not None:
            holder.reap()


def test_a_non_root_server_still_removes_what_nobody_holds(cleanup_paths):
    """The same server, no other holder: processes it cannot read exist on every host (root's), the
    kernel confirms nobody has the file open, it is removed."""
    need_root()
    path = _name("free")
    cleanup_paths.append(path)
    owner = Proc(_owner, path, 0o600, uid=SERVER_UID)
    try:
        assert owner.expect() == "ready"
        result = run_as(SERVER_UID, _remove_as_server, owner.pid)
        assert path in result["removed"], result
        assert not os.path.exists(path)
    finally:
        owner.reap()


def _remove_own_mapping(path: str) -> dict:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)  # keeps a dup of the fd
    os.close(fd)
    tracker = resources.ResourceTracker(root=os.getpid())
    tracker.scan()
    result = resources.remove_leftovers(tracker)
    m.close()
    return result


def test_what_the_removing_process_maps_itself_is_confirmed_through_its_own_fd(cleanup_paths):
    """The main process maps segments of its tree (the load snapshot): a lease on a fresh fd is
    refused by its own mapping, the lease on the fd it already holds is not."""
    need_root()
    path = _name("own")
    cleanup_paths.append(path)
    result = run_as(SERVER_UID, _remove_own_mapping, path)
    assert path in result["removed"], result


def test_tracker_scans_when_the_children_are_ready_not_every_few_seconds(cleanup_paths):
    """Stock scanned the whole host's /proc every 3 s from the HTTP process (taking each scheduler's
    mmap lock on older kernels). Now: at start, when the children are ready, once more later, then
    every 10 minutes."""
    path = _name("late")
    cleanup_paths.append(path)
    first = _name("first")
    cleanup_paths.append(first)
    owner = Proc(_owner, first, 0o600)
    tracker = resources.ResourceTracker(root=owner.pid)
    try:
        assert owner.expect() == "ready"
        tracker.start()
        deadline = time.monotonic() + 20
        while not tracker.shm and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tracker.shm, "no scan at start"
        owner.tell(f"more {path}")  # 20 segments made after start
        assert owner.expect() == "done"
        time.sleep(7.5)
        assert not any(p.startswith(path) for p in tracker.shm), "the tracker scanned again on its own"
        tracker.notify_ready()
        deadline = time.monotonic() + 20
        while not any(p.startswith(path) for p in tracker.shm) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(p.startswith(path) for p in tracker.shm), "no scan when the children were ready"
    finally:
        tracker.stop()
        owner.reap()


def test_tracker_state_stays_bounded_by_what_exists(cleanup_paths):
    path = _name("churn")
    cleanup_paths.append(path)
    first = _name("base")
    cleanup_paths.append(first)
    owner = Proc(_owner, first, 0o600)
    tracker = resources.ResourceTracker(root=owner.pid)
    try:
        assert owner.expect() == "ready"
        # The baseline: ``first`` plus whatever the owner inherited from the pytest process by fork
        # (an unlinked /dev/shm mapping of an earlier test, e.g. a semaphore, is recorded without a
        # name while held: seen once in a full suite run). Each round adds 20 live segments and
        # removes the previous 20.
        tracker.scan()
        base_shm, base_files = len(tracker.shm), len(tracker.files)
        assert base_shm >= 1 and base_files >= 1
        for round_ in range(10):
            owner.tell(f"more {path}-r{round_}")
            assert owner.expect() == "done"
            tracker.scan()
        # baseline + 20 live segments; 180 made and removed meanwhile
        assert len(tracker.shm) <= base_shm + 20, (len(tracker.shm), base_shm)
        assert len(tracker.files) <= base_files + 20, (len(tracker.files), base_files, tracker.files)
    finally:
        owner.reap()
        for r in range(10):
            for i in range(20):
                p = f"{path}-r{r}-{i}"
                if os.path.lexists(p):
                    os.unlink(p)
