"""A scheduler-role process whose persistence helper is paused (tests/grammar/test_no_wedge.py).

It builds the real SGLang ``XGrammarGrammarBackend`` with the plugin's persistent compiler on the
given cache root (as the bound patch does), with one compile slot that a request compile fills the
moment the helper's job starts, so the helper is SIGSTOPped as when every worker serves requests.
It prints ``{"helper": pid}`` and waits to be killed.

usage: python _orphan_probe.py <cache_dir>
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from _faults import PausingSlots, wait_for
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    from dspark_harden.core.settings import load_settings
    from dspark_harden.devtools.tiny_models import ensure_tokenizer
    from dspark_harden.grammar import feature as F
    from dspark_harden.grammar import xgr

    tok = AutoTokenizer.from_pretrained(ensure_tokenizer(2048))
    settings = load_settings(
        F.dspark_settings(), environ={F.DISK_DIR: sys.argv[1], F.WORKERS: "1", F.DISK_LOAD_RATIO: "1e9"}
    )
    backend = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])
    F.install_persistent_compiler(backend, settings)
    installed = backend.grammar_compiler
    installed.close()
    slots = PausingSlots(1)
    pc = xgr.PersistentCompiler(
        installed.inner,
        installed.tokenizer_info,
        installed.ns,
        installed.policy,
        slots=slots,
        persist=installed.persist_settings,
    )
    backend.grammar_compiler = pc
    pc.compile_regex("orphan-[a-z]{3}[0-9]{2}")  # served; its publication starts the helper, paused at once
    wait_for(lambda: slots.held and pc.persister.helper.proc is not None, 300, "the helper job to start")
    print(json.dumps({"helper": pc.persister.helper.proc.pid, "pauses": slots.pauses}), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
