"""Measure what docs/grammar.md "A paused helper holds no lock" quotes (issue 21 item 1):

* how fast SIGSTOP pauses a helper that is compiling/serializing, once every compile slot is busy;
* how long one helper phase of a 40-way ``anyOf`` schema runs (a cooperative token, checked only
  between phases, would take effect that much later);
* the publish handshake's cost per job (helper waits for the scheduler's go).

usage: python tests/grammar/_measure_pause.py  (prints one JSON object)
"""

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import xgrammar as xg
    from _faults import PausingSlots, proc_state, wait_for
    from test_persist_helper import blowup_schema
    from transformers import AutoTokenizer

    from dspark_harden.devtools.tiny_models import ensure_tokenizer
    from dspark_harden.grammar import disk, xgr
    from dspark_harden.grammar.persist import PersistSettings

    tok = AutoTokenizer.from_pretrained(ensure_tokenizer(2048))
    info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    scope = xgr.scope_for(info, vocab_size=len(tok), override_stop_tokens=None, compiler={"measure": True})
    root = tempfile.mkdtemp(prefix="dspark-measure-")
    ns = disk.Namespace(root, scope, max_bytes=1 << 40)
    slots = PausingSlots(1, pause=0)
    pc = xgr.PersistentCompiler(
        xg.GrammarCompiler(info, cache_enabled=False),
        info,
        ns,
        xgr.Policy(load_ratio=1e9),
        slots=slots,
        persist=PersistSettings(memory_limit_bytes=4 << 30, deadline_s=600),
    )
    # handshake cost over small jobs
    for i in range(20):
        pc.compile_regex(f"hs-{i}-[a-z]{{1,{i % 5 + 1}}}")
    pc.flush()
    hs = sorted(r["handshake_s"] for r in pc.persister.outcomes.values() if "handshake_s" in r)
    # pause latency while the helper works on a large schema, and that schema's phase lengths
    schema = blowup_schema(n_alt=40)
    stops = []
    for trial in range(3):
        s = schema.replace('"pad0"', f'"pad0_{trial}"')
        pc.compile_json_schema(s)
        helper = pc.persister.helper
        wait_for(lambda: helper.phase in ("compile", "serialize", "measure_load"), 300, "the helper's job")
        pid = helper.proc.pid
        t0 = time.perf_counter()
        slots.__enter__()  # the only slot now serves a request: the helper is paused
        wait_for(lambda: proc_state(pid) == "T", 30, "the pause", poll=0.0001)
        stops.append(time.perf_counter() - t0)
        slots.__exit__(None, None, None)
        pc.flush()
    phases = [r.get("phases", {}) for r in pc.persister.outcomes.values() if r.get("memory_bytes", 0) > 100000]
    pc.close()
    print(
        json.dumps(
            {
                "handshake_s": {"median": statistics.median(hs), "max": hs[-1], "n": len(hs)},
                "sigstop_to_state_T_s": {"median": statistics.median(stops), "max": max(stops), "n": len(stops)},
                "anyof40_phase_s": {k: round(statistics.median(p[k] for p in phases), 4) for k in phases[0]}
                if phases
                else {},
            }
        )
    )


if __name__ == "__main__":
    main()
