"""Issue 40 item 3 on a real DP2 server: a corrupt grammar-cache entry heals, visibly.

The shared ``dp2_server`` (tests/harness/shared.py: real SGLang 0.5.23 on CPU, tiny DeepSeek V3 with random
weights -- the stand-in for DeepSeek V4, which cannot run here -- DP2 attention, plugin active, an empty
grammar disk cache in the server's workdir) publishes three schemas of this module; the test then damages
their entries on disk the three ways the field does -- one byte flipped (bitrot), truncated (a filesystem
that did not honour fsync ordering), replaced by another key's entry (a foreign file) -- flushes the
schedulers' memory caches through stock ``/flush_cache``, and sends each schema again. Each request is
served (HTTP 200) by a fresh compile, the entry is moved to the namespace's ``quarantine/`` byte for byte
(kept, never deleted) with one log line naming it (logged at ERROR: tests/grammar/test_persistence.py) and ``corrupt_entries_total`` counting it, the grammar
is republished, and after another flush the schemas resolve from disk again without a corrupt lookup.

Mutation: ``PersistentCompiler._heal`` raising instead of moving the entry (the pre-issue-40 behaviour: every
request of the schema failed until an operator ran ``grammar-cache verify --quarantine``) turns this red
(HTTP 400 on the first request after the flush).
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

pytestmark = pytest.mark.server

SCHEMAS = [
    {
        "type": "object",
        "properties": {f"drill_{name}": {"enum": ["x", "y"]}, "ok": {"type": "boolean"}},
        "required": [f"drill_{name}", "ok"],
    }
    for name in ("flip", "truncate", "foreign")
]
DEADLINE_S = 300.0


def _send(server, schema) -> None:
    r = server.post(
        "/generate",
        {
            "text": "Answer in JSON:",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "json_schema": json.dumps(schema)},
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text[:2000]


def _sums(server) -> dict:
    """{"corrupt_entries": corrupt_entries_total, "<source>": lookups_total by source}, summed over the ranks."""
    out: dict = {}
    for line in server.metrics_text().splitlines():
        m = re.match(r"dspark_harden_grammar_(corrupt_entries_total|lookups_total)\{([^}]*)\}\s+([0-9.e+]+)", line)
        if not m:
            continue
        if m.group(1) == "corrupt_entries_total":
            name = "corrupt_entries"
        else:
            name = re.search(r'source="([a-z_]+)"', m.group(2)).group(1)
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def _delta(after: dict, before: dict) -> dict:
    return {
        k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before) if after.get(k) != before.get(k)
    }


def _flush(server) -> None:
    """Stock /flush_cache empties each scheduler's grammar cache (GrammarManager.clear -> backend.reset); it
    refuses while requests run, so it is retried until the schedulers are idle."""
    end = time.monotonic() + DEADLINE_S
    while True:
        r = server.post("/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        assert time.monotonic() < end, f"/flush_cache kept answering {r.status_code}: {r.text[:500]}"
        time.sleep(0.2)


def _entries(ns) -> dict:
    return {name: os.path.join(ns.entries, name) for name in os.listdir(ns.entries)}


def _until(what: str, cond):
    end = time.monotonic() + DEADLINE_S
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.2)


def test_corrupt_entries_are_quarantined_served_fresh_and_republished(dp2_server):
    from dspark_harden.grammar import disk

    root = str(dp2_server.workdir / "grammar-disk")
    (ns_path,) = _until("the server's grammar cache namespace", lambda: disk.namespaces(root) or None)
    ns = disk.Namespace.open_existing(ns_path)
    old = set(_entries(ns))
    # three uses each, one after another: whatever the DP balancer does, a scheduler sees each schema twice,
    # and a second use publishes a cheap key (DSPARK_HARDEN_GRAMMAR_DISK_PERSIST_MIN_COMPILE_S)
    for schema in SCHEMAS:
        for _ in range(3):
            _send(dp2_server, schema)
    ours = _until(
        "the three schemas published",
        lambda: (lambda new: new if len(new) == 3 else None)(sorted(set(_entries(ns)) - old)),
    )
    paths = [os.path.join(ns.entries, name) for name in ours]
    good = [open(p, "rb").read() for p in paths]
    for p, data in zip(paths, good):
        disk.decode_entry(p, data, ns.scope_hex, os.path.basename(p)[: -len(disk.ENTRY_SUFFIX)])  # published intact

    # damage them on disk: a flipped byte in the payload, a truncation, another key's entry in its place
    bad = [bytearray(good[0]), good[1][: len(good[1]) // 2], good[0]]
    bad[0][len(bad[0]) // 2] ^= 0x40
    bad = [bytes(b) for b in bad]
    for p, data in zip(paths, bad):
        tmp = p + ".drill"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, p)
    log_at = len(dp2_server.log_text())
    _flush(dp2_server)
    before = _sums(dp2_server)
    for schema in SCHEMAS:
        _send(dp2_server, schema)  # served: the request that meets the corrupt entry gets a fresh compile
    healed = _delta(_sums(dp2_server), before)
    assert healed.get("corrupt_entries") == 3 and healed.get("corrupt") == 3 and healed.get("disk", 0) == 0, healed

    # each entry kept in quarantine byte for byte, one ERROR line naming it
    quarantined = sorted(os.listdir(ns.quarantine))
    for p, data in zip(paths, bad):
        base = os.path.basename(p)
        moved = [q for q in quarantined if q.startswith(base + ".")]
        assert len(moved) == 1, (base, quarantined)
        with open(os.path.join(ns.quarantine, moved[0]), "rb") as fh:
            assert fh.read() == data, f"{moved[0]} is not the entry the request met"
    log = dp2_server.log_text()[log_at:]
    for p in paths:
        errors = [ln for ln in log.splitlines() if p in ln and "moved to" in ln and "compiled afresh" in ln]
        assert len(errors) == 1, (p, errors, log[-4000:])

    # republished from the fresh compiles; after a flush the schemas resolve from disk, nothing corrupt
    def republished():
        if not all(os.path.lexists(p) for p in paths):
            return None
        datas = [open(p, "rb").read() for p in paths]
        for p, data in zip(paths, datas):
            disk.decode_entry(p, data, ns.scope_hex, os.path.basename(p)[: -len(disk.ENTRY_SUFFIX)])
        return True

    _until("the healed schemas republished", republished)
    _flush(dp2_server)
    before = _sums(dp2_server)
    for schema in SCHEMAS:
        _send(dp2_server, schema)
    again = _delta(_sums(dp2_server), before)
    assert again.get("corrupt_entries", 0) == 0 and again.get("corrupt", 0) == 0 and again.get("compile", 0) == 0, again
    assert again.get("disk", 0) + again.get("local_compile", 0) == 3, again
