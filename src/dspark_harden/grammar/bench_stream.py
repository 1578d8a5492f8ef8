"""``dspark-harden bench grammar --stream N``: the grammar path over a long stream of requests.

N JSON-schema requests, most of them for schemas never seen before (``--distinct-ratio``: the
share of requests that bring a new schema; the others reuse one of the last ``REUSE_WINDOW``
schemas, as tool-calling traffic does), go one at a time through two scheduler-shaped processes
(spawned): stock 0.5.23's ``XGrammarGrammarBackend`` and the same backend with the grammar
service's patches bound (its LRU, disk cache and persistence helper, at the settings' defaults or
the ``DSPARK_HARDEN_GRAMMAR_*`` variables exported to the bench). Each process resolves a request
as a scheduler does (lookup, wait, a private copy, the request ends). The stream is cut into
``blocks`` runs of equal size, given to the two processes in alternating order (stock first in
even blocks), so both see the same host load; one process is idle while the other runs.

Per process: RSS after each block (after ``gc.collect``) and its growth per 10,000 requests after
warm-up (least squares over the blocks after the first ``WARMUP_SHARE``, and for the service after its
LRU first held 90 % of ``DSPARK_HARDEN_GRAMMAR_CACHE_BYTES``: it is meant to grow until then), the
lookup latency of every request after warm-up (p50/p99, ms), native compiles, and for the service the persistence
helper's CPU seconds (every helper process it started, start-ups included, from the kernel's
accounting), as a fraction of one core over the stream's wall time (the helper runs beside both
processes' blocks and its budget refills with wall time), and what reached the disk (entries, bytes,
publications deferred to a key's second use, skipped for the helper's CPU budget).
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

REUSE_WINDOW = 256  # a reused schema is one of the last this many distinct ones
WARMUP_SHARE = 0.2  # the first fifth of the stream is warm-up (caches fill, the helper starts)


def stream_schema(i: int) -> str:
    """The i-th of an endless family of distinct tool-call-shaped schemas (4-10 typed arguments,
    enums, nested objects, arrays)."""
    kinds = (
        lambda j: {"type": "string", "maxLength": 16 + j},
        lambda j: {"type": "integer", "minimum": 0, "maximum": 1000 + j},
        lambda j: {"type": "boolean"},
        lambda j: {"enum": [f"v{i}_{j}_{k}" for k in range(2 + j % 4)]},
        lambda j: {"type": "array", "items": {"type": "string"}, "maxItems": 2 + j % 3},
        lambda j: {"type": "object", "properties": {f"n{j}": {"type": "number"}}, "required": [f"n{j}"]},
    )
    props = {f"arg_{i}_{j}": kinds[(i + j) % len(kinds)](j) for j in range(4 + i % 7)}
    return json.dumps(
        {
            "title": f"tool_{i}",
            "type": "object",
            "properties": props,
            "required": list(props)[: 2 + i % 3],
            "additionalProperties": False,
        }
    )


def stream_ids(n: int, distinct_ratio: float, seed: int = 2026) -> list[int]:
    """Schema ids of the stream's requests: a new id with probability ``distinct_ratio`` (and
    always the first), else one of the last ``REUSE_WINDOW`` distinct ids, uniformly."""
    rng = random.Random(seed)
    ids: list[int] = []
    fresh = 0
    for _ in range(n):
        if fresh == 0 or rng.random() < distinct_ratio:
            ids.append(fresh)
            fresh += 1
        else:
            ids.append(rng.randrange(max(0, fresh - REUSE_WINDOW), fresh))
    return ids


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _helper_cpu_s(backend: Any) -> float:
    """CPU seconds of every persistence helper this process started: those it reaped (the kernel's
    children accounting: this process has no other children) plus the live one."""
    from ..core.procfs import cpu_seconds

    total = _children_cpu_s()
    pc = getattr(backend, "grammar_compiler", None)
    pid = getattr(getattr(getattr(pc, "persister", None), "helper", None), "pid", None)
    if pid is not None:
        total += cpu_seconds(pid) or 0.0
    return total


def _disk_usage(root: str) -> tuple[int, int]:
    entries = size = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            size += st.st_size
            if f.endswith(".xgc"):
                entries += 1
    return entries, size


def _stream_child(variant: str, vocab: int, env: dict, cache_dir: str, conn) -> None:
    """One scheduler-shaped process: receives a block of schema ids, resolves them one at a time,
    answers with the block's latencies, wall seconds and RSS; ``None`` ends it with the totals."""
    try:
        from .bench import resolve_like_scheduler, scheduler_backend

        backend = scheduler_backend(variant, vocab, env, cache_dir)
        gc.collect()
        conn.send({"ready": True, "rss": _rss_bytes()})
        busy_s = 0.0
        while True:
            block = conn.recv()
            if block is None:
                break
            lat = []
            t_block = time.perf_counter()
            for i in block:
                lat.append(resolve_like_scheduler(backend, i, stream_schema(i)))
            wall = time.perf_counter() - t_block
            busy_s += wall
            gc.collect()
            service = getattr(backend, "_dspark_grammar", None)
            conn.send({"lat": lat, "wall": wall, "rss": _rss_bytes(), "lru": service.nbytes if service else None})
        out: dict = {"busy_s": busy_s}
        pc = backend.grammar_compiler
        out["native_compiles"] = int(getattr(pc, "native_compiles", -1))
        if variant == "harden":
            t = time.perf_counter()
            pc.flush()
            out["flush_s"] = time.perf_counter() - t
            out["helper_cpu_s"] = _helper_cpu_s(backend)
            out["charged_cpu_s"] = pc.persister.helper_cpu_s
            out["skipped"] = dict(pc.persister.skipped)
            out["deferred_published"] = pc.deferred_published
            out["deferred_pending"] = len(pc._deferred)
            out["helper_starts"] = pc.persister.helper.starts
            out["disk_entries"], out["disk_bytes"] = _disk_usage(pc.ns.path)
            pc.close()
        conn.send(out)
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            raise


