"""Every /health_scheduler outcome against the real SGLang load-snapshot writer and reader.

Snapshots are written with the real ``ShmLoadSnapshotWriter`` (the class every scheduler
publishes with) into a temp file and read back with the real ``ShmLoadSnapshotReader`` (the class
the tokenizer manager holds as ``load_snapshot_reader``). The tokenizer manager itself is a
stand-in (``SimpleNamespace`` with the three attributes the check reads: ``server_status``,
``gracefully_exit``, ``load_snapshot_reader``): a real one needs a running scheduler.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from sglang.srt.managers.load_snapshot import LoadSnapshot, ShmLoadSnapshotReader, ShmLoadSnapshotWriter
from sglang.srt.managers.tokenizer_manager import ServerStatus

from dspark_harden.health import verdict as V

STALE, FUTURE = 30.0, 5.0


@pytest.fixture
def shm(tmp_path):
    path = str(tmp_path / "loads.shm")
    writers: list = []

    def writer(dp_size: int, rank: int) -> ShmLoadSnapshotWriter:
        w = ShmLoadSnapshotWriter(path, dp_size, rank)
        writers.append(w)
        return w

    yield path, writer
    for w in writers:
        w.close()


def tm(reader, status=ServerStatus.Up, exiting=False, workers=2):
    return SimpleNamespace(
        server_status=status, gracefully_exit=exiting, load_snapshot_reader=reader, elastic_worker_count=workers
    )


def check(manager, now=None):
    return V.evaluate_server(
        manager, now_fn=lambda: now if now is not None else time.time(), max_staleness_s=STALE, max_future_skew_s=FUTURE
    )


def publish(w, rank, ts):
    w.write(LoadSnapshot(timestamp=ts, dp_rank=rank, num_running_reqs=1))


def test_healthy_when_every_rank_published_fresh(shm):
    path, writer = shm
    now = time.time()
    for r in range(2):
        publish(writer(2, r), r, now - 0.5)
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    assert (v.ok, v.reason, v.status_code) == (True, V.OK, 200)
    assert set(v.to_dict()["ranks"]) == {"0", "1"}


def test_missing_rank_names_it(shm):
    path, writer = shm
    now = time.time()
    publish(writer(2, 0), 0, now)  # rank 1's slot exists in the file but was never written
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    assert (v.status_code, v.reason, v.bad_ranks) == (503, V.MISSING_RANKS, [1])
    assert "DP rank 1" in v.message


def test_no_snapshot_file_at_all_is_missing_every_rank(tmp_path):
    v = check(tm(ShmLoadSnapshotReader(str(tmp_path / "absent.shm"), 2)))
    assert (v.reason, v.bad_ranks) == (V.MISSING_RANKS, [0, 1])


def test_duplicate_rank(shm):
    path, writer = shm
    now = time.time()
    publish(writer(2, 0), 0, now)
    w1 = writer(2, 1)
    # A slot whose payload names another rank (a misconfigured or corrupted writer). The public
    # write() refuses that, so use the writer's own payload routine, as a buggy writer would.
    w1._write_payload(LoadSnapshot(timestamp=now, dp_rank=0))
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    # rank 1 is missing AND rank 0 is duplicated: missing is reported first, then after
    # rank 1 publishes correctly again the duplicate disappears
    assert v.reason == V.MISSING_RANKS
    snaps = ShmLoadSnapshotReader(path, 2).read_all() + [LoadSnapshot(timestamp=now, dp_rank=1)]
    v2 = V.evaluate_snapshots(snaps, 2, now=now, max_staleness_s=STALE, max_future_skew_s=FUTURE)
    assert (v2.status_code, v2.reason, v2.bad_ranks) == (503, V.DUPLICATE_RANKS, [0])


def test_unexpected_rank(shm):
    path, writer = shm
    now = time.time()
    publish(writer(3, 0), 0, now)
    publish(writer(3, 1), 1, now)
    publish(writer(3, 2), 2, now)
    v = check(tm(ShmLoadSnapshotReader(path, 3), workers=2), now)  # scaled down to 2 ranks
    assert (v.reason, v.bad_ranks) == (V.UNEXPECTED_RANKS, [2])


def test_zero_timestamp_is_the_real_slot_before_first_publish(shm):
    path, writer = shm
    now = time.time()
    publish(writer(2, 0), 0, now)
    writer(2, 1)  # stock writer __init__ writes LoadSnapshot(dp_rank=1) with timestamp 0.0
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    assert (v.status_code, v.reason, v.bad_ranks) == (503, V.NON_POSITIVE_TIMESTAMP, [1])


def test_negative_timestamp(shm):
    path, writer = shm
    now = time.time()
    publish(writer(2, 0), 0, -3.0)
    publish(writer(2, 1), 1, now)
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    assert (v.reason, v.bad_ranks) == (V.NON_POSITIVE_TIMESTAMP, [0])


def test_stale_names_rank(shm):
    path, writer = shm
    now = time.time()
    publish(writer(2, 0), 0, now)
    publish(writer(2, 1), 1, now - STALE - 1)
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    assert (v.status_code, v.reason, v.bad_ranks) == (503, V.STALE, [1])
    assert "DP rank 1" in v.message and "stale" in v.message
    # exactly at the threshold is still fresh
    publish(writer(2, 1), 1, now - STALE)
    assert check(tm(ShmLoadSnapshotReader(path, 2)), now).ok


def test_future_dated(shm):
    path, writer = shm
    now = time.time()
    publish(writer(2, 0), 0, now + FUTURE + 1)
    publish(writer(2, 1), 1, now)
    v = check(tm(ShmLoadSnapshotReader(path, 2)), now)
    assert (v.status_code, v.reason, v.bad_ranks) == (503, V.FUTURE_TIMESTAMP, [0])
    publish(writer(2, 0), 0, now + FUTURE - 0.5)  # small skew tolerated
    assert check(tm(ShmLoadSnapshotReader(path, 2)), now).ok


def test_read_error(shm):
    path, writer = shm
    now = time.time()
    for r in range(2):
        publish(writer(2, r), r, now)
    reader = ShmLoadSnapshotReader(path, 2)
    assert check(tm(reader), now).ok
    reader.mmap.close()  # the mapping goes away under the reader (unmapped / torn down)
    v = check(tm(reader), now)
    assert (v.status_code, v.reason) == (503, V.READ_ERROR)
    assert "ValueError" in v.message


def test_starting_shutting_down_and_no_state(shm):
    path, writer = shm
    now = time.time()
    for r in range(2):
        publish(writer(2, r), r, now)
    reader = ShmLoadSnapshotReader(path, 2)
    assert check(tm(reader, status=ServerStatus.Starting), now).reason == V.STARTING
    assert check(tm(reader, exiting=True), now).reason == V.SHUTTING_DOWN
    assert check(None, now).reason == V.NO_STATE
    for v in (check(tm(reader, status=ServerStatus.Starting), now), check(tm(reader, exiting=True), now), check(None)):
        assert v.status_code == 503 and v.to_dict()["status"] == "unhealthy"


def test_child_died_names_the_rank_before_every_other_check(shm):
    """The lifecycle feature marks the tokenizer manager when a child died (docs/lifecycle.md):
    503 naming it, also while every snapshot is still fresh and the server is shutting down."""
    path, writer = shm
    now = time.time()
    for r in range(2):
        publish(writer(2, r), r, now)
    manager = tm(ShmLoadSnapshotReader(path, 2), exiting=True)
    manager.dspark_harden_fault = {"message": "DP rank 1 scheduler (pid 42) was killed by SIGKILL", "dp_rank": 1}
    v = check(manager, now)
    assert v.reason == V.CHILD_DIED and v.status_code == 503 and v.bad_ranks == [1]
    assert v.message.startswith("DP rank 1 scheduler (pid 42) was killed by SIGKILL")
    manager.dspark_harden_fault = {"message": "detokenizer (pid 7) was killed by SIGKILL", "dp_rank": None}
    assert check(manager, now).bad_ranks == []


DP2_WRITER = r"""
import sys
from dspark_harden.dp2 import board as B
b = B.Board.open(sys.argv[1])
b.publish_stall(rank=0, peer_rank=1, channel="mlp", waited_s=6.0, period_s=3.0,
                message="peer rank 1 (pid 99) alive but has not reached sequence 7 (peer at 6, process state T: stopped)")
