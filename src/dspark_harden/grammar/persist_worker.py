"""The persistence helper process: compile from the key, serialize, trial-load, decide, publish.

Started by :class:`dspark_harden.grammar.persist.Helper` as ``python -m
dspark_harden.grammar.persist_worker --parent-pid PID`` (never forked from a scheduler). It never
receives a compiled grammar: every job names the grammar by its cache key parts and the helper
compiles it again itself, so nothing large crosses the process boundary and nothing it allocates
can grow the serving process. Its address space is capped (``RLIMIT_AS`` = its size after start-up
+ ``memory_limit_bytes``): xgrammar's ``serialize_json`` / ``deserialize_json`` then fail with
``std::bad_alloc`` instead of taking the host's memory, and the grammar is recorded as a
``memory_limit`` marker. The parent enforces a deadline by killing the helper.

It dies with its parent: ``PR_SET_PDEATHSIG(SIGKILL)`` is set first thing, then ``getppid()`` is
compared with the parent pid it was given (the parent may have died before the prctl), and again
before every phase. (The death signal follows the parent *thread* that started the helper: the
persister thread, which outlives every job it runs.) A helper paused by its parent, or one that was
orphaned while compiling, therefore never outlives the scheduler.

It holds no lock while it can be paused: compile, serialize, trial load and the temp-file write
run lock-free; before it takes the entry lock and ``ledger.lock`` it announces the publish phase and
waits for the parent's go, which the parent sends only after it has stopped pausing this helper
(and resumed it, if it was paused). Every lock it takes is bounded.

Protocol: newline-delimited JSON on a private pair of pipes the parent passes as extra descriptors
(``--proto-fds IN,OUT``); stdin is /dev/null and stdout/stderr go to the parent's log, so nothing a
library prints, from Python or C, can reach the protocol. IN: one init object, then jobs
``{"job", "key_hex", "parts", "compile_s", "compile_cold"}`` and go tokens ``{"go": job}``. OUT: ``{"ready": ...}`` once, then per job any number of ``{"job", "key_hex", "phase"}``
progress lines (``"wait": "go"`` on the publish phase) and one result line with ``"status"``,
every one tagged with its job's number and key. The helper exits on end of input (its parent died
or closed it), on a protocol error, or after ``idle_exit_s`` without a job.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
from typing import Any, Optional

from . import disk

# Measured on xgrammar 0.2.7 (docs/grammar.md "Serialized size"): serialized JSON is 1.1x..120x
# the compiled grammar's memory size and deserialises at 13..60 MB/s; the prediction uses the
# optimistic ends, so it only skips serialisation when even the best case would be too slow.
PREDICT_SERIALIZED_PER_MEMORY_BYTE = 1.1
PREDICT_LOAD_BYTES_PER_SECOND = 60e6

PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 75  # the parent is gone: nothing to report to
EXIT_PROTOCOL = 76  # the parent sent something this protocol does not allow


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    check_parent(parent_pid)


def check_parent(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        os._exit(EXIT_ORPHANED)


def compile_parts(compiler: Any, parts: list):
    """Compile the grammar a cache key names (the same call PersistentCompiler made)."""
    kind = parts[0]
    if kind == "json_schema":
        return compiler.compile_json_schema(parts[1], **parts[2])
    if kind == "builtin_json":
        return compiler.compile_builtin_json_grammar()
    if kind == "ebnf":
        return compiler.compile_grammar(parts[1], **parts[2])
    if kind == "regex":
        return compiler.compile_regex(parts[1])
    if kind == "structural_tag":
        return compiler.compile_structural_tag(parts[1])
    raise ValueError(f"unknown grammar key kind {kind!r}")


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "bad_alloc" in str(exc)


class LineReader:
    """Newline-delimited reads from a descriptor, with an optional timeout (None: wait)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""

    def readline(self, timeout: Optional[float]) -> Optional[bytes]:
        """One line; None on timeout; b"" on end of input."""
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return b""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line


