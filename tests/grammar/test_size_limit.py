"""DSPARK_HARDEN_GRAMMAR_MAX_BYTES: a grammar text above the limit fails its request at once with a
clear error and is never compiled (a 10 MB schema took a real DP2 server's scheduler past 17 GB in the
adversarial soak, docs/e2e.md). Real xgrammar, the real SGLang XGrammarGrammarBackend, the service."""

from __future__ import annotations

import json

import pytest

from dspark_harden.core.settings import SettingsError, load_settings
from dspark_harden.grammar import feature as F
from dspark_harden.grammar.service import GrammarTooLarge

from .conftest import counting_backend, service_for


def _schema(n_props: int) -> str:
    return json.dumps({"type": "object", "properties": {f"field_{i:05d}": {"type": "integer"} for i in range(n_props)}})


def test_oversize_grammar_fails_at_once_and_is_never_compiled(hf_tokenizer):
    backend, calls = counting_backend(hf_tokenizer)
    svc = service_for(backend, max_grammar_bytes=4096)
    big = _schema(400)
    assert len(big.encode()) > 4096
    fut, cached = svc.lookup(("json", big), False)
    assert not cached and fut.done()
    with pytest.raises(
        GrammarTooLarge, match=r"json grammar of \d+ bytes is larger than DSPARK_HARDEN_GRAMMAR_MAX_BYTES=4096"
    ):
        fut.result(timeout=0)
    assert svc.compiles == 0 and calls["n"] == 0 and svc.refused_too_large == 1
    small, _ = svc.lookup(("json", _schema(3)), False)
    assert small.result(timeout=120) is not None and calls["n"] == 1
    # multi-byte text is measured in UTF-8 bytes, not characters
    regex = "é" * 3000  # 3000 characters, 6000 bytes
    fut, _ = svc.lookup(("regex", regex), False)
    with pytest.raises(GrammarTooLarge, match="regex grammar of 6000 bytes"):
        fut.result(timeout=0)
    svc.shutdown()


def test_limit_setting_is_strict_and_defaults_above_real_schemas(tmp_path):
    s = load_settings(F.dspark_settings(), environ={F.DISK_DIR: str(tmp_path)})
    assert s[F.MAX_GRAMMAR_BYTES] == 2 << 20 > 683 * 1024
    for bad in ("0", "-1", "2MB"):
        with pytest.raises(SettingsError, match=F.MAX_GRAMMAR_BYTES):
            load_settings(F.dspark_settings(), environ={F.DISK_DIR: str(tmp_path), F.MAX_GRAMMAR_BYTES: bad})
