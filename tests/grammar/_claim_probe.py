"""A real process for tests/grammar/test_claims.py (run as a script).

``hold ROOT SCOPE_JSON KEY_HEX ESTIMATE_S``: claim the key in the namespace (the product's own
claim.create), print ``{"claimed": ...}`` and sleep until killed — a claimant in mid-compile.

``serve CACHE_DIR GO_FILE KEY_JSON [LOAD_RATIO]``: a scheduler-shaped process (real XGrammarGrammarBackend, the
plugin's persistent compiler and grammar service); waits until GO_FILE exists, resolves the key
through the service, waits for its persistence, prints the source, native compile count and claim
outcomes as one JSON line. LOAD_RATIO (default 1e9: every key is handed off, never a timing-dependent
compile-locally marker or local claim decision) is the adaptive policy's ratio (after a warm-up with a key of its own: the helper is running and the
claim estimate measured, as in a server that has served a while).
"""

import json
import os
import sys
import time


def hold(root: str, scope: str, key_hex: str, estimate: str) -> None:
    from dspark_harden.grammar import claim, disk

    ns = disk.Namespace(root, json.loads(scope), max_bytes=1 << 40, create=False)
    c = claim.create(ns, key_hex, float(estimate))
    print(json.dumps({"claimed": c is not None, "pid": os.getpid(), "path": c.path if c else None}), flush=True)
    while True:
        time.sleep(3600)


def serve(cache_dir: str, go_file: str, key: str, load_ratio: str = "1e9") -> None:
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    from dspark_harden.core.settings import load_settings
    from dspark_harden.devtools.tiny_models import ensure_tokenizer
    from dspark_harden.grammar import feature as F
    from dspark_harden.grammar.service import GrammarService

    tok = AutoTokenizer.from_pretrained(ensure_tokenizer(2048))
    settings = load_settings(
        F.dspark_settings(),
        environ={F.DISK_DIR: cache_dir, F.DISK_CLAIMS: "1", F.DISK_LOAD_RATIO: load_ratio, F.DISK_PRELOAD: "0"},
    )
    backend = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])
    F.install_persistent_compiler(backend, settings)
    pc = backend.grammar_compiler
    service = GrammarService(backend, workers=4, max_bytes=1 << 40, max_entries=1000, timeout_s=None)
    # warm-up with a key of this process's own: the helper runs and the claim estimate is measured
    fut, _ = service.lookup(("regex", f"warm-{os.getpid()}-[a-z]{{1,3}}"), False)
    fut.result(timeout=300)
    pc.flush()
    base = pc.native_compiles
    base_claims = dict(pc.claim_outcomes)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.001)
    t = time.monotonic()
    fut, _ = service.lookup(tuple(json.loads(key)), False)
    value = fut.result(timeout=300)
    seconds = time.monotonic() - t
    assert value is not None and type(value).__name__ != "InvalidGrammarObject", value
    pc.flush()
    claims = {k: v - base_claims[k] for k, v in pc.claim_outcomes.items()}
    print(
        json.dumps(
            {
                "source": fut.source,
                "native_compiles": pc.native_compiles - base,
                "seconds": seconds,
                "claims": claims,
                "waits": list(pc.claim_waits),
                "estimate_s": pc.persister.publish_estimate(),
            }
        ),
        flush=True,
    )
    pc.close()


if __name__ == "__main__":
    {"hold": hold, "serve": serve}[sys.argv[1]](*sys.argv[2:])