def decision_compile_s(wall_s: float, cpu_s: float, job: dict) -> tuple[str, float, float]:
    """(basis, decide_s, record_s) for this helper's compile (``wall_s``, ``cpu_s``: its CPU time over
    all its threads), always a cold one (no xgrammar cache: what a restarted process pays).

    ``decide_s``: what the store-or-marker decision compares the trial load against -- the compile's
    one-thread cost. ``serving`` basis: the serving process's compile, when it was cold too (the job says
    ``compile_cold``), or this helper's CPU time, whichever is less. ``helper``: the serving compile may
    have reused xgrammar's cache, so this helper's CPU time alone (the parent pauses this helper for
    request compiles: its wall time can include the pauses, its CPU time cannot).

    ``record_s``: recorded in a serialized entry -- what a restarted serving process pays to compile the
    grammar instead of loading it, which is what a load there is compared against (xgr.py demotes an
    entry that loads slower). This helper compiles with the serving compiler's thread count, so its wall
    time is that compile's (xgrammar spreads one grammar over its threads: ~0.6x the one-thread time on
    two cores); its CPU time when it was paused for longer than that saved; the serving compile's own
    wall time when that was cold and less."""
    record = min(wall_s, cpu_s)
    if job.get("compile_cold", True):
        served = float(job["compile_s"])
        return "serving", min(cpu_s, served), min(record, served)
    return "helper", cpu_s, record


class _Exists(Exception):
    """Another process published the key meanwhile: stop working on it."""


