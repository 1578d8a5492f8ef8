"""Teardown that leaves no process behind and never wedges (issue 21, items 1 and 3): real process
trees, real pidfds, real /proc, and real kernel waits that do not end (a FUSE filesystem whose daemon
never answers: tests/lifecycle/fuse_wedge.py).

A stand-in "main process" (a real child Python process) runs the lifecycle's real teardown code —
``MainLifecycle._die`` (a child's death) or the real SIGTERM watchdog (``build_sigterm_watchdog``)
over a tokenizer-manager stand-in with no requests — over a real tree of processes that it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dspark_harden.lifecycle import controller, proctree, resources

from .fuse_wedge import Wedge

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a stand-in main process: configures the lifecycle, starts the children given in its JSON
#: argument (each prints one JSON line when ready), then runs the real teardown
_MAIN = r"""
import asyncio, json, os, subprocess, sys, time
from dspark_harden.lifecycle import main as L
cfg = json.loads(sys.argv[1])
for name, value in cfg.get("consts", {}).items():
    setattr(L, name, value)
L.MAIN.configure(drain_s=0.0, death_grace_s=0.2, barrier_timeout_s=0.0)
kids = [subprocess.Popen([sys.executable, "-c", code] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True) for code, args in cfg["children"]]
info = [json.loads(k.stdout.readline()) for k in kids]

class TM:  # the tokenizer manager's surface the teardown touches; no request is open
    rid_to_state = {}
    server_status = None
    _subprocess_watchdog = None
    gracefully_exit = True
    _server_stop_hook = None
    asyncio_tasks = set()
    event_loop = None
    def _dispatch_to_scheduler(self, req):
        pass

tm = TM()
import types
L.MAIN.attach(tm, types.SimpleNamespace(**{k: f"ipc://{v}" for k, v in cfg.get("ipc", {}).items()}))
print(json.dumps({"main": os.getpid(), "run_dir": L.MAIN.run_dir, "children": info}), flush=True)
sys.stdin.readline()  # the test says go
if cfg["path"] == "death":
    L.MAIN._die({"role": "scheduler", "message": "DP rank 0 scheduler (pid 1) was killed by SIGKILL"}, "test")
elif cfg["path"] == "block":  # the teardown's own step blocks forever: only the hard deadline ends it
    L.MAIN.hard_exit.arm(cfg["deadline"], 5, "a step that never returns")
    os.stat(cfg["block_on"])
else:
    asyncio.run(L.build_sigterm_watchdog(None)(tm))
"""

#: a scheduler stand-in (named like SGLang's) that started a helper process, as the grammar
#: persistence worker is started by a scheduler
_SCHED = r"""
import json, os, subprocess, sys, time, setproctitle
setproctitle.setproctitle("sglang::scheduler_DP0_TP0")
h = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(json.dumps({"sched": os.getpid(), "helper": h.pid}), flush=True)
time.sleep(600)
"""

#: a child that maps a /dev/shm segment (the leftover its death leaves)
_SHM_CHILD = r"""
import json, mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
print(json.dumps({"shm": os.getpid()}), flush=True)
time.sleep(600)
"""

#: a child whose stat() the FUSE daemon never answers: after SIGKILL it stays in D state (its main
#: thread: what stock's reap check sees as "not reaped", not as a zombie)
_STUCK_CHILD = r"""
import json, os, sys
print(json.dumps({"stuck": os.getpid()}), flush=True)
os.stat(sys.argv[1])
"""

#: a scheduler stand-in wedged the way a GPU driver call wedges one: a worker thread waits for the
#: mmap lock (state D) because another process holds it while its own page fault waits in the kernel
_WEDGED_SCHED = r"""
import json, mmap, os, subprocess, sys, threading, time, setproctitle
setproctitle.setproctitle("sglang::scheduler_DP1_TP1")
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
addr = int(open("/proc/self/maps").read().split(sys.argv[1])[0].rsplit("\n", 1)[-1].split("-")[0], 16)
go = threading.Event()

def writer():  # made before the lock is taken: creating a thread maps its stack
    go.wait()
    while open(f"/proc/{reader.pid}/wchan").read() != "request_wait_answer":
        time.sleep(0.05)
    mmap.mmap(-1, 1 << 20)  # waits for the mmap lock the reader holds: D