def _slope_per_10k(points: list) -> float:
    """Least-squares slope of (requests, MiB) points, in MiB per 10,000 requests."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 10_000


def _pct(values: list, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))] if s else 0.0


def run_stream(n: int, distinct_ratio: float = 0.9, vocab: int = 32000, blocks: int = 10, log=print) -> dict:
    if n < blocks or blocks < 2:
        raise ValueError(f"--stream needs at least {max(2, blocks)} requests and 2 blocks")
    if not 0.0 < distinct_ratio <= 1.0:
        raise ValueError(f"--distinct-ratio must be in (0, 1], got {distinct_ratio!r}")
    ids = stream_ids(n, distinct_ratio)
    size = -(-n // blocks)
    chunks = [ids[k : k + size] for k in range(0, n, size)]
    warm = max(1, round(len(chunks) * WARMUP_SHARE))
    env = {k: v for k, v in os.environ.items() if k.startswith("DSPARK_HARDEN_GRAMMAR")}
    from ..core.manager import feature_settings, make_manager
    from .settings import CACHE_BYTES, FEATURE, XGR_CACHE_BYTES

    # the bounds the service child runs with (the settings' own parsing and defaults)
    settings = feature_settings(make_manager(load_extensions=False), FEATURE, environ=env)
    ctx = mp.get_context("spawn")
    cache_dir = tempfile.mkdtemp(prefix="dspark-grammar-stream-")
    conns, procs = {}, {}
    try:
        for variant in ("stock", "harden"):
            parent, child = ctx.Pipe()
            procs[variant] = ctx.Process(target=_stream_child, args=(variant, vocab, env, cache_dir, child))
            procs[variant].start()
            child.close()
            conns[variant] = parent
        base = {}
        for variant, c in conns.items():
            msg = _recv(c, procs[variant], variant)
            base[variant] = msg["rss"]
        res: dict = {v: {"lat": [], "points": [], "walls": [], "lru": []} for v in conns}
        done = 0
        t_stream = time.perf_counter()
        for k, chunk in enumerate(chunks):
            order = ("stock", "harden") if k % 2 == 0 else ("harden", "stock")
            for variant in order:
                conns[variant].send(chunk)
                msg = _recv(conns[variant], procs[variant], variant)
                r = res[variant]
                r["lat"].append(msg["lat"])
                r["points"].append((done + len(chunk), msg["rss"] / 2**20))
                r["walls"].append(msg["wall"])
                r["lru"].append(msg["lru"])
            done += len(chunk)
            log(
                f"block {k + 1}/{len(chunks)}: {done} requests; RSS stock "
                f"{res['stock']['points'][-1][1]:.0f} MiB, harden {res['harden']['points'][-1][1]:.0f} MiB"
            )
        totals = {}
        for variant, c in conns.items():
            c.send(None)
            totals[variant] = _recv(c, procs[variant], variant)
        stream_s = time.perf_counter() - t_stream  # the helper could run all along (its flush included)
    finally:
        for p in procs.values():
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(cache_dir, ignore_errors=True)
    out: dict = {
        "requests": n,
        "distinct_schemas": len(set(ids)),
        "distinct_ratio": distinct_ratio,
        "vocab": vocab,
        "blocks": len(chunks),
        "stream_s": round(stream_s, 2),
        # the service's memory is bounded by its LRU plus xgrammar's own cache: RSS is flat once they are full
        "cache_bytes_limit": settings[CACHE_BYTES],
        "xgr_cache_bytes_limit": settings[XGR_CACHE_BYTES],
    }
    for variant in ("stock", "harden"):
        r, t = res[variant], totals[variant]
        # warm-up: the first WARMUP_SHARE of the blocks, and for the service until its LRU is full (90 % of
        # its limit): its memory is bounded by the LRU, so it grows until then by design
        w, lru_full_at = warm, None
        for k, lru in enumerate(r["lru"]):
            if lru is not None and lru >= 0.9 * settings[CACHE_BYTES]:
                lru_full_at = r["points"][k][0]
                w = max(w, k + 1)
                break
        w = min(w, len(chunks) - 1)  # at least two points to fit
        after = r["points"][w - 1 :]  # from the end of warm-up on
        lat = [x for block in r["lat"][w:] for x in block]
        entry = {
            "warmup_requests": r["points"][w - 1][0],
            "lru_full_at_request": lru_full_at,
            "rss_mb_start": round(base[variant] / 2**20, 1),
            "rss_mb_after_warmup": round(after[0][1], 1),
            "rss_mb_end": round(r["points"][-1][1], 1),
            "rss_growth_mb_per_10k": round(_slope_per_10k(after), 2),
            "lookup_p50_ms": round(_pct(lat, 0.5) * 1e3, 3),
            "lookup_p99_ms": round(_pct(lat, 0.99) * 1e3, 3),
            "busy_s": round(t["busy_s"], 2),
            "native_compiles": t["native_compiles"],
            "helper_cpu_s": 0.0,
            "helper_cpu_core_fraction": 0.0,
        }
        if variant == "harden":
            entry.update(
                helper_cpu_s=round(t["helper_cpu_s"], 2),
                helper_cpu_charged_s=round(t["charged_cpu_s"], 2),
                helper_cpu_core_fraction=round(t["helper_cpu_s"] / max(stream_s, 1e-9), 3),
                helper_cpu_s_per_1k_requests=round(t["helper_cpu_s"] / n * 1000, 3),
                helper_starts=t["helper_starts"],
                flush_s=round(t["flush_s"], 2),
                disk_entries=t["disk_entries"],
                disk_bytes=t["disk_bytes"],
                publish_skipped=t["skipped"],
                deferred_published_on_reuse=t["deferred_published"],
                deferred_pending=t["deferred_pending"],
            )
        out[variant] = entry
    h, s = out["harden"], out["stock"]
    log(
        f"stream of {n} ({out['distinct_schemas']} distinct): RSS growth per 10k after warm-up stock "
        f"{s['rss_growth_mb_per_10k']} MiB, harden {h['rss_growth_mb_per_10k']} MiB; lookup p99 stock "
        f"{s['lookup_p99_ms']} ms, harden {h['lookup_p99_ms']} ms; helper {h['helper_cpu_core_fraction']} of a core, "
        f"{h['disk_entries']} entries on disk"
    )
    return out


def _recv(conn, proc, variant: str, timeout: float = 3600.0) -> dict:
    if not conn.poll(timeout):
        raise RuntimeError(f"bench grammar --stream: the {variant} process sent nothing for {timeout:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"bench grammar --stream: the {variant} process died (exit code {proc.exitcode})") from None
    if "error" in msg:
        raise RuntimeError(f"bench grammar --stream: {variant}: {msg['error']}")
    return msg


def main(args: Any) -> int:
    """``bench grammar --stream N``: JSON on stdout (``--json``: one line, the log on stderr)."""
    import sys

    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    result = run_stream(args.stream, args.distinct_ratio, vocab=args.vocab, blocks=args.blocks, log=log)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
