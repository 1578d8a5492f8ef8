"""Issue 21 (grammar part): no wedged host. Real processes, real signals, real flock locks held by
stopped processes, a real second uid (forked children that setuid), real full and read-only file
systems (tmpfs in a private mount namespace), real xgrammar.

1. The persistence helper dies with its scheduler (PR_SET_PDEATHSIG + getppid checks), is never
   paused while it holds a lock, every disk-cache lock is bounded, and a protocol line that is not
   its job's restarts it (library output cannot reach the protocol at all).
2. Transient failures (SIGKILL from outside, a starved deadline, lock waits) store no marker.
4. An unusable cache root degrades to memory-only (WARNING + metric); the ledger converges; an
   entry above this server's limit is not read; ``check`` reports the root.
8. The root and namespace directories must be this uid's and not group/world-writable; entries
   and locks are never opened through a symbolic link.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dspark_harden.core import metrics as M
from dspark_harden.grammar import disk, xgr
from dspark_harden.grammar import feature as F

from . import _faults as X
from .conftest import make_settings, persistent_backend, stock_backend

HERE = os.path.dirname(os.path.abspath(__file__))
ORPHAN_PROBE = os.path.join(HERE, "_orphan_probe.py")
FAKE_HELPER = os.path.join(HERE, "_fake_helper.py")
LOG = "dspark_harden.grammar"


@pytest.fixture
def shared_tmp():
    """A directory a second uid can reach (pytest's tmp_path sits below a 0700 directory)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="dspark-uid-test-")
    os.chmod(d, 0o755)
    try:
        yield __import__("pathlib").Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _counter(name: str, *labels: str) -> float:
    try:
        return M.get(name).labels("none", *labels)._value.get()
    except KeyError:  # a family this code base does not declare (yet): the assertions on it fail
        return float("nan")


def _namespace(root, scope, **kw) -> disk.Namespace:
    known = inspect.signature(disk.Namespace).parameters
    return disk.Namespace(
        str(root), scope, max_bytes=kw.pop("max_bytes", 1 << 40), **{k: v for k, v in kw.items() if k in known}
    )


def _info(tok):
    import xgrammar as xg

    return xg.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])


def _scope(info, tok) -> dict:
    return xgr.scope_for(info, vocab_size=len(tok), override_stop_tokens=None, compiler={"test": True})


def _compiler(tok, root, *, ratio: float = 1e9, slots=None, max_entry: int = 256 << 20, lock_timeout_s=None, **persist):
    """A PersistentCompiler over ``root`` (what install_persistent_compiler builds, with test knobs)."""
    import xgrammar as xg

    info = _info(tok)
    ns_kw = {} if lock_timeout_s is None else {"lock_timeout_s": lock_timeout_s}
    if lock_timeout_s is not None:
        persist["lock_timeout_s"] = lock_timeout_s
    ns = _namespace(root, _scope(info, tok), **ns_kw)
    return xgr.PersistentCompiler(
        xg.GrammarCompiler(info, cache_enabled=False),
        info,
        ns,
        xgr.Policy(load_ratio=ratio, max_entry_bytes=max_entry),
        slots=slots,
        persist=X.persist_settings(**persist),
    )