threading.Thread(target=writer, daemon=True).start()
reader = subprocess.Popen([sys.executable, "-c",
    "import os, sys; fd = os.open(f'/proc/{sys.argv[1]}/mem', os.O_RDONLY); os.pread(fd, 1, int(sys.argv[2]))",
    str(os.getpid()), str(addr)])
print(json.dumps({"sched": os.getpid(), "reader": reader.pid}), flush=True)
go.set()  # from here on any page fault of this process waits too
time.sleep(600)
"""


class Main:
    """The stand-in main process and pidfds on everything it reported."""

    def __init__(self, path: str, children: list, consts: dict | None = None, env: dict | None = None, **extra):
        cfg = {"path": path, "children": children, "consts": consts or {}, **extra}
        # the log goes to a file: a pipe would stay open as long as any process holding it lives
        # (one that does not die would hold it forever)
        import tempfile

        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [PY, "-c", _MAIN, json.dumps(cfg)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        line = self.proc.stdout.readline()
        assert line, self.read_log()
        self.info = json.loads(line)
        self.handles = {}
        for child in self.info["children"]:
            for role, pid in child.items():
                p = proctree.stat(pid)
                assert p is not None, (role, pid)
                self.handles[role] = proctree.open_handle(p)

    def read_log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def go(self, timeout: float) -> tuple[int, str]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            pytest.fail(f"the teardown did not finish within {timeout} s; log tail:\n{self.read_log()[-4000:]}")
        return code, self.read_log()

    def exited(self, role: str, within: float = 10.0) -> bool:
        return not proctree.wait_exited([self.handles[role]], within)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for h in self.handles.values():
            h.send(signal.SIGKILL)
            h.close()


# -- item 1: nothing the tree started is orphaned ---------------------------------------------------


def test_death_kills_each_scheduler_together_with_the_processes_it_started():
    """Stock order (SIGKILL the schedulers, then walk the tree) orphans a scheduler's helper: it is
    reparented to init before the walk and survives the server. The lifecycle stops and kills the
    whole tree together."""
    m = Main("death", [[_SCHED, []]])
    try:
        code, err = m.go(timeout=120)
        assert code == 3, err[-4000:]
        assert m.exited("sched"), "the scheduler survived the teardown"
        assert m.exited("helper"), "the scheduler's helper process was orphaned and survived the server"
    finally:
        m.cleanup()


def test_an_orphan_of_a_scheduler_that_died_first_is_still_killed():
    """A scheduler killed by the OOM killer orphans its helper before the lifecycle runs; the main
    process is the tree's child subreaper, so the helper is still in its tree and goes with it."""
    m = Main("death", [[_SCHED, []]])
    try:
        m.handles["sched"].send(signal.SIGKILL)
        assert m.exited("sched")
        deadline = time.monotonic() + 10
        helper = m.info["children"][0]["helper"]
        while time.monotonic() < deadline and getattr(proctree.stat(helper), "ppid", None) != m.info["main"]:
            time.sleep(0.05)
        assert proctree.stat(m.info["children"][0]["helper"]).ppid == m.info["main"], (
            "the orphan was not reparented to the main process (PR_SET_CHILD_SUBREAPER)"
        )
        code, err = m.go(timeout=120)
        assert code == 3, err[-4000:]
        assert m.exited("helper"), "the orphaned helper survived the server"
    finally:
        m.cleanup()


_HELPER_OWNER = r"""
import subprocess, sys, time
h = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(h.pid, flush=True)
time.sleep(600)
"""


def _helper_owner(out):
    import subprocess as sp

    p = sp.Popen([PY, "-c", _HELPER_OWNER], stdout=sp.PIPE, text=True)
    out.put(int(p.stdout.readline()))
    p.wait()


