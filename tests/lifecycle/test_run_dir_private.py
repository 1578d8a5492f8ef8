"""The lifecycle run directory is this server's (issue 21, item 8), with a second uid.

Stock-fork behaviour was ``/tmp/dspark-harden-lifecycle-<pid>`` with ``exist_ok=True``: another user
could create it first, with forged fault records that then named the cause of a death. Now the main
process makes a private directory (``mkdtemp``) and every process that inherits its name checks it
before use.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from dspark_harden.lifecycle import controller, records, scheduler
from dspark_harden.lifecycle.main import MainLifecycle

from .uids import OTHER_UID, SERVER_UID, Proc, need_root, run_as

FORGED = {"pid": 999, "exitcode": -9, "dp_rank": 7, "tp_rank": 7}


@pytest.fixture
def tmp_path():
    """A directory both test uids can reach (pytest's own is under a 0700 root-only directory)."""
    import pathlib
    import shutil

    d = tempfile.mkdtemp(prefix="dspark-test-rundir-")
    os.chmod(d, 0o777)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _forge(conn, directory: str):
    """Another user: pre-create ``directory`` (world-writable) with a forged death record."""
    os.mkdir(directory)
    os.chmod(directory, 0o777)
    with open(os.path.join(directory, "death-999.json"), "w") as f:
        json.dump(FORGED, f)
    with open(os.path.join(directory, "fault-999.json"), "w") as f:
        json.dump({"pid": 999, "type": "RuntimeError", "message": "forged"}, f)
    conn.say()


def _server_main(conn, out_path: str):
    """The server's main process (uid SERVER_UID): waits until the attacker is done, configures."""
    conn.hear()
    os.environ.pop(records.RUN_DIR_ENV, None)
    m = MainLifecycle()
    m.configure(drain_s=0, death_grace_s=1, barrier_timeout_s=1)
    st = os.lstat(m.run_dir)
    cause = m.cause_of([("scheduler_0", 1234, 3)])
    with open(out_path, "w") as f:
        json.dump(
            {
                "run_dir": m.run_dir,
                "uid": st.st_uid,
                "mode": st.st_mode & 0o7777,
                "cause": cause["message"],
                "env": os.environ.get(records.RUN_DIR_ENV),
            },
            f,
        )
    conn.say("done")


def test_a_predictable_run_dir_precreated_by_another_user_is_not_used(tmp_path):
    need_root()
    out = str(tmp_path / "out.json")
    server = Proc(_server_main, out, uid=SERVER_UID)
    attacker = None
    predictable = os.path.join(tempfile.gettempdir(), f"dspark-harden-lifecycle-{server.pid}")
    try:
        attacker = Proc(_forge, predictable, uid=OTHER_UID)
        assert attacker.expect() == "ready"
        server.tell("go")
        assert server.expect() == "done"
        with open(out) as f:
            got = json.load(f)
        assert got["run_dir"] != predictable, got
        assert got["uid"] == SERVER_UID and got["mode"] == 0o700, got
        assert got["env"] == got["run_dir"], got
        assert "DP rank 7" not in got["cause"] and "forged" not in got["cause"], got
        assert got["cause"] == "DP controller (pid 1234) exited with code 3", got
    finally:
        server.reap()
        if attacker is not None:
            attacker.reap()
        import shutil

        shutil.rmtree(predictable, ignore_errors=True)
        for d in os.listdir(tempfile.gettempdir()):
            if d.startswith(f"dspark-harden-lifecycle-{server.pid}-"):
                shutil.rmtree(os.path.join(tempfile.gettempdir(), d), ignore_errors=True)


def _child_with_inherited(directory: str) -> dict:
    """A server child (uid SERVER_UID) whose environment names ``directory``."""
    os.environ[records.RUN_DIR_ENV] = directory
    out = {}
    try:
        records.write(directory, "rank", os.getpid(), {"dp_rank": 0})
        out["write"] = "accepted"
    except records.RunDirError as exc:
        out["write"] = str(exc)
    out["read"] = sorted(records.read(directory, "death"))
    try:
        scheduler.write_rank_record()  # what a scheduler does when the plugin binds in it
        out["scheduler"] = "accepted"
    except records.RunDirError as exc:
        out["scheduler"] = str(exc)
    called = []
    try:
        controller.build_controller_init(lambda self, *a, **k: called.append(1))(object())
        out["controller"] = "accepted"
    except records.RunDirError as exc:
        out["controller"] = str(exc)
    out["controller_stock_ran"] = bool(called)
    return out


def _private_dir_of(uid_dir: str) -> str:
    os.mkdir(uid_dir, 0o700)
    return uid_dir


@pytest.mark.parametrize("case", ["other_users_dir", "world_writable_own_dir", "symlink_to_own_private_dir"])
def test_an_inherited_run_dir_that_is_not_private_is_refused(tmp_path, case):
    """A forged ``DSPARK_HARDEN_LIFECYCLE_RUN_DIR`` in a child's environment: nothing is written
    there, nothing is read from there, a scheduler and the DP controller refuse to start."""
    need_root()
    target = str(tmp_path / "run")
    if case == "other_users_dir":
        attacker = Proc(_forge, target, uid=OTHER_UID)
        assert attacker.expect() == "ready"
        attacker.reap()
        expect = f"owned by uid {OTHER_UID}"
    elif case == "world_writable_own_dir":
        os.mkdir(target)
        with open(os.path.join(target, "death-999.json"), "w") as f:
            json.dump(FORGED, f)
        os.chown(target, SERVER_UID, SERVER_UID)
        os.chmod(target, 0o777)
        expect = "its mode is 0777, not private (0700)"
    else:
        real = str(tmp_path / "real")
        os.mkdir(real)
        with open(os.path.join(real, "death-999.json"), "w") as f:
            json.dump(FORGED, f)
        os.chown(os.path.join(real, "death-999.json"), SERVER_UID, SERVER_UID)
        os.chown(real, SERVER_UID, SERVER_UID)
        os.chmod(real, 0o700)
        os.symlink(real, target)
        expect = "it is a symbolic link"
    got = run_as(SERVER_UID, _child_with_inherited, target)
    for who in ("write", "scheduler", "controller"):
        assert expect in got[who] and records.RUN_DIR_ENV in got[who], (who, got)
    assert got["read"] == [], got
    assert not got["controller_stock_ran"], "the controller spawned its schedulers before the check"
    assert not [n for n in os.listdir(target) if n.startswith("rank-")], os.listdir(target)


def _configure_with_inherited(directory: str) -> dict:
    os.mkdir(directory, 0o700)
    os.environ[records.RUN_DIR_ENV] = directory
    m = MainLifecycle()
    m.configure(drain_s=0, death_grace_s=1, barrier_timeout_s=1)
    out = {"run_dir": m.run_dir, "env": os.environ[records.RUN_DIR_ENV], "owns": m.owns_run_dir}
    os.rmdir(m.run_dir)
    return out


def test_the_main_process_never_adopts_an_inherited_run_dir(tmp_path):
    """Even a private directory of the same uid named in the environment is not this server's (it may
    be another server's, whose records would then be read)."""
    need_root()
    inherited = str(tmp_path / "inherited")
    got = run_as(SERVER_UID, _configure_with_inherited, inherited)
    assert got["run_dir"] != inherited and got["env"] == got["run_dir"] and got["owns"], got


def test_records_round_trip_in_a_private_dir(tmp_path):
    d = records.make_run_dir()
    try:
        assert records.check_run_dir(d) is None
        assert os.stat(d).st_mode & 0o777 == 0o700
        records.write(d, "fault", 42, {"type": "E", "message": "m"})
        assert records.read(d, "fault")[42]["message"] == "m"
        assert os.stat(os.path.join(d, "fault-42.json")).st_mode & 0o777 == 0o600
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


_EXITING_MAIN = r"""
import json, os, sys
from dspark_harden.lifecycle.main import MainLifecycle

m = MainLifecycle()
m.configure(drain_s=0, death_grace_s=1, barrier_timeout_s=1, owns_process=False)
first = m.run_dir
pid = os.fork()
if pid == 0:  # a forked child that ends through the interpreter's exit (atexit runs in it)
    sys.exit(0)
os.waitpid(pid, 0)
after_child = os.path.isdir(first)
os.rmdir(first)  # what Engine.shutdown's cleanup does to the tree's directory
m.next_tree()  # then a fresh one for a later Engine: the process ends without one
print(json.dumps({"first": first, "after_child": after_child, "second": m.run_dir}), flush=True)
"""


def test_a_main_process_leaves_no_run_dir_behind_when_it_exits(tmp_path):
    """The directory configure() and next_tree() make is removed when the process exits: an offline
    Engine's process, after its last Engine.shutdown, held a fresh empty directory that nothing removed
    (hundreds of ``/tmp/dspark-harden-lifecycle-<pid>-*`` after a day of test runs). A forked child's
    exit leaves its parent's directory alone. A real interpreter exit, not a call of the handler."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop(records.RUN_DIR_ENV, None)
    out = subprocess.run([sys.executable, "-c", _EXITING_MAIN], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_child"], "a forked child's exit removed its parent's run directory"
    assert got["second"] != got["first"] and got["second"].startswith(str(tmp_path)), got
    assert not os.path.exists(got["second"]), "the run directory next_tree() made outlived its process"
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
