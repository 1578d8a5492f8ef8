"""``dspark-harden grammar-cache {stats,verify,prune}`` and ``dspark-harden bench grammar``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from . import disk


def register(subparsers: Any, bench_subparsers: Any) -> None:
    p = subparsers.add_parser("grammar-cache", help="inspect, verify and repair the persistent grammar cache")
    sub = p.add_subparsers(dest="grammar_cache_command", required=True)

    def common(sp):
        sp.add_argument("--dir", help="cache root (default: DSPARK_HARDEN_GRAMMAR_DISK_DIR)")
        sp.add_argument("--json", action="store_true", help="print one JSON object")

    s = sub.add_parser("stats", help="namespaces, entries, serialized vs markers, bytes, ledger")
    common(s)
    s.set_defaults(func=stats_main)
    v = sub.add_parser("verify", help="check every entry's checksum/scope/key and the byte ledger (exit 1 on problems)")
    common(v)
    v.add_argument(
        "--quarantine",
        action="store_true",
        help="move invalid entries to <namespace>/quarantine/ and fix the ledger (still exits 1)",
    )
    v.add_argument(
        "--deep",
        action="store_true",
        help="also deserialize every serialized entry with the namespace's tokenizer (needs --tokenizer)",
    )
    v.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="PATH",
        help="local Hugging Face tokenizer (or model) directory the server ran with; checked against "
        "each namespace's recorded tokenizer digest; repeat for several models",
    )
    v.set_defaults(func=verify_main)
    r = sub.add_parser("prune", help="remove stale temp files, prune to a byte limit, rebuild the ledger")
    common(r)
    r.add_argument(
        "--max-bytes", type=int, help="target size per namespace (default: DSPARK_HARDEN_GRAMMAR_DISK_BYTES)"
    )
    r.add_argument(
        "--temp-age", type=float, default=3600.0, help="remove temp files older than this many seconds (default 3600)"
    )
    r.set_defaults(func=prune_main)

    b = bench_subparsers.add_parser("grammar", help="stock XGrammar backend vs grammar service, cold vs warm restart")
    b.add_argument("--json", action="store_true", help="print only the JSON result")
    b.add_argument("--vocab", type=int, default=32000, help="tokenizer vocabulary size (default 32000)")
    b.add_argument("--duplicates", type=int, default=2, help="copies of each spelling in the burst (default 2)")
    b.add_argument("--dir", help="disk cache root to use (default: a fresh temporary directory)")
    b.add_argument(
        "--distinct",
        type=int,
        metavar="N",
        help="memory mode instead: RSS growth of stock vs the service after N distinct schemas",
    )
    b.add_argument(
        "--cache-bytes",
        type=int,
        metavar="B",
        help="with --distinct: the service's DSPARK_HARDEN_GRAMMAR_CACHE_BYTES (default: the setting)",
    )
    b.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="host-wide mode instead: N real scheduler-shaped processes, one empty disk cache, the same "
        "burst in each at once; host_compiles vs distinct_schemas and the wait claims added",
    )
    b.add_argument(
        "--handoff",
        action="store_true",
        help="handoff mode instead: per bench schema, compiling it vs the least any cross-process handoff "
        "costs (serialize, durable write, read, deserialize), in this process",
    )
    b.add_argument("--repeats", type=int, default=5, help="with --handoff: repetitions per schema (median)")
    b.add_argument(
        "--stream",
        type=int,
        metavar="N",
        help="stream mode instead: N requests, mostly new schemas, through stock and the service (with its "
        "persistence helper) in alternating blocks: RSS growth after warm-up, lookup p50/p99, the helper's "
        "CPU share, what reached the disk",
    )
    b.add_argument(
        "--distinct-ratio",
        type=float,
        default=0.9,
        metavar="R",
        help="with --stream: share of requests that bring a new schema (default 0.9)",
    )
    b.add_argument("--blocks", type=int, default=10, help="with --stream: alternating blocks (default 10)")
    b.set_defaults(func=_bench_main)


def _bench_main(args: Any) -> int:
    if getattr(args, "stream", None):  # bench_stream builds on bench (one direction: no import cycle)
        from . import bench_stream

        return bench_stream.main(args)
    from . import bench

    return bench.main(args)


def _settings():
    from ..core.manager import feature_settings, make_manager
    from .settings import FEATURE

    return feature_settings(make_manager(load_extensions=False), FEATURE)


def _lock_timeout() -> float:
    from .settings import DISK_LOCK_TIMEOUT

    return _settings()[DISK_LOCK_TIMEOUT]


def _root(args: Any) -> str:
    from .settings import DISK_DIR

    return os.path.abspath(os.path.expanduser(args.dir)) if args.dir else _settings()[DISK_DIR]


def _emit(args: Any, obj: dict, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(obj))
    else:
        print("\n".join(lines))


def _namespace_stats(path: str) -> dict:
    ns = disk.Namespace.open_existing(path)
    n = serialized = markers = unreadable = 0
    total = 0
    for e in ns.iter_entries():
        try:
            fd = disk.open_nofollow(e.path)
            try:
                head = os.read(fd, disk.HEADER_SIZE)
            finally:
                os.close(fd)
            size = e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        except disk.UnsafeCacheError:
            n += 1
            unreadable += 1
            continue
        n += 1
        total += size
        if len(head) == disk.HEADER_SIZE and head[:8] == disk.MAGIC:
            kind = head[9]
            serialized += kind == disk.KIND_SERIALIZED
            markers += kind == disk.KIND_MARKER
        else:
            unreadable += 1
    try:
        ledger: Any = ns.read_ledger()
    except disk.GrammarCacheError as exc:
        ledger = f"invalid: {exc}"
    q = len(os.listdir(ns.quarantine)) if os.path.isdir(ns.quarantine) else 0
    return {
        "path": ns.path,
        "scope": ns.scope,
        "entries": n,
        "serialized": serialized,
        "markers": markers,
        "unrecognised": unreadable,
        "bytes": total,
        "ledger_bytes": ledger,
        "temp_files": len(ns.temp_files()),
        "quarantined": q,
    }


def stats_main(args: Any) -> int:
    root = _root(args)
    out = [_namespace_stats(p) for p in disk.namespaces(root)]
    lines = [f"grammar cache root {root}: {len(out)} namespace(s)"]
    for s in out:
        lines.append(
            f"  {s['path']}\n    xgrammar {s['scope'].get('xgrammar')}, tokenizer {str(s['scope'].get('tokenizer_sha256'))[:16]}…, "
            f"vocab {s['scope'].get('vocab_size')}\n    {s['entries']} entries ({s['serialized']} serialized, "
            f"{s['markers']} markers, {s['unrecognised']} unrecognised), {s['bytes']} bytes, ledger {s['ledger_bytes']}, "
            f"{s['temp_files']} temp files, {s['quarantined']} quarantined"
        )
    _emit(args, {"root": root, "namespaces": out}, lines)
    return 0


def _load_tokenizers(paths: list) -> tuple[list, str]:
    """([(path, tokenizer)], "") or ([], why one path could not be loaded)."""
    from transformers import AutoTokenizer

    out = []
    for path in paths:
        try:
            out.append((path, AutoTokenizer.from_pretrained(path, local_files_only=True)))
        except Exception as exc:  # noqa: BLE001 - report which path and why, as a usage error
            return [], f"grammar-cache verify: cannot load tokenizer {path}: {type(exc).__name__}: {exc}"
    return out, ""


def _namespace_tokenizer_info(ns: Any, tokenizers: list) -> tuple[Any, str]:
    """(TokenizerInfo, "") for the first tokenizer whose xgrammar TokenizerInfo, built the way the
    XGrammar backend builds it (vocab size and stop tokens from scope.json), has the digest the
    namespace records; (None, why) when none does."""
    from xgrammar import TokenizerInfo

    from .xgr import tokenizer_digest

    want = ns.scope.get("tokenizer_sha256")
    seen = []
    for path, tok in tokenizers:
        try:
            info = TokenizerInfo.from_huggingface(
                tok, vocab_size=int(ns.scope["vocab_size"]), stop_token_ids=list(ns.scope["stop_token_ids"])
            )
        except Exception as exc:  # noqa: BLE001
            seen.append(f"{path}: {type(exc).__name__}: {exc}")
            continue
        got = tokenizer_digest(info)
        if got == want:
            return info, ""
        seen.append(f"{path} has digest {got}")
    return None, (
        f"deep check impossible: no --tokenizer matches the namespace's tokenizer digest {want} "
        f"({'; '.join(seen)}); pass the tokenizer the server ran with"
    )


def verify_main(args: Any) -> int:
    if args.deep and not args.tokenizer:
        print(
            "grammar-cache verify --deep needs --tokenizer PATH: a namespace records only its tokenizer's "
            "digest (scope.json tokenizer_sha256), and deserializing an entry needs the tokenizer itself",
            file=sys.stderr,
        )
        return 2
    if args.tokenizer and not args.deep:
        print("grammar-cache verify: --tokenizer is only used with --deep", file=sys.stderr)
        return 2
    tokenizers, load_error = _load_tokenizers(args.tokenizer) if args.deep else ([], "")
    if load_error:
        print(load_error, file=sys.stderr)
        return 2
    root = _root(args)
    report = []
    problems = 0
    lines = [f"grammar cache root {root}" + (" (deep: deserializing serialized entries)" if args.deep else "")]
    for path in disk.namespaces(root):
        ns = disk.Namespace.open_existing(path, lock_timeout_s=_lock_timeout())
        try:
            ns.check_dirs()
            unsafe = ""
        except disk.UnsafeCacheError as exc:
            unsafe = str(exc)
            problems += 1
            lines.append(f"  UNSAFE: {unsafe}: a server refuses this root and runs memory-only")
        info, deep_error = (None, "")
        if args.deep:
            info, deep_error = _namespace_tokenizer_info(ns, tokenizers)
            if info is None:
                problems += 1
        ok, bad = ns.verify_all(tokenizer_info=info) if info is not None else ns.verify_all()
        moved = []
        if args.quarantine:
            for p, _reason in bad:
                try:
                    moved.append(ns.quarantine_entry(p))
                except (OSError, disk.GrammarCacheError) as exc:
                    lines.append(f"  could not quarantine {p}: {exc}")
                    problems += 1
        scanned = ns.scan_bytes()
        try:
            ledger: Any = ns.read_ledger()
            ledger_ok = ledger == scanned
        except disk.GrammarCacheError as exc:
            ledger, ledger_ok = f"invalid: {exc}", False
        # an invalid entry is a problem whether or not it was quarantined: the exit status says
        # "the cache had problems", quarantining is the repair (run verify again to confirm it)
        problems += len(bad)
        problems += 0 if ledger_ok else 1
        entry = {
            "path": path,
            "ok": ok,
            "invalid": [{"path": p, "reason": r} for p, r in bad],
            "unsafe": unsafe,
            "quarantined": moved,
            "ledger_bytes": ledger,
            "entry_bytes": scanned,
            "ledger_ok": ledger_ok,
            "deep": info is not None,
        }
        if deep_error:
            entry["deep_error"] = deep_error
        report.append(entry)
        lines.append(
            f"  {path}: {ok} valid, {len(bad)} invalid; ledger {ledger} vs entries {scanned} "
            f"({'ok' if ledger_ok else 'MISMATCH: run grammar-cache prune to rebuild'})"
            + ("; deserialized" if info is not None else "")
        )
        if deep_error:
            lines.append(f"    DEEP CHECK FAILED: {deep_error}")
        for p, r in bad:
            lines.append(f"    INVALID {p}: {r}" + ("  -> quarantined" if args.quarantine else ""))
    _emit(args, {"root": root, "namespaces": report, "problems": problems, "deep": bool(args.deep)}, lines)
    return 1 if problems else 0


def prune_main(args: Any) -> int:
    from .settings import DISK_BYTES

    root = _root(args)
    limit = args.max_bytes if args.max_bytes is not None else _settings()[DISK_BYTES]
    if limit < 0:
        print("--max-bytes must be >= 0", file=sys.stderr)
        return 2
    report, failed = [], 0
    lines = [f"grammar cache root {root}: pruning each namespace to {limit} bytes"]
    now = time.time()
    for path in disk.namespaces(root):
        ns = disk.Namespace.open_existing(path, max_bytes=max(1, limit), lock_timeout_s=_lock_timeout())
        removed_tmp = 0
        for t in ns.temp_files():
            try:
                if now - os.stat(t).st_mtime > args.temp_age:
                    os.unlink(t)
                    removed_tmp += 1
            except FileNotFoundError:
                pass
        try:
            res = ns.prune(limit)
        except disk.GrammarCacheLockTimeout as exc:
            failed += 1
            report.append({"path": path, "ok": False, "error": str(exc), "temp_removed": removed_tmp})
            lines.append(f"  {path}: FAILED: {exc}")
            continue
        failed += not res.ok
        report.append(
            {
                "path": path,
                "before": res.before,
                "after": res.after,
                "removed": res.removed,
                "skipped_locked": res.skipped_locked,
                "temp_removed": removed_tmp,
                "ok": res.ok,
            }
        )
        lines.append(
            f"  {path}: {res.before} -> {res.after} bytes, {res.removed} removed, "
            f"{res.skipped_locked} skipped (locked), {removed_tmp} temp files removed"
            + ("" if res.ok else "  FAILED: still above the limit")
        )
    _emit(args, {"root": root, "limit": limit, "namespaces": report, "ok": not failed}, lines)
    return 1 if failed else 0
