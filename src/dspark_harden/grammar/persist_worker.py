"""The persistence helper process: compile from the key, serialize, trial-load, decide, publish.

Started by :class:`dspark_harden.grammar.persist.Helper` as ``python -m
dspark_harden.grammar.persist_worker`` (never forked from a scheduler). It never receives a
compiled grammar: every job names the grammar by its cache key parts and the helper compiles it
again itself, so nothing large crosses the process boundary and nothing it allocates can grow
the serving process. Its address space is capped (``RLIMIT_AS`` = its size after start-up +
``memory_limit_bytes``): xgrammar's ``serialize_json`` / ``deserialize_json`` then fail with
``std::bad_alloc`` instead of taking the host's memory, and the grammar is recorded as a
``memory_limit`` marker. The parent enforces a deadline by killing the helper.

Protocol: newline-delimited JSON. stdin: one init object, then jobs
``{"key_hex", "parts", "compile_s"}``. stdout: ``{"ready": ...}`` once, then per job any number
of ``{"phase": name}`` progress lines and one result line with ``"status"``. The helper exits
on end of input (its parent died or closed it) or after ``idle_exit_s`` without a job.
"""

from __future__ import annotations

import json
import os
import resource
import select
import sys
import time
from typing import Any

from . import disk

# Measured on xgrammar 0.2.7 (docs/grammar.md "Serialized size"): serialized JSON is 1.1x..120x
# the compiled grammar's memory size and deserialises at 13..60 MB/s; the prediction uses the
# optimistic ends, so it only skips serialisation when even the best case would be too slow.
PREDICT_SERIALIZED_PER_MEMORY_BYTE = 1.1
PREDICT_LOAD_BYTES_PER_SECOND = 60e6


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


class Worker:
    def __init__(self, init: dict, out=sys.stdout):
        from xgrammar import GrammarCompiler, TokenizerInfo

        self.out = out
        self.tokenizer_info = TokenizerInfo.deserialize_json(init["tokenizer_info"])
        self.compiler = GrammarCompiler(self.tokenizer_info, max_threads=int(init["compiler_threads"]),
                                        cache_enabled=False)
        self.ns = disk.Namespace(init["root"], init["scope"], max_bytes=int(init["max_bytes"]))
        if self.ns.scope_hex != init["scope_hex"]:
            raise RuntimeError(f"helper scope {self.ns.scope_hex} differs from the server's {init['scope_hex']}")
        self.load_ratio = float(init["load_ratio"])
        self.max_entry_bytes = int(init["max_entry_bytes"])
        self.idle_exit_s = float(init["idle_exit_s"])
        self.memory_limit = int(init["memory_limit_bytes"])
        self.baseline_vm = _vm_size()
        limit = self.baseline_vm + self.memory_limit
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def say(self, **kw: Any) -> None:
        self.out.write(json.dumps(kw) + "\n")
        self.out.flush()

    def marker(self, key_hex: str, reason: str, compile_s: float, serialized: int = 0, load_s: float = 0.0) -> bytes:
        m = disk.Marker(reason, max(1, int(compile_s * 1e9)), serialized, int(load_s * 1e9))
        return disk.encode_marker(self.ns.scope_hex, key_hex, m)

    def decide(self, key_hex: str, cg: Any, compile_s: float) -> tuple[bytes, dict]:
        """(entry bytes, facts) for a freshly compiled grammar; facts["stored"] is serialized|marker."""
        from xgrammar import CompiledGrammar

        mem = int(cg.memory_size_bytes)
        facts: dict = {"memory_bytes": mem, "phases": {}}
        budget = compile_s * self.load_ratio
        predicted = mem * PREDICT_SERIALIZED_PER_MEMORY_BYTE / PREDICT_LOAD_BYTES_PER_SECOND
        if predicted > budget:
            facts.update(stored="marker", reason="predicted_slow")
            return self.marker(key_hex, "predicted_slow", compile_s, 0, predicted), facts
        self.say(phase="serialize")
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
        data = disk.encode_entry(self.ns.scope_hex, key_hex, disk.KIND_SERIALIZED, payload)
        del payload
        self.say(phase="measure_load")
        tl = time.perf_counter()
        try:
            entry = disk.decode_entry("<measure>", data, self.ns.scope_hex, key_hex)
            CompiledGrammar.deserialize_json(entry.payload.decode("utf-8"), self.tokenizer_info)
            del entry
        except Exception as exc:  # noqa: BLE001
            reason = "memory_limit" if _is_oom(exc) else "serialize_failed"
            facts.update(stored="marker", reason=reason, error=f"{type(exc).__name__}: {exc}"[:300])
            return self.marker(key_hex, reason, compile_s, n), facts
        load_s = time.perf_counter() - tl
        facts["phases"]["measure_load"] = load_s
        if load_s > budget:
            facts.update(stored="marker", reason="slow_load")
            return self.marker(key_hex, "slow_load", compile_s, n, load_s), facts
        facts.update(stored="serialized", reason="")
        return data, facts

    def handle(self, job: dict) -> dict:
        from filelock import Timeout

        key_hex = job["key_hex"]
        if os.path.exists(self.ns.entry_path(key_hex)):
            return {"status": "exists"}
        lock = self.ns.entry_lock(key_hex)
        try:
            lock.acquire(blocking=False)
        except Timeout:
            return {"status": "busy"}  # another process's helper is publishing this key
        try:
            if os.path.exists(self.ns.entry_path(key_hex)):
                return {"status": "exists"}
            self.say(phase="compile")
            tc = time.perf_counter()
            try:
                cg = compile_parts(self.compiler, job["parts"])
            except Exception as exc:  # noqa: BLE001
                if not _is_oom(exc):
                    return {"status": "compile_failed", "error": f"{type(exc).__name__}: {exc}"[:300]}
                data = self.marker(key_hex, "memory_limit", float(job["compile_s"]))
                facts = {"stored": "marker", "reason": "memory_limit", "phases": {}}
            else:
                compile_s = time.perf_counter() - tc
                facts_compile = {"measure_compile": compile_s}
                data, facts = self.decide(key_hex, cg, min(compile_s, float(job["compile_s"])))
                del cg
                facts["phases"].update(facts_compile)
            self.say(phase="publish")
            tw = time.perf_counter()
            try:
                total, pruned = self.ns.publish(key_hex, data)
            except disk.PruneError as exc:
                return {"status": "prune_error", "error": str(exc), **facts}
            except OSError as exc:
                return {"status": "publish_error", "error": str(exc), **facts}
            facts["phases"]["entry_write_account"] = time.perf_counter() - tw
            return {"status": "published", "total": total, "pruned": pruned.removed if pruned else 0,
                    "entry_bytes": len(data), **facts}
        finally:
            lock.release()

    def serve(self, stream) -> None:
        self.say(ready=True, pid=os.getpid(), baseline_vm=self.baseline_vm, limit=self.baseline_vm + self.memory_limit)
        fd = stream.fileno()
        buf = b""
        while True:
            while b"\n" not in buf:
                ready, _, _ = select.select([fd], [], [], self.idle_exit_s)
                if not ready:
                    return  # idle: the parent starts a new helper for the next job
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return  # parent closed the pipe or died
                buf += chunk
            line, buf = buf.split(b"\n", 1)
            job = json.loads(line)
            try:
                result = self.handle(job)
            except Exception as exc:  # noqa: BLE001 - report, keep serving
                result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            self.say(**result)


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> int:
    stdin = sys.stdin.buffer
    init = json.loads(stdin.readline())
    Worker(init).serve(stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