class Worker:
    def __init__(self, init: dict, out: Any, reader: LineReader, parent_pid: int):
        from xgrammar import GrammarCompiler, TokenizerInfo

        self.out = out
        self.reader = reader
        self.parent_pid = parent_pid
        self.tokenizer_info = TokenizerInfo.deserialize_json(init["tokenizer_info"])
        self.compiler = GrammarCompiler(
            self.tokenizer_info, max_threads=int(init["compiler_threads"]), cache_enabled=False
        )
        # the server created the namespace: open it without taking any lock, checking its directories
        self.ns = disk.Namespace(
            init["root"],
            init["scope"],
            max_bytes=int(init["max_bytes"]),
            create=False,
            secure=True,
            lock_timeout_s=float(init["lock_timeout_s"]),
        )
        if self.ns.scope_hex != init["scope_hex"]:
            raise RuntimeError(f"helper scope {self.ns.scope_hex} differs from the server's {init['scope_hex']}")
        self.load_ratio = float(init["load_ratio"])
        self.max_entry_bytes = int(init["max_entry_bytes"])
        self.idle_exit_s = float(init["idle_exit_s"])
        self.memory_limit = int(init["memory_limit_bytes"])
        self.baseline_vm = _vm_size()
        limit = self.baseline_vm + self.memory_limit
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        self._tag: dict = {}

    def say(self, **kw: Any) -> None:
        self.out.write(json.dumps({**self._tag, **kw}) + "\n")
        self.out.flush()

    def step(self, phase: str, key_hex: str) -> None:
        """Between phases: die if orphaned, stop if the key was published meanwhile, announce."""
        check_parent(self.parent_pid)
        if os.path.lexists(self.ns.entry_path(key_hex)):
            raise _Exists
        self.say(phase=phase)

    def marker(self, key_hex: str, reason: str, compile_s: float, serialized: int = 0, load_s: float = 0.0) -> bytes:
        m = disk.Marker(reason, max(1, int(compile_s * 1e9)), serialized, int(load_s * 1e9))
        return disk.encode_marker(self.ns.scope_hex, key_hex, m)

    def decide(self, key_hex: str, cg: Any, compile_s: float, record_s: float) -> tuple[bytes, dict]:
        """(entry bytes, facts) for a freshly compiled grammar; facts["stored"] is serialized|marker.
        ``compile_s``/``record_s``: decision_compile_s's decide_s/record_s."""
        from xgrammar import CompiledGrammar

        mem = int(cg.memory_size_bytes)
        facts: dict = {"memory_bytes": mem, "phases": {}}
        budget = compile_s * self.load_ratio
        predicted = mem * PREDICT_SERIALIZED_PER_MEMORY_BYTE / PREDICT_LOAD_BYTES_PER_SECOND
        if predicted > budget:
            facts.update(stored="marker", reason="predicted_slow")
            return self.marker(key_hex, "predicted_slow", compile_s, 0, predicted), facts
        self.step("serialize", key_hex)
        ts = time.perf_counter()
        try:
            text = cg.serialize_json()
        except Exception as exc:  # noqa: BLE001
            reason = "memory_limit" if _is_oom(exc) else "serialize_failed"
            facts.update(stored="marker", reason=reason, error=f"{type(exc).__name__}: {exc}"[:300])
            return self.marker(key_hex, reason, compile_s), facts
        facts["phases"]["serialize"] = time.perf_counter() - ts
        n = len(text)  # the JSON is ASCII: characters == bytes
        facts["serialized_bytes"] = n
        facts["ratio"] = n / mem if mem else None
        if n > self.max_entry_bytes:
            del text
            facts.update(stored="marker", reason="too_large")
            return self.marker(key_hex, "too_large", compile_s, n), facts
        payload = text.encode("utf-8")
        del text
        data = disk.encode_entry(self.ns.scope_hex, key_hex, disk.KIND_SERIALIZED, payload, record_s)
        del payload
        self.step("measure_load", key_hex)
        # the trial load is judged by its CPU time (this thread's): the work a load of this grammar needs,
        # not how long the helper waited for a core on a busy host (wall time made slow_load markers depend
        # on the host's load: issue 40 item 5)
        tl, tl_cpu = time.perf_counter(), time.thread_time()
        try:
            entry = disk.decode_entry("<measure>", data, self.ns.scope_hex, key_hex)
            CompiledGrammar.deserialize_json(entry.payload.decode("utf-8"), self.tokenizer_info)
            del entry
        except Exception as exc:  # noqa: BLE001
            reason = "memory_limit" if _is_oom(exc) else "serialize_failed"
            facts.update(stored="marker", reason=reason, error=f"{type(exc).__name__}: {exc}"[:300])
            return self.marker(key_hex, reason, compile_s, n), facts
        load_s = time.thread_time() - tl_cpu
        facts["phases"]["measure_load"] = time.perf_counter() - tl
        if load_s > budget:
            facts.update(stored="marker", reason="slow_load")
            return self.marker(key_hex, "slow_load", compile_s, n, load_s), facts
        facts.update(stored="serialized", reason="")
        return data, facts

    def handle(self, job: dict) -> dict:
        key_hex = job["key_hex"]
        try:
            self.step("compile", key_hex)
            tc = time.perf_counter()
            cc = time.process_time()
            try:
                cg = compile_parts(self.compiler, job["parts"])
            except Exception as exc:  # noqa: BLE001
                if not _is_oom(exc):
                    return {"status": "compile_failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
                data = self.marker(key_hex, "memory_limit", float(job["compile_s"]))
                facts = {"stored": "marker", "reason": "memory_limit", "phases": {}}
            else:
                compile_s = time.perf_counter() - tc
                compile_cpu = time.process_time() - cc
                facts_compile = {"measure_compile": compile_s}
                basis, basis_s, record_s = decision_compile_s(compile_s, compile_cpu, job)
                data, facts = self.decide(key_hex, cg, basis_s, record_s)
                del cg
                facts["phases"].update(facts_compile)
                facts["decision_basis"] = basis
                facts["decision_compile_s"] = basis_s
                facts["recorded_compile_s"] = record_s
                facts["compile_cpu_s"] = compile_cpu
            self.step("write", key_hex)
        except _Exists:
            return {"status": "exists"}
        try:
            self.ns.check_size(key_hex, len(data))
        except disk.PruneError as exc:
            return {"status": "prune_error", "error": str(exc), **facts}
        tw = time.perf_counter()
        size = len(data)
        try:
            tmp = self.ns.stage(data)  # lock-free: the parent may still pause us here
        except OSError as exc:
            return {"status": "publish_error", "error": str(exc), **facts}
        del data
        try:
            return self._publish(key_hex, tmp, size, facts, tw)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)

    def _publish(self, key_hex: str, tmp: str, size: int, facts: dict, tw: float) -> dict:
        # the only phase that takes locks: the parent must stop pausing us before we take any
        self.say(phase="publish", wait="go")
        th = time.perf_counter()
        line = self.reader.readline(None)
        facts["handshake_s"] = time.perf_counter() - th
        if not line:
            os._exit(EXIT_ORPHANED)  # end of input: the parent is gone or closed us
        try:
            go = json.loads(line)
        except ValueError:
            go = None
        if not isinstance(go, dict) or go.get("go") != self._tag.get("job"):
            sys.stderr.write(
                f"dspark-harden grammar persistence helper: expected go for job {self._tag.get('job')}, "
                f"got {line[:200]!r}\n"
            )
            os._exit(EXIT_PROTOCOL)
        check_parent(self.parent_pid)
        lock = self.ns.entry_lock(key_hex)
        try:
            lock.acquire(blocking=False)
        except disk.GrammarCacheLockTimeout:
            return {"status": "busy", **facts}  # another process's helper is publishing this key
        except disk.UnsafeCacheError as exc:  # a symbolic link planted at the lock's name: not followed
            return {"status": "unsafe", "error": str(exc), **facts}
        except OSError as exc:
            return {"status": "publish_error", "error": str(exc), **facts}
        try:
            if os.path.lexists(self.ns.entry_path(key_hex)):
                return {"status": "exists"}
            try:
                total, pruned = self.ns.commit(key_hex, tmp, size)
            except disk.GrammarCacheLockTimeout as exc:
                return {"status": "lock_timeout", "error": str(exc), **facts}
            except disk.PruneError as exc:
                return {"status": "prune_error", "error": str(exc), **facts}
            except OSError as exc:
                return {"status": "publish_error", "error": str(exc), **facts}
        finally:
            lock.release()
        facts["phases"]["entry_write_account"] = time.perf_counter() - tw
        return {
            "status": "published",
            "total": total,
            "pruned": pruned.removed if pruned else 0,
            "entry_bytes": size,
            "ledger_repairs": self.ns.ledger_repairs,
            **facts,
        }

    def serve(self) -> None:
        self.say(ready=True, pid=os.getpid(), baseline_vm=self.baseline_vm, limit=self.baseline_vm + self.memory_limit)
        while True:
            line = self.reader.readline(self.idle_exit_s)
            if line is None:
                return  # idle: the parent starts a new helper for the next job
            if not line:
                return  # parent closed the pipe or died
            check_parent(self.parent_pid)
            try:
                job = json.loads(line)
                self._tag = {"job": job["job"], "key_hex": job["key_hex"]}
            except (ValueError, KeyError, TypeError):
                sys.stderr.write(f"dspark-harden grammar persistence helper: not a job: {line[:200]!r}\n")
                os._exit(EXIT_PROTOCOL)
            try:
                result = self.handle(job)
            except Exception as exc:  # noqa: BLE001 - report, keep serving
                result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            self.say(**result)
            self._tag = {}


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_harden.grammar.persist_worker")
    p.add_argument("--parent-pid", type=int, required=True, help="the scheduler that started this helper")
    p.add_argument(
        "--proto-fds",
        required=True,
        metavar="IN,OUT",
        help="the inherited descriptors of the protocol pipes (never stdin/stdout)",
    )
    args = p.parse_args(argv)
    die_with_parent(args.parent_pid)
    fd_in, fd_out = (int(x) for x in args.proto_fds.split(","))
    reader, out = LineReader(fd_in), os.fdopen(fd_out, "w", encoding="utf-8")
    line = reader.readline(None)
    if not line:
        return 0
    Worker(json.loads(line), out, reader, args.parent_pid).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
