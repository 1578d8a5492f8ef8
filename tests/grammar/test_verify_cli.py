"""``dspark-harden grammar-cache verify`` exit status, ``--deep`` (deserialize with the namespace's
tokenizer, checked against the recorded tokenizer digest) and the swapped-entry message — as real
subprocesses over a real cache written by the real persistent compiler (issue 11 items 4 and 5)."""

from __future__ import annotations

import json
import os
import sys

from dspark_harden.grammar import disk

from .conftest import persistent_backend


def _cli(*args):
    (res,) = _clis(args)
    return res


def _clis(*arg_lists):
    """``grammar-cache verify`` runs that only read the cache, at once (each is a fresh interpreter
    importing xgrammar and SGLang's tokenizer stack on one core): [(rc, stdout, stderr)] in order."""
    from tests.plugin._proc import run_concurrently

    argv = [sys.executable, "-m", "dspark_harden", "grammar-cache", "verify"]
    done = run_concurrently([([*argv, *args], None) for args in arg_lists], timeout=300, parallel=len(arg_lists))
    return [(p.returncode, p.stdout, p.stderr) for p in done]


def _populate(tok, cache_dir, n=4):
    # a huge load ratio: every entry is stored serialized (none becomes a compile-locally marker)
    backend = persistent_backend(tok, cache_dir, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9")
    for i in range(n):
        backend.grammar_compiler.compile_regex(f"verify[a-f]{{{i + 1}}}x")
    backend.grammar_compiler.flush()
    ns = backend.grammar_compiler.ns
    entries = sorted(e.path for e in ns.iter_entries())
    assert len(entries) == n
    kinds = {p: disk.decode_entry(p, open(p, "rb").read(), ns.scope_hex, None).kind for p in entries}
    assert set(kinds.values()) == {disk.KIND_SERIALIZED}, kinds
    return ns, entries


def _recut(ns, path: str) -> None:
    """Cut the payload in half and recompute the checksum and the ledger: the envelope is valid."""
    data = open(path, "rb").read()
    _magic, _fmt, kind, _compile_us, scope_b, key_b, _plen = disk._HEADER.unpack_from(data)
    payload = data[disk.HEADER_SIZE : -disk.TRAILER_SIZE]
    with open(path, "wb") as fh:
        fh.write(disk.encode_entry(scope_b.hex(), key_b.hex(), kind, payload[: len(payload) // 2]))
    with open(ns.ledger_path, "wb") as fh:
        fh.write(disk.encode_ledger(ns.scan_bytes()))


def test_quarantine_still_exits_1(hf_tokenizer, cache_dir):
    ns, entries = _populate(hf_tokenizer, cache_dir, n=2)
    victim = entries[0]
    with open(victim, "r+b") as fh:
        fh.truncate(os.path.getsize(victim) - 5)
    rc, out, err = _cli("--dir", str(cache_dir), "--quarantine", "--json")
    report = json.loads(out)
    assert rc == 1, (out, err)  # docs: exit 1 on any problem, quarantined or not
    assert report["problems"] == 1 and len(report["namespaces"][0]["quarantined"]) == 1
    assert not os.path.exists(victim)
    rc, out, err = _cli("--dir", str(cache_dir))
    assert rc == 0, out + err  # repaired: a second verify is clean


def test_deep_deserializes_with_the_namespace_tokenizer(hf_tokenizer, cache_dir):
    from dspark_harden.devtools.tiny_models import ensure_tokenizer

    ns, entries = _populate(hf_tokenizer, cache_dir)
    right, wrong = ensure_tokenizer(2048), ensure_tokenizer(32000)
    rc, out, err = _cli("--dir", str(cache_dir), "--deep", "--tokenizer", right, "--json")
    assert rc == 0 and json.loads(out)["namespaces"][0]["deep"] is True, out + err

    victim = entries[1]
    _recut(ns, victim)
    d = str(cache_dir)
    envelope, no_tok, bad_tok, wrong_tok, both = _clis(  # read-only runs over the same cache
        ("--dir", d),
        ("--dir", d, "--deep"),
        ("--dir", d, "--deep", "--tokenizer", str(cache_dir / "no-such-tokenizer")),
        ("--dir", d, "--deep", "--tokenizer", wrong),
        ("--dir", d, "--deep", "--tokenizer", wrong, "--tokenizer", right, "--json"),
    )
    rc, out, err = envelope
    assert rc == 0, out + err  # the envelope check alone cannot see it (documented)

    rc, out, err = no_tok
    assert rc == 2 and "--deep needs --tokenizer PATH" in err and "tokenizer_sha256" in err

    rc, out, err = bad_tok
    assert rc == 2 and "cannot load tokenizer" in err, out + err

    rc, out, err = wrong_tok
    assert rc == 1 and "deep check impossible" in out and ns.scope["tokenizer_sha256"] in out, out + err

    rc, out, err = both
    report = json.loads(out)
    (n,) = report["namespaces"]
    assert rc == 1 and report["problems"] == 1, out + err
    assert [b["path"] for b in n["invalid"]] == [victim]
    assert "xgrammar rejected the serialized grammar" in n["invalid"][0]["reason"]
    assert n["ok"] == len(entries) - 1

    rc, out, err = _cli("--dir", str(cache_dir), "--deep", "--tokenizer", right, "--quarantine")
    assert rc == 1 and "quarantined" in out, out + err
    rc, out, err = _cli("--dir", str(cache_dir), "--deep", "--tokenizer", right)
    assert rc == 0, out + err


def test_swapped_entry_message_shows_where_the_digests_differ(hf_tokenizer, cache_dir):
    # two digests sharing their first 16 hex digits: the old message printed the same text twice
    scope = "ab" * 32
    written = "9f8820d4ec642ead" + "1" * 47 + "0"
    expected = "9f8820d4ec642ead" + "2" * 48
    data = disk.encode_entry(scope, written, disk.KIND_SERIALIZED, b'{"x":1}')
    try:
        disk.decode_entry("/cache/e.xgc", data, scope, expected)
    except disk.CorruptEntryError as exc:
        msg = exc.reason
    else:
        raise AssertionError("a swapped entry was accepted")
    assert written in msg and expected in msg
    assert "first differ at hex digit 17" in msg and "…2ead[1]1111… vs …2ead[2]2222…" in msg
    assert "swapped?" in msg

    # and for real files: two entries swapped on disk, as verify reports them
    ns, entries = _populate(hf_tokenizer, cache_dir, n=2)
    a, b = entries
    tmp = a + ".swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    rc, out, _ = _cli("--dir", str(cache_dir), "--json")
    invalid = {x["path"]: x["reason"] for x in json.loads(out)["namespaces"][0]["invalid"]}
    assert rc == 1 and set(invalid) == {a, b}
    ka, kb = (os.path.basename(p)[: -len(disk.ENTRY_SUFFIX)] for p in (a, b))
    assert f"written for key {kb}, not {ka}" in invalid[a] and "first differ at hex digit" in invalid[a]