print("published", flush=True)
sys.stdin.readline()
b.clear(0)
print("cleared", flush=True)
sys.stdin.readline()
"""


def test_dp2_stalled_names_the_rank_the_other_waits_for(shm):
    """A scheduler blocked in the native DP2 exchange publishes 'rank 0 waits for rank 1' on the DP2
    stall board (a real board, written by a real other process through /proc): 503 naming rank 1 (the
    one not arriving), even while both load snapshots are still fresh; after it clears, 200 again."""
    import subprocess
    import sys

    from dspark_harden.dp2 import board as B

    path, writer = shm
    now = time.time()
    for r in range(2):
        publish(writer(2, r), r, now)
    manager = tm(ShmLoadSnapshotReader(path, 2))
    board = B.Board.create()
    child = subprocess.Popen(
        [sys.executable, "-c", DP2_WRITER, board.spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:

        def check_dp2():
            return V.evaluate_server(
                manager,
                now_fn=lambda: now,
                max_staleness_s=STALE,
                max_future_skew_s=FUTURE,
                dp2_stalls_fn=lambda: B.current_stalls(board),
            )

        assert child.stdout.readline().strip() == "published"
        v = check_dp2()
        assert (v.status_code, v.reason, v.bad_ranks) == (503, V.DP2_STALLED, [1])
        assert v.message.startswith(
            "DP rank 1 stalled: alive but not taking part in the scheduler steps; DP "
            "rank 0 has waited 6.0 s for DP rank 1 (DP2 channel mlp)"
        )
        assert "process state T: stopped" in v.message
        # starting and a dead child still come first
        manager.server_status = ServerStatus.Starting
        assert check_dp2().reason == V.STARTING
        manager.server_status = ServerStatus.Up
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "cleared"
        assert check_dp2().ok
        # an unreadable board is a 503 with its cause, never a silent 200
        v = V.evaluate_server(
            manager,
            now_fn=lambda: now,
            max_staleness_s=STALE,
            max_future_skew_s=FUTURE,
            dp2_stalls_fn=lambda: B.Board.open("4194304999:3:" + "0" * 32).read(),
        )
        assert (v.status_code, v.reason) == (503, V.READ_ERROR) and "DP2 stall board" in v.message
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        board.close()


@pytest.mark.forked  # installs a plugin manager and a board in this process
def test_health_reads_stalls_through_the_dspark_health_stalls_hook(monkeypatch):
    """The health feature never imports dp2: it asks every plugin through ``dspark_health_stalls``.
    The built-in dp2 feature answers from the real stall board its environment names, a third-party
    plugin's answer is added to it, and no board means no stall. (Mutation: the health feature
    calling only the first implementation, or dp2 not implementing the hook, fails this.)"""
    from dspark_harden.core import binder, hookspecs
    from dspark_harden.core.manager import make_manager
    from dspark_harden.dp2 import board as B
    from dspark_harden.health import feature as HF

    class Other:
        @hookspecs.hookimpl
        def dspark_health_stalls(self):
            return [{"rank": 0, "peer_rank": 1, "channel": "x", "waited_s": 2.0, "message": "third-party exchange"}]

    import subprocess
    import sys

    monkeypatch.delenv(B.ENV, raising=False)
    monkeypatch.setattr(B, "CURRENT", None)
    binder.STATE.pm = make_manager(load_extensions=False)
    assert HF._dp2_stalls() == []  # no board: nothing stalled
    board = B.Board.create()
    monkeypatch.setenv(B.ENV, board.spec)
    assert HF._dp2_stalls() == []  # a board, nothing on it
    child = subprocess.Popen(
        [sys.executable, "-c", DP2_WRITER, board.spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "published"
        ours = B.current_stalls(board)
        assert len(ours) == 1 and ours[0]["channel"] == "mlp"
        assert HF._dp2_stalls() == ours  # the dp2 feature's answer, read from the real board
        binder.STATE.pm = make_manager(load_extensions=False, extra=(Other(),))
        both = HF._dp2_stalls()
        assert (
            len(both) == 2
            and ours[0] in both
            and {"rank": 0, "peer_rank": 1, "channel": "x", "waited_s": 2.0, "message": "third-party exchange"} in both
        )
        # an unusable board named by the environment raises (the verdict turns that into a 503)
        monkeypatch.setattr(B, "CURRENT", None)
        monkeypatch.setenv(B.ENV, "4194304999:3:" + "0" * 32)
        with pytest.raises(B.BoardError):
            HF._dp2_stalls()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        board.close()


def test_every_outcome_has_a_test_and_a_metric_label():
    from dspark_harden.core import metrics

    fam = metrics.FAMILIES["dspark_harden_health_scheduler_checks_total"]
    assert {c[0] for c in fam.precreate} == set(V.OUTCOMES)
    src = open(__file__).read()
    for outcome in V.OUTCOMES:
        const = [k for k, v in vars(V).items() if v == outcome and k.isupper()][0]
        assert f"V.{const}" in src, f"no test for outcome {outcome}"