def _flush(pc, timeout: float = 300) -> None:
    """Wait for every publication, failing (never hanging) when it does not finish in time."""
    t = threading.Thread(target=pc.flush, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"publication did not finish within {timeout:g} s (wedged on a lock?)"


def _kinds(ns) -> dict:
    out = {}
    for e in ns.iter_entries():
        entry = disk.decode_entry(e.path, open(e.path, "rb").read(), ns.scope_hex, None)
        out[e.name[: -len(disk.ENTRY_SUFFIX)]] = entry.marker.reason if entry.marker else "serialized"
    return out


def _install_timed(backend, settings, limit: float = 60.0) -> float:
    """Seconds install_persistent_compiler took; fails (never hangs) past ``limit``."""
    box = {}

    def run():
        t = time.monotonic()
        try:
            F.install_persistent_compiler(backend, settings)
        except BaseException as exc:  # noqa: BLE001
            box["exc"] = exc
        box["dt"] = time.monotonic() - t

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    assert not th.is_alive(), f"backend start-up still blocked after {limit:g} s"
    if "exc" in box:
        raise box["exc"]
    return box["dt"]


# ---------------------------------------------------------------------------------------------
# item 1: the helper never outlives its scheduler, never holds a lock while paused, bounded locks


@pytest.mark.timeout(600)
def test_paused_helper_dies_with_its_sigkilled_scheduler_and_the_root_stays_usable(hf_tokenizer, cache_dir):
    """A scheduler-role process whose helper is paused (SIGSTOP: every compile slot busy) is SIGKILLed
    (the OOM killer, MainLifecycle._die, the controller's monitor). 5 s later no helper process exists
    (today it stays stopped forever, state T, ppid 1) and a fresh backend on the same root is ready in
    under a second and publishes."""
    probe = subprocess.Popen([sys.executable, ORPHAN_PROBE, str(cache_dir)], stdout=subprocess.PIPE, text=True)
    helper = None
    try:
        line = probe.stdout.readline()
        assert line, f"probe exited {probe.wait()} without a report"
        helper = json.loads(line)["helper"]
        X.wait_for(lambda: X.proc_state(helper) == "T", 30, "the helper to be paused")
        assert X.proc_ppid(helper) == probe.pid
        probe.send_signal(signal.SIGKILL)
        probe.wait(timeout=30)
        time.sleep(5)
        assert not X.alive(helper), (
            f"helper {helper} outlived its SIGKILLed scheduler: state "
            f"{X.proc_state(helper)}, ppid {X.proc_ppid(helper)}"
        )
    finally:
        X.end_process(probe)
        if helper is not None and X.alive(helper):
            X.sigkill(helper)
    backend = stock_backend(hf_tokenizer)
    settings = make_settings(cache_dir, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9")
    dt = _install_timed(backend, settings)
    assert dt < 1.0, f"fresh backend took {dt:.2f} s to open the cache root"
    pc = backend.grammar_compiler
    assert isinstance(pc, xgr.PersistentCompiler)
    pc.compile_regex("orphan-[a-z]{3}[0-9]{2}")
    _flush(pc)
    key = disk.key_digest(["regex", "orphan-[a-z]{3}[0-9]{2}"])
    assert pc.persister.outcomes[key]["status"] == "published", pc.persister.outcomes
    assert pc.ns.read_ledger() == pc.ns.scan_bytes()
    pc.close()


@pytest.mark.timeout(600)
def test_stopped_ledger_lock_holder_does_not_stop_a_new_server(hf_tokenizer, cache_dir):
    """A process that holds ledger.lock and is stopped (today: every later Namespace() blocks forever):
    a new backend starts at once, even when the ledger is missing and would have to be created under
    that lock; its requests are served; the publication fails after the bounded lock wait (WARNING,
    counted, no marker); `grammar-cache prune` reports the holder instead of hanging; once the
    holder is gone, publication works and the ledger is exact."""
    first = persistent_backend(hf_tokenizer, cache_dir, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9").grammar_compiler
    first.compile_regex("held-[a-z]+")
    _flush(first)
    ns = first.ns
    first.close()
    os.unlink(ns.ledger_path)  # a new server must (re)create it: today under ledger.lock, blocking
    holder = X.stopped_lock_holder(os.path.join(ns.path, "ledger.lock"))
    try:
        backend = stock_backend(hf_tokenizer)
        settings = make_settings(
            cache_dir,
            DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9",
            DSPARK_HARDEN_GRAMMAR_DISK_LOCK_TIMEOUT="0.5",
            DSPARK_HARDEN_GRAMMAR_DISK_HELPER_RETRIES="0",
        )
        dt = _install_timed(backend, settings)
        assert dt < 1.0, f"start-up took {dt:.2f} s"
        pc = backend.grammar_compiler
        assert isinstance(pc, xgr.PersistentCompiler), "the disk cache itself is fine: only a lock is held"
        before = _counter("dspark_harden_grammar_disk_errors_total", "lock_timeout")
        pc.compile_regex("new-[0-9]+")
        assert xgr.take_resolution().source == "compile"
        _flush(pc)
        key = disk.key_digest(["regex", "new-[0-9]+"])
        out = pc.persister.outcomes[key]
        assert out.get("transient") == "lock_timeout" and f"held by pid {holder.pid}" in out["error"], out
        assert not os.path.lexists(ns.entry_path(key))  # nothing published, no marker
        assert _counter("dspark_harden_grammar_disk_errors_total", "lock_timeout") == before + 1
        env = {**os.environ, "DSPARK_HARDEN_GRAMMAR_DISK_LOCK_TIMEOUT": "0.5"}
        r = subprocess.run(
            [sys.executable, "-m", "dspark_harden", "grammar-cache", "prune", "--dir", str(cache_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 1 and f"held by pid {holder.pid}" in r.stdout, r.stdout + r.stderr
    finally:
        X.end_process(holder)
    pc.compile_regex("after-[0-9]+")
    _flush(pc)
    assert pc.persister.outcomes[disk.key_digest(["regex", "after-[0-9]+"])]["status"] == "published"
    assert pc.ns.read_ledger() == pc.ns.scan_bytes()
    pc.close()


def test_helper_exits_at_once_when_its_parent_is_not_the_given_pid():
    """The parent may die before the helper sets PR_SET_PDEATHSIG: it compares getppid() with the
    pid it was given and exits (75) instead of running unparented."""
    r, w = os.pipe()
    try:
        t = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dspark_harden.grammar.persist_worker",
                "--parent-pid",
                "1",
                "--proto-fds",
                f"{r},{w}",
            ],
            pass_fds=(r, w),
            timeout=120,
            capture_output=True,
        )
        assert proc.returncode == 75, proc.stderr
        assert time.monotonic() - t < 60
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.timeout(600)
def test_helper_is_not_paused_in_its_lock_phase(hf_tokenizer, cache_dir):
    """Every slot fills the moment the helper asks to enter its publish (lock) phase: it is not
    paused there (a paused helper would hold the entry lock and ledger.lock), it publishes, and the
    slots pause it again for the next job's compile."""

    class FillOnPublish(X.PausingSlots):
        def helper_publishing(self):
            super().helper_publishing()
            for _ in range(self.limit - self.active):
                self.__enter__()
                self.held += 1

    slots = FillOnPublish(1, pause=0)
    pc = _compiler(hf_tokenizer, cache_dir, slots=slots)
    pc.compile_regex("lockphase-[a-z]+")
    _flush(pc)
    key = disk.key_digest(["regex", "lockphase-[a-z]+"])
    assert pc.persister.outcomes[key]["status"] == "published" and slots.held == 1 and slots.pauses == 0
    slots.release()
    pc.close()


@pytest.mark.timeout(600)
def test_library_output_cannot_shift_results(hf_tokenizer, cache_dir, tmp_path, monkeypatch):
    """A library inside the helper prints (a JSON log line from Python, a result-shaped line from C)
    on every compile. Today those lines are read as protocol: each job gets the previous line's
    result. Now the protocol runs on private descriptors: every job's outcome is its own, tagged
    with its own key."""
    X.fault_env(monkeypatch, tmp_path, "print")
    pc = _compiler(hf_tokenizer, cache_dir)
    rx = [f"chatty-{i}-[a-z]{{{i + 1}}}" for i in range(3)]
    for r in rx:
        pc.compile_regex(r)
    _flush(pc)
    for r in rx:
        key = disk.key_digest(["regex", r])
        out = pc.persister.outcomes[key]
        assert out.get("status") == "published" and out.get("key_hex") == key, (r, out)
    assert set(_kinds(pc.ns)) == {disk.key_digest(["regex", r]) for r in rx}
    assert pc.persister.helper.starts == 1
    pc.close()


@pytest.mark.parametrize("mode", ["wrong_key", "garbage"])
def test_protocol_error_restarts_the_helper(cache_dir, tmp_path, mode):
    """A line tagged with another job's key (what a shifted stream looks like), or one that is not
    JSON: the helper is killed and restarted, the job is retried, nothing lands on the wrong key."""
    from dspark_harden.grammar.persist import CompileSlots, Persister, PersistSettings

    ns = disk.Namespace(str(cache_dir), {"test": "protocol"}, max_bytes=1 << 30)
    before = _counter("dspark_harden_grammar_disk_errors_total", "protocol")
    p = Persister(
        ns,
        {},
        PersistSettings(retry_delay_s=0.05, start_timeout_s=60),
        CompileSlots(1),
        helper_argv=[sys.executable, FAKE_HELPER, str(tmp_path / "state"), mode],
    )
    key = "ab" * 32
    try:
        assert p.submit(key, ["regex", "x"], 0.01)
        assert p.flush(timeout=120)
        assert p.outcomes[key]["status"] == "published" and p.outcomes[key]["key_hex"] == key, p.outcomes
        assert p.helper.starts == 2 and p.transient["protocol"] == 1
        assert _counter("dspark_harden_grammar_disk_errors_total", "protocol") == before + 1
    finally:
        p.close()  # the fake helper has no PR_SET_PDEATHSIG: a failed assertion must not leave it running


def test_a_deadlocked_helper_is_replaced_long_before_its_wall_limit(cache_dir, tmp_path):
    """The helper blocks forever mid-job with every thread asleep and no CPU (found in CI: the real
    helper's compile hung in xgrammar's thread pool after an allocation failure under its address-space
    cap, and only the 4x-deadline wall limit -- 8 minutes by default -- would have ended it). With a
    deadline of 600 s (wall limit 40 min) and ``stuck_s`` 1 s, it is killed as ``stuck``, nothing is
    stored for the key, and the retry in a new helper publishes it."""
    from dspark_harden.grammar.persist import CompileSlots, Persister

    ns = disk.Namespace(str(cache_dir), {"test": "stuck"}, max_bytes=1 << 30)
    before = _counter("dspark_harden_grammar_disk_helper_transient_total", "stuck")
    p = Persister(
        ns,
        {},
        X.persist_settings(retry_delay_s=0.05, start_timeout_s=60, deadline_s=600.0, stuck_s=1.0),
        CompileSlots(1),
        helper_argv=[sys.executable, FAKE_HELPER, str(tmp_path / "state"), "deadlock"],
    )
    key = "cd" * 32
    try:
        assert p.submit(key, ["regex", "x"], 0.01)
        assert p.flush(timeout=120), p.outcomes  # the wall limit (2,400 s) would not end it in time
        assert p.outcomes[key]["status"] == "published", p.outcomes
        assert p.helper.starts == 2 and {c: n for c, n in p.transient.items() if n} == {"stuck": 1}, (
            p.helper.starts,
            p.transient,
        )
        assert _counter("dspark_harden_grammar_disk_helper_transient_total", "stuck") == before + 1
    finally:
        p.close()


# ---------------------------------------------------------------------------------------------
# item 2: transient failures never become permanent markers


def _stop_idle_helper(pc) -> int:
    """Run one job so a helper is up, then SIGSTOP it from outside (the parent does not know)."""
    pc.compile_regex("warm-[a-z]{2}")
    _flush(pc)
    pid = pc.persister.helper.proc.pid
    os.kill(pid, signal.SIGSTOP)
    X.wait_for(lambda: X.proc_state(pid) == "T", 30, "the helper to stop")
    return pid


@pytest.mark.timeout(600)
def test_sigkill_from_outside_stores_no_marker_and_is_retried(hf_tokenizer, cache_dir):
    """The helper is SIGKILLed mid-job by something else (the OOM killer under host pressure): today
    that stores a permanent helper_failed (or, during serialize, memory_limit) marker. Now nothing
    is stored; the job is retried and the grammar is persisted serialized."""
    pc = _compiler(hf_tokenizer, cache_dir, retries=2, retry_delay_s=0.2)
    pid = _stop_idle_helper(pc)
    pc.compile_regex("victim-[0-9]{4}")
    X.wait_for(lambda: pc.slots._helper_pid == pid, 60, "the job to reach the helper")
    X.sigkill(pid)
    _flush(pc)
    key = disk.key_digest(["regex", "victim-[0-9]{4}"])
    assert _kinds(pc.ns).get(key) == "serialized", (_kinds(pc.ns), pc.persister.outcomes.get(key))
    assert pc.persister.transient["killed"] == 1
    pc.close()


@pytest.mark.timeout(600)
def test_deadline_of_a_starved_helper_stores_no_marker(hf_tokenizer, cache_dir):
    """The helper passes its deadline without running (host load, a frozen cgroup: here SIGSTOP from
    outside): today a permanent deadline marker. Now the deadline is the job's CPU time, and a job
    killed after 4x its deadline in wall time without using it stores nothing (retries 0: the job is
    dropped, counted)."""
    # stuck_s below the wall limit: a stopped helper (T) is starved, never taken for a deadlocked one
    pc = _compiler(hf_tokenizer, cache_dir, deadline_s=1.0, retries=0, stuck_s=0.5)
    pid = _stop_idle_helper(pc)
    pc.compile_regex("starved-[0-9]{4}")
    _flush(pc)
    key = disk.key_digest(["regex", "starved-[0-9]{4}"])
    assert key not in _kinds(pc.ns), _kinds(pc.ns)
    out = pc.persister.outcomes[key]
    assert out.get("transient") == "starved" and out["cpu_s"] < 0.5 and out["running_s"] > 1.0, out
    assert pc.persister.skipped["retries_exhausted"] == 1
    X.sigkill(pid)
    pc.close()


@pytest.mark.timeout(600)
def test_deadline_never_counts_a_lock_wait(hf_tokenizer, cache_dir):
    """ledger.lock is held by a stopped process longer than the helper's deadline. Today the helper
    waits for it inside its deadline, is killed and a deadline marker is stored (and the parent then
    blocks on the same lock forever). Now the wait is bounded by the lock timeout, outside the
    deadline: no kill, no marker, a lock_timeout outcome."""
    pc = _compiler(hf_tokenizer, cache_dir, deadline_s=2.0, retries=0, lock_timeout_s=4.0)
    pc.compile_regex("warm-[a-z]{2}")
    _flush(pc)
    holder = X.stopped_lock_holder(os.path.join(pc.ns.path, "ledger.lock"))
    try:
        pc.compile_regex("waits-[0-9]{4}")
        _flush(pc, timeout=60)
    finally:
        X.end_process(holder)
    key = disk.key_digest(["regex", "waits-[0-9]{4}"])
    out = pc.persister.outcomes[key]
    assert out.get("transient") == "lock_timeout" and out["status"] == "lock_timeout", out
    assert key not in _kinds(pc.ns)
    pc.close()


@pytest.mark.timeout(600)
def test_crash_on_every_attempt_stores_helper_failed_only_after_the_retries(
    hf_tokenizer, cache_dir, tmp_path, monkeypatch
):
    """A crash (abort) reproduced on every attempt is the grammar's: a helper_failed marker, but only
    after the retries; other grammars are persisted by the restarted helper."""
    X.fault_env(monkeypatch, tmp_path, "abort")
    pc = _compiler(hf_tokenizer, cache_dir, retries=1, retry_delay_s=0.1)
    pc.compile_regex("crash-[a-z]+")
    pc.compile_regex("fine-[a-z]+")
    _flush(pc)
    kinds = _kinds(pc.ns)
    assert kinds[disk.key_digest(["regex", "crash-[a-z]+"])] == "helper_failed", kinds
    assert kinds[disk.key_digest(["regex", "fine-[a-z]+"])] == "serialized"
    assert pc.persister.transient["crashed"] == 2  # the first attempt and its one retry
    pc.close()


@pytest.mark.timeout(600)
def test_bad_alloc_abort_is_a_measured_memory_limit(hf_tokenizer, cache_dir, tmp_path, monkeypatch):
    """An abort whose output shows std::bad_alloc (an allocation failed under the helper's own
    address-space cap) is the grammar's cost: a memory_limit marker at once, no retry."""
    X.fault_env(monkeypatch, tmp_path, "badalloc")
    pc = _compiler(hf_tokenizer, cache_dir, retries=2, retry_delay_s=0.1)
    pc.compile_regex("crash-[0-9]+")
    _flush(pc)
    assert _kinds(pc.ns)[disk.key_digest(["regex", "crash-[0-9]+"])] == "memory_limit"
    assert sum(pc.persister.transient.values()) == 0
    pc.close()


# ---------------------------------------------------------------------------------------------
# item 4: the disk cache is never a startup dependency


def _degrades(backend, settings, reason: str, caplog) -> str:
    """Run install_persistent_compiler; assert memory-only + WARNING naming the root + metric."""
    before = _counter("dspark_harden_grammar_disk_degraded_total", reason)
    with caplog.at_level(logging.WARNING, logger=LOG):
        F.install_persistent_compiler(backend, settings)
    assert not isinstance(backend.grammar_compiler, xgr.PersistentCompiler)
    msgs = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert msgs and settings[F.DISK_DIR] in msgs[-1] and f"({reason}:" in msgs[-1], msgs
    assert _counter("dspark_harden_grammar_disk_degraded_total", reason) == before + 1
    assert M.get("dspark_harden_grammar_disk_cache_enabled").labels("none")._value.get() == 0
    return msgs[-1]


def _install_report(backend, settings) -> dict:
    """For forked children: install_persistent_compiler, then what it produced and logged. (Call
    xgr.xgrammar_version() before forking a second uid's child: it cannot read the venv's metadata.)"""
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger(LOG).addHandler(handler)
    logging.getLogger(LOG).setLevel(logging.INFO)
    F.install_persistent_compiler(backend, settings)
    return {"compiler": type(backend.grammar_compiler).__name__, "log": records}


def _assert_memory_only(report: dict, root, reason: str) -> None:
    assert report["compiler"] != "PersistentCompiler", report
    msgs = [m for m in report["log"] if "unusable" in m]
    assert msgs and str(root) in msgs[0] and f"({reason}:" in msgs[0], report


def test_permission_denied_root_degrades_to_memory_only(hf_tokenizer, shared_tmp):
    """A second uid whose own cache root it may not write (mode 0500): memory-only with a WARNING
    naming the root and the reason; today startup fails with PermissionError."""
    root = shared_tmp / "ro-root"
    root.mkdir(mode=0o500)
    os.chown(root, X.SECOND_UID, X.SECOND_UID)
    backend = stock_backend(hf_tokenizer)
    settings = make_settings(root)
    xgr.xgrammar_version()  # read (and cached) here: the second uid cannot read the venv's metadata
    report = X.in_child(lambda: _install_report(backend, settings), uid=X.SECOND_UID)
    _assert_memory_only(report, root, "permission")


def _in_tmpfs(root, options: str, fn, readonly: bool = False):
    def run():
        X.private_mount_namespace()
        X.mount_tmpfs(str(root), options, readonly)
        return fn()

    return X.in_child(run)


def test_read_only_root_degrades_to_memory_only(hf_tokenizer, tmp_path):
    root = tmp_path / "rofs"
    root.mkdir(mode=0o700)
    backend = stock_backend(hf_tokenizer)
    settings = make_settings(root)
    report = _in_tmpfs(root, "size=1m,mode=0700", lambda: _install_report(backend, settings), readonly=True)
    _assert_memory_only(report, root, "read_only")


def test_new_scope_on_a_full_disk_degrades_to_memory_only(hf_tokenizer, tmp_path):
    root = tmp_path / "fullfs"
    root.mkdir(mode=0o700)
    backend = stock_backend(hf_tokenizer)
    settings = make_settings(root)

    def full_then_install():
        fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        rep = _install_report(backend, settings)
        rep["temp_files"] = [n for _, _, fs in os.walk(root) for n in fs if n.startswith(disk.TMP_PREFIX)]
        return rep

    report = _in_tmpfs(root, "size=64k,mode=0700", full_then_install)
    _assert_memory_only(report, root, "no_space")
    assert report["temp_files"] == []


def _entry(ns, key: str, size: int) -> bytes:
    payload = os.urandom(size - disk.HEADER_SIZE - disk.TRAILER_SIZE)
    return disk.encode_entry(ns.scope_hex, key, disk.KIND_SERIALIZED, payload)


def test_ledger_converges_after_enospc_between_rename_and_ledger(tmp_path):
    """The disk fills between the entry's rename and the ledger write (today: the entry stays,
    uncounted, forever). The next ledger holder recomputes: the ledger equals the entries again."""
    root = tmp_path / "ledgerfs"
    root.mkdir(mode=0o700)

    def scenario():
        ns = disk.Namespace(str(root), {"test": "enospc"}, max_bytes=1 << 30)
        ns.publish("a1" * 32, _entry(ns, "a1" * 32, 4096))
        free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
        with open(os.path.join(root, "filler"), "wb") as fh:
            fh.write(b"\0" * (free - 2 * 4096))  # room for the next entry's temp file, not for a ledger
        failed = ""
        try:
            ns.publish("b2" * 32, _entry(ns, "b2" * 32, 2 * 4096))
        except OSError as exc:
            failed = str(exc)
        os.unlink(os.path.join(root, "filler"))
        ns.publish("c3" * 32, _entry(ns, "c3" * 32, 4096))
        fresh = disk.Namespace(str(root), {"test": "enospc"}, max_bytes=1 << 30)
        return {"failed": failed, "ledger": fresh.read_ledger(), "scan": fresh.scan_bytes()}

    out = _in_tmpfs(root, "size=256k,mode=0700", scenario)
    assert "No space" in out["failed"], out
    assert out["ledger"] == out["scan"], out


_PUBLISHER = """
import os, sys
from dspark_harden.grammar import disk
ns = disk.Namespace(sys.argv[1], {"test": "kills"}, max_bytes=1 << 30)
print("ready", flush=True)
i = 0
while True:
    key = os.urandom(32).hex()
    payload = os.urandom(int(sys.argv[2]) + i % 7)
    ns.publish(key, disk.encode_entry(ns.scope_hex, key, disk.KIND_SERIALIZED, payload))
    i += 1
"""


@pytest.mark.timeout(600)
def test_ledger_converges_after_a_kill_between_rename_and_ledger(tmp_path):
    """A publisher is SIGKILLed while its entry is renamed in but not yet counted (the test watches
    for exactly that state: entries on disk exceed the ledger, and kills then; the state is checked
    again after the kill, so only a kill that really landed in the window counts). Today the entry
    stays uncounted forever; now the next publication by another process recomputes the ledger."""
    root = tmp_path / "kills"
    root.mkdir()
    scope = {"test": "kills"}
    caught = 0
    for _attempt in range(40):
        p = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(root), "3000"], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            ns = disk.Namespace(str(root), scope, max_bytes=1 << 30, create=False)
            end = time.monotonic() + 10
            while time.monotonic() < end:
                try:
                    if ns.scan_bytes() > ns.read_ledger():  # an entry is in, its bytes not yet counted
                        p.send_signal(signal.SIGKILL)
                        break
                except disk.GrammarCacheError:
                    pass
        finally:
            X.end_process(p)
        if ns.scan_bytes() == ns.read_ledger():
            continue  # the kill landed outside the window: try again
        caught += 1
        fresh = disk.Namespace(str(root), scope, max_bytes=1 << 30)
        key = os.urandom(32).hex()
        fresh.publish(key, disk.encode_entry(fresh.scope_hex, key, disk.KIND_SERIALIZED, b"x" * 100))
        assert fresh.read_ledger() == fresh.scan_bytes(), f"ledger did not converge after kill {caught}"
        if caught >= 3:
            break
    assert caught >= 1, "no kill landed between an entry's rename and its ledger update in 40 attempts"


def test_entry_above_this_servers_limit_is_not_read(hf_tokenizer, cache_dir):
    """A cache shared with a server whose DISK_MAX_ENTRY_BYTES is larger: this server does not load an
    entry above its own limit (today it does); it compiles locally (source oversized)."""
    writer = _compiler(hf_tokenizer, cache_dir)
    writer.compile_regex("big-[a-z]{1,8}[0-9]{3}")
    _flush(writer)
    key = disk.key_digest(["regex", "big-[a-z]{1,8}[0-9]{3}"])
    size = os.path.getsize(writer.ns.entry_path(key))
    writer.close()
    reader = _compiler(hf_tokenizer, cache_dir, max_entry=(size - disk.HEADER_SIZE - disk.TRAILER_SIZE) // 2)
    reader.compile_regex("big-[a-z]{1,8}[0-9]{3}")
    res = xgr.take_resolution()
    assert res.source == "oversized" and "deserialize" not in res.phases and reader.native_compiles == 1
    _flush(reader)
    assert os.path.getsize(reader.ns.entry_path(key)) == size  # left alone for the server it fits
    reader.close()


def _bound_report(settings):
    from dspark_harden.core.binder import BindReport, FeatureStatus
    from dspark_harden.core.patch import Role

    report = BindReport(
        role="scheduler",
        sglang_version="0.5.23",
        features=[FeatureStatus(name=F.FEATURE, area="grammar", status="bound")],
    )
    F.dspark_process_bound(role=Role.SCHEDULER, settings=settings, report=report)
    return report.features[0].detail


def test_check_reports_the_cache_root(tmp_path):
    good = tmp_path / "good"
    assert "usable" in _bound_report(make_settings(good))
    bad = tmp_path / "foreign"
    bad.mkdir()
    os.chown(bad, X.SECOND_UID, X.SECOND_UID)
    detail = _bound_report(make_settings(bad))
    assert f"disk cache {bad} unusable (unsafe:" in detail and f"owned by uid {X.SECOND_UID}" in detail, detail
    assert "memory-only" in detail


# ---------------------------------------------------------------------------------------------
# item 8: the cache must be this server's


def test_root_owned_by_another_uid_is_refused(hf_tokenizer, tmp_path, caplog):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, X.SECOND_UID, X.SECOND_UID)
    msg = _degrades(stock_backend(hf_tokenizer), make_settings(root), "unsafe", caplog)
    assert f"owned by uid {X.SECOND_UID}" in msg


def _planted(tok, root_ns_scope_hex: str, victim: str, served: str) -> bytes:
    """A well-formed, checksummed entry for grammar ``victim`` whose payload is grammar ``served``."""
    import xgrammar as xg

    cg = xg.GrammarCompiler(_info(tok), cache_enabled=False).compile_regex(served)
    return disk.encode_entry(
        root_ns_scope_hex, disk.key_digest(["regex", victim]), disk.KIND_SERIALIZED, cg.serialize_json().encode()
    )


def _serves_own_grammar(tok, backend, victim: str) -> None:
    import xgrammar as xg

    cg = backend.grammar_compiler.compile_regex(victim)
    ref = xg.GrammarCompiler(_info(tok), cache_enabled=False).compile_regex(victim)
    assert str(cg.grammar) == str(ref.grammar), "served a grammar another uid planted"


def _backend_scope(tok, backend) -> dict:
    return xgr.scope_for(
        backend._tokenizer_info,
        vocab_size=backend.vocab_size,
        override_stop_tokens=backend.override_stop_tokens,
        compiler={"any_whitespace": bool(backend.any_whitespace), "max_whitespace_cnt": backend.max_whitespace_cnt},
    )


@pytest.mark.parametrize("where", ["world_writable", "namespace_of_another_uid"])
def test_entry_planted_by_another_uid_is_never_served(hf_tokenizer, shared_tmp, caplog, where):
    """Another uid who can write the cache plants a checksummed entry that serves `[a-z]+` for the
    schema `[0-9]+` (the model could then emit output outside its schema; a checksum is not a
    signature). Today it is served; now the server refuses the cache and compiles its own grammar."""
    root = shared_tmp / where
    root.mkdir(mode=0o755)
    backend = stock_backend(hf_tokenizer)
    scope = _backend_scope(hf_tokenizer, backend)
    scope_hex = disk.scope_digest_of(scope)
    data = _planted(hf_tokenizer, scope_hex, "[0-9]+", "[a-z]+")
    ns_dir = root / scope_hex
    if where == "world_writable":
        # every directory is this server's own, but world-writable (an operator's `chmod -R 777`)
        for d in (ns_dir, ns_dir / "entries", ns_dir / "locks"):
            d.mkdir(mode=0o777)
            os.chmod(d, 0o777)
        os.chmod(root, 0o777)
    else:
        ns_dir.mkdir(mode=0o755)
        os.chown(ns_dir, X.SECOND_UID, X.SECOND_UID)
    key = disk.key_digest(["regex", "[0-9]+"])

    def plant():  # as the second uid: writes files only (directories it creates are its own)
        os.makedirs(ns_dir / "entries", mode=0o755, exist_ok=True)
        os.makedirs(ns_dir / "locks", mode=0o755, exist_ok=True)
        (ns_dir / "scope.json").write_text(json.dumps(scope, sort_keys=True, indent=1))
        (ns_dir / "ledger").write_bytes(disk.encode_ledger(len(data)))
        (ns_dir / "entries" / (key + disk.ENTRY_SUFFIX)).write_bytes(data)
        return os.stat(ns_dir / "entries" / (key + disk.ENTRY_SUFFIX)).st_uid

    assert X.in_child(plant, uid=X.SECOND_UID) == X.SECOND_UID
    _degrades(backend, make_settings(root), "unsafe", caplog)
    _serves_own_grammar(hf_tokenizer, backend, "[0-9]+")


def test_symlinked_entry_is_refused_not_followed(hf_tokenizer, cache_dir, tmp_path):
    pc = _compiler(hf_tokenizer, cache_dir)
    elsewhere = tmp_path / "elsewhere.xgc"
    elsewhere.write_bytes(_planted(hf_tokenizer, pc.ns.scope_hex, "[0-9]+", "[a-z]+"))
    link = pc.ns.entry_path(disk.key_digest(["regex", "[0-9]+"]))
    os.symlink(elsewhere, link)
    pc.compile_regex("[0-9]+")  # never through the link: the link is moved aside, the grammar compiled
    assert pc.native_compiles == 1 and xgr.take_resolution().source == "compile"
    [moved] = os.listdir(pc.ns.quarantine)
    assert os.path.islink(os.path.join(pc.ns.quarantine, moved)) and moved.startswith(os.path.basename(link))
    assert elsewhere.read_bytes() == _planted(hf_tokenizer, pc.ns.scope_hex, "[0-9]+", "[a-z]+")  # untouched
    pc.close()


@pytest.mark.timeout(600)
def test_symlinked_lock_file_is_not_followed(hf_tokenizer, cache_dir, tmp_path):
    """A symbolic link at a lock file's name (today opened O_TRUNC through the link: the target is
    truncated, by root if the server runs as root): refused, the target untouched, nothing published."""
    pc = _compiler(hf_tokenizer, cache_dir, retries=0)
    victim = tmp_path / "precious"
    victim.write_text("do not truncate")
    key = disk.key_digest(["regex", "[0-9]{2}lock"])
    os.symlink(victim, os.path.join(pc.ns.locks, key + ".lock"))
    pc.compile_regex("[0-9]{2}lock")
    _flush(pc)
    assert victim.read_text() == "do not truncate"
    assert not os.path.lexists(pc.ns.entry_path(key))
    assert pc.persister.outcomes[key]["status"] == "unsafe", pc.persister.outcomes[key]
    pc.close()


def test_new_settings_parse_strictly_and_metric_labels_match_the_code(tmp_path):
    from dspark_harden.core.settings import SettingsError, load_settings
    from dspark_harden.grammar import metrics as gm

    for name, bad in [
        (F.DISK_HELPER_RETRIES, "-1"),
        (F.DISK_HELPER_RETRIES, "two"),
        (F.DISK_LOCK_TIMEOUT, "0"),
        (F.DISK_LOCK_TIMEOUT, "soon"),
    ]:
        with pytest.raises(SettingsError, match=name):
            load_settings(F.dspark_settings(), environ={F.DISK_DIR: str(tmp_path), name: bad})
    ok = load_settings(
        F.dspark_settings(),
        environ={F.DISK_DIR: str(tmp_path), F.DISK_HELPER_RETRIES: "0", F.DISK_LOCK_TIMEOUT: "0.25"},
    )
    assert ok[F.DISK_HELPER_RETRIES] == 0 and ok[F.DISK_LOCK_TIMEOUT] == 0.25
    assert gm.DEGRADE_REASONS == disk.DEGRADE_REASONS
