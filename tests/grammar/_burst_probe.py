"""A scheduler-shaped process for tests/grammar/test_persist_helper.py (run as a script).

It builds the real SGLang ``XGrammarGrammarBackend`` with the plugin's persistent compiler and
grammar service (exactly as the bound patches do), warms up, then resolves a burst of grammars
through the service (the entry point SGLang's GrammarManager calls) and reports, as one JSON line:
its own peak RSS before and after the burst, per-request results, the persistence outcomes and
the compile-slot figures.

usage: python _burst_probe.py <cache_dir> <settings-json> <requests-json>
  requests: [[key_type, key_string], ...]
"""

import json
import os
import resource
import sys
import time


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    cache_dir, overrides, requests = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    from dspark_harden.core import procfs
    from dspark_harden.core.settings import load_settings
    from dspark_harden.devtools.tiny_models import ensure_tokenizer
    from dspark_harden.grammar import feature as F
    from dspark_harden.grammar.service import GrammarService

    tok = AutoTokenizer.from_pretrained(ensure_tokenizer(2048))
    # every compiled grammar is persisted at once, and nothing preloaded, unless the test says otherwise
    # (conftest.make_settings)
    env = {
        F.DISK_DIR: cache_dir,
        F.DISK_PERSIST_MIN_COMPILE: "0",
        F.DISK_PRELOAD: "0",
        **{k: str(v) for k, v in overrides.items()},
    }
    settings = load_settings(F.dspark_settings(), environ=env)
    backend = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])
    F.install_persistent_compiler(backend, settings)
    pc = backend.grammar_compiler
    service = GrammarService(
        backend,
        workers=settings[F.WORKERS],
        max_bytes=settings[F.CACHE_BYTES],
        max_entries=settings[F.CACHE_ENTRIES],
        timeout_s=None,
    )
    # warm-up: the xgrammar machinery and one small compile + its publication
    v, _ = service.lookup(("regex", "warm-[a-z]{1,3}"), False)
    v.result(timeout=120)
    pc.flush()
    first_helper = pc.persister.helper.pid
    before = peak_rss()
    t0 = time.monotonic()
    futures = [(key, service.lookup(tuple(key), False)[0]) for key in requests]
    results = []
    for key, fut in futures:
        value = fut.result(timeout=600)
        results.append(
            {
                "key_type": key[0],
                "served_s": time.monotonic() - t0,
                "invalid": getattr(value, "error_message", None),
                "source": getattr(fut, "source", None),
            }
        )
    served_all_s = time.monotonic() - t0
    burst_peak = peak_rss()
    pc.flush()
    after = peak_rss()
    lock_fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if os.sep + "locks" + os.sep in target:
            lock_fds.append(target)
    outcomes = {k: {kk: vv for kk, vv in r.items() if kk != "phases"} for k, r in pc.persister.outcomes.items()}
    print(
        json.dumps(
            {
                "before": before,
                "burst_peak": burst_peak,
                "after": after,
                "served_all_s": served_all_s,
                "persisted_s": time.monotonic() - t0,
                "results": results,
                "outcomes": outcomes,
                "skipped": pc.persister.skipped,
                "peak_running": pc.slots.peak_running,
                "pauses": pc.slots.pauses,
                "slot_limit": pc.slots.limit,
                "helper_starts": pc.persister.helper.starts,
                "first_helper_gone": procfs.gone(first_helper),
                "helper_limit": pc.persister.helper.limit_bytes,
                "lock_fds": lock_fds,
                "native_compiles": pc.native_compiles,
            }
        ),
        flush=True,
    )
    pc.close()
    service.shutdown()


if __name__ == "__main__":
    main()
