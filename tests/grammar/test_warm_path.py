"""The warm path's start-up and read shortcuts keep their guarantees (issue 26 item 3).

* The tokenizer's serialization is made once at start-up and used for both the namespace's scope
  digest and the persistence helper's TokenizerInfo: the digest is still the SHA-256 of the live
  tokenizer's serialization (another tokenizer gets another namespace) and the helper rebuilds
  exactly the live tokenizer.
* The entry checksum is computed over the file's bytes in place: one changed byte anywhere in an
  entry is still a named corrupt entry, never served (moved to quarantine, compiled afresh).
* The bench's per-phase accounting sees every compile task of a burst.

Real xgrammar, the real 2048- and 32000-token local tokenizers, real files.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from dspark_harden.grammar import disk

from .conftest import persistent_backend, service_for


def _resolve(service, key):
    value, hit = service.lookup(key, False)
    return value if hit else value.result(timeout=120)


def test_scope_digest_and_helper_tokenizer_come_from_the_live_tokenizer(hf_tokenizer, cache_dir):
    from transformers import AutoTokenizer

    from dspark_harden.devtools.tiny_models import ensure_tokenizer

    backend = persistent_backend(hf_tokenizer, cache_dir)
    pc = backend.grammar_compiler
    live = backend._tokenizer_info.serialize_json()
    assert pc.ns.scope["tokenizer_sha256"] == hashlib.sha256(live.encode()).hexdigest()
    assert pc._helper_init()["tokenizer_info"] == live
    phases = backend._dspark_grammar_init_s
    assert set(phases) == {"tokenizer_serialize", "namespace_open", "compiler"}
    assert all(v >= 0 for v in phases.values())
    # another tokenizer: another namespace, whose digest is its own tokenizer's
    other = persistent_backend(AutoTokenizer.from_pretrained(ensure_tokenizer(32000)), cache_dir)
    other_live = other._tokenizer_info.serialize_json()
    assert other.grammar_compiler.ns.scope["tokenizer_sha256"] == hashlib.sha256(other_live.encode()).hexdigest()
    assert other.grammar_compiler.ns.path != pc.ns.path
    pc.close()
    other.grammar_compiler.close()


@pytest.mark.parametrize("where", ["header", "payload", "trailer"])
def test_one_changed_byte_anywhere_is_a_named_corrupt_entry(hf_tokenizer, cache_dir, where):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    pc = backend.grammar_compiler
    service = service_for(backend)
    key = ("json", '{"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]}')
    assert type(_resolve(service, key)).__name__ == "XGrammarGrammar"
    pc.flush()
    [path] = [e.path for e in pc.ns.iter_entries()]
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    # a byte the checksum catches before anything else would: inside the key digest (header bytes
    # 48..79), mid-payload, inside the checksum itself
    at = {"header": 60, "payload": (disk.HEADER_SIZE + len(data) - disk.TRAILER_SIZE) // 2, "trailer": len(data) - 1}[
        where
    ]
    data[at] ^= 0x01
    with open(path, "wb") as fh:
        fh.write(data)
    with pytest.raises(disk.CorruptEntryError) as err:
        disk.decode_entry(path, bytes(data), pc.ns.scope_hex, os.path.basename(path)[: -len(disk.ENTRY_SUFFIX)])
    assert "checksum mismatch" in err.value.reason
    # a restarted process (fresh LRU) never serves it: the entry is moved to quarantine, byte for byte,
    # and the request is served by a fresh compile
    fresh = service_for(backend)
    compiles = pc.native_compiles
    assert type(_resolve(fresh, key)).__name__ == "XGrammarGrammar"
    assert pc.native_compiles == compiles + 1
    [moved] = os.listdir(pc.ns.quarantine)
    with open(os.path.join(pc.ns.quarantine, moved), "rb") as fh:
        assert fh.read() == bytes(data)
    pc.close()


def test_phase_accounting_counts_every_compile_task(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    service = service_for(backend)
    keys = [("json", '{"type": "object", "properties": {"k%d": {"type": "integer"}}}' % i) for i in range(3)]
    for k in keys:
        _resolve(service, k)
    assert service.sources == {"compile": 3}
    assert {"native_compile", "empty_check", "dispatch", "copy"} <= set(service.phase_seconds)
    backend.grammar_compiler.flush()
    warm = service_for(backend)  # a fresh LRU over the now-populated disk cache
    for k in keys:
        _resolve(warm, k)
    assert sum(warm.sources.values()) == 3 and set(warm.sources) <= {"disk", "local_compile"}
    if warm.sources.get("disk"):
        assert warm.phase_seconds["deserialize"] > 0 and warm.phase_seconds["verify"] > 0
    backend.grammar_compiler.close()