def test_controller_stops_a_dead_schedulers_peers_with_their_helpers(tmp_path):
    """The DP controller's monitor stops the surviving schedulers; their helpers go with them."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    peer = ctx.Process(target=_helper_owner, args=(q,), daemon=True)
    dead = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    peer.start()
    dead.start()
    helper_pid = q.get(timeout=60)
    h = proctree.open_handle(proctree.stat(helper_pid))
    try:
        os.kill(dead.pid, signal.SIGKILL)
        codes = []
        controller.monitor([peer, dead], str(tmp_path), exit_fn=codes.append)
        assert codes == [controller.SCHEDULER_DIED_EXIT]
        assert not proctree.wait_exited([h], 10), "the peer's helper was orphaned and survived"
    finally:
        h.send(signal.SIGKILL)
        h.close()


_REUSE = r"""
import json, os, subprocess, time
from dspark_harden.lifecycle import proctree
out = {}
for attempt in range(5):
    victim = subprocess.Popen(["sleep", "600"])
    snapshot = proctree.stat(victim.pid)
    time.sleep(0.05)  # a later clock tick: the start time tells the two processes apart
    victim.kill()
    victim.wait()
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(victim.pid - 1))
    other = subprocess.Popen(["sleep", "600"])
    if other.pid == victim.pid:
        break
    other.kill()
    other.wait()
out["reused"] = other.pid == snapshot.pid
handle = proctree.open_handle(snapshot)
out["stale_handle"] = handle is not None
if handle is not None:
    handle.send(9)
time.sleep(0.2)
out["other_alive"] = other.poll() is None
fresh = proctree.open_handle(proctree.stat(other.pid))
out["fresh_handle"] = fresh is not None
print(json.dumps(out), flush=True)
other.kill()
"""


def test_a_reused_pid_is_never_signalled():
    """In a private PID namespace (deterministic pid reuse through ns_last_pid): a snapshot of a
    process that exited does not yield a handle to the unrelated process that now has its pid."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a PID namespace)")
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", PY, "-c", _REUSE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0 and "unshare" in proc.stderr and "Operation not permitted" in proc.stderr:
        pytest.skip(f"no PID namespaces here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reused"], out
    assert not out["stale_handle"] and out["other_alive"] and out["fresh_handle"], out


# -- item 3: teardown that finishes ----------------------------------------------------------------


def test_shutdown_exits_6_and_cleans_up_when_a_child_will_not_die(tmp_path):
    """Stock ``kill_process_tree`` raises RuntimeError when a killed process is not reaped in time;
    that escaped the shutdown (no cleanup, stock's wrapper SIGKILLs main: exit 137). Here: the
    survivor is named, the leftovers and the run directory are removed, exit code 6."""
    shm = f"/dev/shm/dspark-test-stuck-{os.getpid()}-{time.time_ns()}"
    with Wedge(str(tmp_path / "mnt")) as wedge:
        m = Main(
            "shutdown",
            [[_STUCK_CHILD, [wedge.path("never")]], [_SHM_CHILD, [shm]]],
            consts={"KILL_WAIT_S": 3.0, "SCHEDULER_EXIT_TIMEOUT_S": 0.5, "CHILD_EXIT_TIMEOUT_S": 0.5},
        )
        try:
            code, err = m.go(timeout=240)
            stuck = m.info["children"][0]["stuck"]
            assert code == 6, err[-4000:]
            assert f"did not exit within 3 s of SIGKILL and are left behind: pid {stuck}" in err, err[-4000:]
            assert "state D" in err, err[-4000:]
            assert not os.path.exists(shm), "the dead child's segment was left behind: no cleanup ran"
            assert not os.path.exists(m.info["run_dir"]), "the run directory was left behind"
            assert m.exited("shm")
            assert proctree.stat(stuck).state == "D"  # still blocked in the kernel, as reported
        finally:
            wedge.release()  # ends the kernel wait: the survivor can finish dying
            m.cleanup()
            if os.path.exists(shm):
                os.unlink(shm)


def test_shutdown_never_blocks_on_a_scheduler_wedged_with_its_mmap_lock(tmp_path):
    """Stock waits for the schedulers with ``collect_scheduler_processes``, which reads every child's
    /proc/<pid>/cmdline: that takes the process's mmap lock and blocks with no timeout behind a
    wedged writer, so the shutdown never ends. The lifecycle pins the schedulers by pidfd and reads
    only /proc/<pid>/stat, comm and children; the scan does not read the wedged process's maps."""
    with Wedge(str(tmp_path / "mnt")) as wedge:
        m = Main(
            "shutdown",
            [[_WEDGED_SCHED, [wedge.path("f")]]],
            consts={"KILL_WAIT_S": 3.0, "SCHEDULER_EXIT_TIMEOUT_S": 0.5, "CHILD_EXIT_TIMEOUT_S": 0.5},
        )
        try:
            sched = m.info["children"][0]["sched"]
            deadline = time.monotonic() + 60
            while "D" not in proctree.thread_states(sched) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "D" in proctree.thread_states(sched), "the stand-in scheduler did not wedge"
            code, err = m.go(timeout=120)
            assert code == 6, err[-4000:]  # the reader, stuck in its page fault, does not die
            assert "processes still alive after ShutdownReq, killing them: pid" in err, err[-4000:]
            assert m.exited("sched"), "the wedged scheduler survived"
        finally:
            wedge.release()
            m.cleanup()
            reader = m.info["children"][0]["reader"]
            h = proctree.open_handle(proctree.stat(reader)) if proctree.stat(reader) else None
            if h is not None:
                h.send(signal.SIGKILL)
                h.close()


_D_THREAD = r"""
import os, sys, threading, time
fifo = sys.argv[1]
# posix_spawn's vfork-style parent waits (state D) until the child has exec'd; the child blocks
# opening a FIFO that has no writer: this worker thread stays in D, the main thread sleeps (S)
print("ready", flush=True)
# (posix_spawn keeps the GIL: the main thread then waits for it, in S)
threading.Thread(target=lambda: os.posix_spawn("/bin/true", ["/bin/true"], {},
                 file_actions=[(os.POSIX_SPAWN_OPEN, 3, fifo, os.O_RDONLY, 0)]), daemon=True).start()
time.sleep(600)
"""


def test_scan_does_not_read_a_process_with_a_thread_in_D_state(tmp_path):
    """/proc/<pid>/stat shows only the leader's state; a worker thread blocked in the kernel is what
    a driver call looks like. The scan skips that process's maps (it still reads its fds)."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    child = subprocess.Popen([PY, "-c", _D_THREAD, fifo], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while "D" not in proctree.thread_states(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        states = proctree.thread_states(child.pid)
        assert "D" in states and proctree.stat(child.pid).state != "D", states
        report = resources.ResourceTracker(root=child.pid).scan()
        assert child.pid in report.skipped and "D state" in report.skipped[child.pid], report
    finally:
        try:  # a writer: the spawn's child proceeds, the waiting thread returns
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        child.kill()
        child.wait(10)
        for p in proctree.descendants(os.getpid()):
            if p.name == "true":
                os.kill(p.pid, signal.SIGKILL)


def test_cleanup_is_bounded_when_a_file_operation_hangs(tmp_path):
    """An ipc path on a filesystem that stopped answering (a hung NFS TMPDIR): stock's leftover check
    (``os.path.lexists``) blocks forever; here the cleanup gives up after its time limit, says so, and
    the server still exits with its code."""
    with Wedge(str(tmp_path / "mnt"), interruptible=True) as wedge:
        sock = wedge.path("sock")
        # the server named this ipc path (port_args): the tracker records it at attach; then the
        # filesystem stops answering
        m = Main(
            "death",
            [[_SCHED, []]],
            consts={"CLEANUP_LIMIT_S": 2.0, "SCAN_LIMIT_S": 1.0, "KILL_WAIT_S": 5.0},
            ipc={"tokenizer_ipc_name": sock},
        )
        try:
            wedge.hold_everything()
            t0 = time.monotonic()
            code, err = m.go(timeout=120)
            assert code == 3, err[-4000:]
            assert "removing leftovers did not finish within 3 s" in err, err[-4000:]
            assert time.monotonic() - t0 < 60
            assert m.exited("helper") and m.exited("sched")
        finally:
            wedge.release()
            m.cleanup()


def test_hard_deadline_exits_whatever_blocks(tmp_path):
    """A teardown step that never returns (here a stat on a filesystem that never answers): the hard
    deadline still exits the process with the code it was armed with."""
    with Wedge(str(tmp_path / "mnt"), interruptible=True) as wedge:
        m = Main("block", [], deadline=2.0, block_on=wedge.path("never"))
        try:
            t0 = time.monotonic()
            code, err = m.go(timeout=120)
            assert code == 5, err[-4000:]
            assert "did not finish within its hard deadline" in err and "a step that never returns" in err, err
            assert time.monotonic() - t0 < 60
        finally:
            wedge.release()
            m.cleanup()
