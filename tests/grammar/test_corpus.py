"""A real-world corpus — every schema of the JSON Schema Test Suite (npm ``json-schema-test-suite``,
drafts 3 and 4, installed by scripts/install.sh) — through stock SGLang's XGrammarGrammarBackend and
through the grammar service + persistent compiler (issue 11, "Tests that must exist"):

1. accept/reject (and the error message) identical to stock for every schema;
2. one compile per canonical key under a concurrent burst of the whole corpus (every schema in
   four spellings from 8 threads): ``service.compiles`` and the PersistentCompiler's native compile
   count both equal the number of distinct canonical keys (that reach the compiler);
3. property tests with ``hypothesis-jsonschema``: for every accepted draft-4 schema, valid instances
   are generated and walked token by token (the locally generated 2048-token tokenizer): stock's
   matcher and ours — served from memory and, after a restart, from the disk cache — fill identical
   masks and make identical accept decisions at every step; and every generated instance is accepted
   (by stock and by us) except where xgrammar 0.2.7 itself departs from JSON Schema (listed below,
   with the measured reason; stock and ours still agree there).

Instances are generated from the schema as xgrammar reads it (``xgrammar_view``): xgrammar compiles
in strict mode (no properties or tuple items beyond those declared), infers ``object``/``array`` from
the keywords present, matches ``pattern``/``patternProperties`` against the whole string, and emits
object members in declared order — so an instance is serialized compactly with its members in
declared order, and strings under a length or pattern constraint avoid characters that need a JSON
escape (xgrammar's constrained strings have no escapes; an escaped astral character would count as
two). That is how a model constrained by the grammar writes them, and still a valid instance.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import xgrammar as xg

from dspark_harden.grammar.canonical import canonical_key
from dspark_harden.grammar.schemas import variants
from dspark_harden.grammar.settings import DISK_QUEUE

from . import corpus
from .conftest import close_parts, persistent_backend, service_for, stock_backend

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis_jsonschema import from_schema
except ImportError as exc:  # a missing test dependency fails, never skips
    pytest.fail(
        f"{exc}: the corpus property tests need hypothesis and hypothesis-jsonschema: run scripts/install.sh",
        pytrace=False,
    )

EXAMPLES = 25  # hypothesis examples per schema (derandomized: the same instances every run)
MIN_CORPUS = 100  # distinct schemas expected from the suite (drafts 3 + 4)
MIN_PROPERTY_SCHEMAS = 55  # accepted draft-4 schemas that get generated instances

# xgrammar 0.2.7 departures from JSON Schema seen on this corpus (instance valid, grammar rejects it;
# identical for stock and for us): suite schema name -> measured reason.
KNOWN_XGRAMMAR_GAPS: dict[str, str] = {
    "draft4/properties#1": 'xgrammar 0.2.7 compiles {"type": "array", "maxItems": 3} without "items" to the '
    'empty array only (measured: "[]" accepted, "[1]" rejected)',
}
_LOG_STAMP = re.compile(r"^\[\d\d:\d\d:\d\d\] ")  # xgrammar prefixes its messages with the time


def _is_invalid(obj) -> bool:
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    return isinstance(obj, InvalidGrammarObject)


def _outcome(obj) -> tuple:
    if _is_invalid(obj):
        return ("invalid", _LOG_STAMP.sub("", obj.error_message))
    return ("grammar", type(obj).__name__)


def _reaches_compiler(text: str) -> bool:
    """Whether stock's dispatch_json would call the compiler for this key (after its pre-check)."""
    from sglang.srt.constrained.json_schema_validation import validate_xgrammar_json_schema

    try:
        validate_xgrammar_json_schema(json.loads(text))
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.fixture(scope="module")
def schemas():
    return corpus.load()


@pytest.fixture(scope="module")
def world(hf_tokenizer, schemas, tmp_path_factory):
    """Stock results, a concurrent burst of the whole corpus through our service, and a restart."""
    cache = tmp_path_factory.mktemp("corpus-cache")
    # every entry serialized (huge load ratio) and a publication queue that holds the whole burst
    knobs = {
        "DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO": "1e9",
        "DSPARK_HARDEN_GRAMMAR_COMPILER_THREADS": 1,
        DISK_QUEUE: 4096,
    }
    stock = stock_backend(hf_tokenizer)
    stock_out = {name: stock._init_value_dispatch(("json", json.dumps(s)), False) for name, s in schemas}

    ours = persistent_backend(hf_tokenizer, cache, **knobs)
    svc = service_for(ours, workers=2)
    requests = [(name, ("json", text)) for name, s in schemas for text in variants(s)]
    gate = threading.Barrier(8)
    results: list = [None] * len(requests)

    def worker(k):
        gate.wait()
        for i in range(k, len(requests), 8):
            results[i] = svc.lookup(requests[i][1], False)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [(name, v if hit else v.result(timeout=300)) for (name, _), (v, hit) in zip(requests, results)]
    ours.grammar_compiler.flush()

    keys = {canonical_key(key) for _, key in requests}
    restart_backend = persistent_backend(hf_tokenizer, cache, **knobs)
    restart = service_for(restart_backend)
    yield {
        "stock": stock_out,
        "served": served,
        "svc": svc,
        "backend": ours,
        "keys": keys,
        "restart": restart,
        "requests": requests,
        "cache": cache,
        "knobs": knobs,
    }
    # module-scoped: built before the per-test close-up (tests/grammar/conftest.py) is in force
    close_parts(svc, restart, ours.grammar_compiler, restart_backend.grammar_compiler, stock)


def test_corpus_is_installed_and_large(schemas):
    assert len(schemas) >= MIN_CORPUS, f"only {len(schemas)} schemas in the JSON Schema Test Suite corpus"


def test_accept_reject_identical_to_stock_for_every_schema(world, schemas):
    stock = world["stock"]
    assert any(_is_invalid(v) for v in stock.values()) and any(not _is_invalid(v) for v in stock.values())
    diffs = [
        (name, _outcome(stock[name]), _outcome(got))
        for name, got in world["served"]
        if _outcome(got) != _outcome(stock[name])
    ]
    assert not diffs, diffs[:5]
    assert len(world["served"]) == 4 * len(schemas)
    # SGLang's own pre-check (validate_xgrammar_json_schema) is among the rejections, unchanged
    assert any("would be ignored" in _outcome(v)[1] for v in stock.values() if _is_invalid(v))


def test_one_compile_per_canonical_key_under_a_burst(world, schemas):
    keys, svc, backend = world["keys"], world["svc"], world["backend"]
    # four spellings per schema collapse to one key; distinct schemas keep distinct keys
    assert len(keys) == len(schemas) and len(world["requests"]) == 4 * len(keys)
    assert svc.compiles == len(keys), (svc.compiles, len(keys))  # stock: one per request
    reaching = {k for k in keys if _reaches_compiler(k[1])}
    assert 0 < len(reaching) < len(keys)
    assert backend.grammar_compiler.native_compiles == len(reaching)


# -- property tests ---------------------------------------------------------------------------

_OBJECT_KEYWORDS = ("properties", "additionalProperties", "patternProperties", "required")
_ARRAY_KEYWORDS = ("items", "additionalItems", "minItems", "maxItems")
_PLAIN_CHAR = '[^\\x00-\\x1f"\\\\]'  # a character that needs no JSON escape


def xgrammar_view(s, strict: bool = True):
    """The schema as xgrammar 0.2.7 enforces it (see the module docstring), for generation only.
    ``allOf`` with several branches is enforced loosely by xgrammar 0.2.7 ("support for allOf with
    multiple options is still ongoing": any object passes), so no strictness is added there."""
    if isinstance(s, list):
        return [xgrammar_view(x, strict) for x in s]
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k == "patternProperties" and isinstance(v, dict):
            out[k] = {f"^(?:{n})$": xgrammar_view(x) for n, x in v.items()}
        elif k == "pattern" and isinstance(v, str):
            out[k] = f"^(?:{v})$"
        elif k in ("properties", "definitions") and isinstance(v, dict):
            out[k] = {n: xgrammar_view(x) for n, x in v.items()}
        elif k == "allOf":
            out[k] = xgrammar_view(v, strict=False)
        elif k in ("items", "additionalItems", "additionalProperties", "not", "anyOf", "oneOf"):
            out[k] = xgrammar_view(v)
        else:
            out[k] = v
    if "type" not in out and "enum" not in out and "$ref" not in out:
        if any(k in out for k in _OBJECT_KEYWORDS):
            out["type"] = "object"
        elif any(k in out for k in _ARRAY_KEYWORDS):
            out["type"] = "array"
    if strict and out.get("type") == "object" and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    if out.get("type") == "array" and isinstance(out.get("items"), list) and "additionalItems" not in out:
        out["additionalItems"] = False
    if ("minLength" in out or "maxLength" in out) and "pattern" not in out and out.get("type", "string") == "string":
        # the length in the regex itself: hypothesis generates it directly instead of filtering
        out["pattern"] = f"^{_PLAIN_CHAR}{{{out.get('minLength', 0)},{out.get('maxLength', '')}}}$"
    return out


def _resolve(s, root):
    for _ in range(32):
        if not (isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#")):
            return s
        node = root
        for part in s["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
        s = node
    return s


def declared_order(x, s, root):
    """``x`` with object members in the order the schema declares them (xgrammar's order)."""
    s = _resolve(s, root)
    if not isinstance(s, dict):
        return x
    branches = [_resolve(b, root) for k in ("allOf", "anyOf", "oneOf") for b in s.get(k, []) or []]
    if isinstance(x, dict):
        order, subs = [], {}
        for node in [s, *[b for b in branches if isinstance(b, dict)]]:
            for n, sub in (node.get("properties") or {}).items():
                if n not in subs:
                    order.append(n)
                    subs[n] = sub
        addl = s.get("additionalProperties")
        rest = addl if isinstance(addl, dict) else {}
        keys = sorted(x, key=lambda k: order.index(k) if k in order else len(order))
        return {k: declared_order(x[k], subs.get(k, rest), root) for k in keys}
    if isinstance(x, list):
        items = s.get("items")
        if isinstance(items, list):
            extra = s.get("additionalItems") if isinstance(s.get("additionalItems"), dict) else {}
            return [declared_order(v, items[i] if i < len(items) else extra, root) for i, v in enumerate(x)]
        return [declared_order(v, items if isinstance(items, dict) else {}, root) for v in x]
    return x


def _instances(schema) -> tuple[list, str]:
    """Up to EXAMPLES valid instances (derandomized), or ([], why not)."""
    found: list = []

    @settings(
        max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(from_schema(xgrammar_view(schema)))
    def collect(instance):
        found.append(instance)

    try:
        collect()
    except Exception as exc:  # noqa: BLE001 - remote / recursive $ref, unsatisfiable: no generator
        return [], f"{type(exc).__name__}: {str(exc)[:120]}"
    return found, ""


def _walk(matchers: dict, tokens: list, vocab: int, stop: int) -> dict:
    """Drive every matcher with ``tokens`` then the stop token, comparing with stock at each step.
    Returns {"mismatch": None | (source, step, what), "accepted": {source: bool}}."""
    ref, got = xg.allocate_token_bitmask(1, vocab), xg.allocate_token_bitmask(1, vocab)
    alive = {name: True for name in matchers}
    for m in matchers.values():
        m.reset()
    for step, token in enumerate([*tokens, stop]):
        stock = matchers["stock"]
        if not alive["stock"]:
            break
        stock.fill_next_token_bitmask(ref)
        for name, m in matchers.items():
            if name == "stock":
                continue
            if not alive[name]:
                return {"mismatch": (name, step, "rejected earlier than stock"), "accepted": alive}
            got.fill_(0)
            m.fill_next_token_bitmask(got)
            if not torch.equal(ref, got):
                return {"mismatch": (name, step, "mask differs"), "accepted": alive}
        decisions = {name: m.accept_token(token) for name, m in matchers.items() if alive[name]}
        if len(set(decisions.values())) > 1:
            return {
                "mismatch": (
                    next(n for n, d in decisions.items() if d != decisions["stock"]),
                    step,
                    "accept decision differs",
                ),
                "accepted": alive,
            }
        for name, ok in decisions.items():
            alive[name] = ok
    accepted = {name: alive[name] and m.is_terminated() for name, m in matchers.items()}
    return {"mismatch": None, "accepted": accepted}


@pytest.fixture(scope="module")
def walks(world, schemas, hf_tokenizer):
    draft4 = {name for name, _ in corpus.load(drafts=("draft4",))}
    by_name = dict(schemas)
    memory = {}
    for name, got in world["served"]:
        memory.setdefault(name, got)
    vocab, stop = len(hf_tokenizer), hf_tokenizer.eos_token_id
    out, no_generator = [], {}
    for name in sorted(draft4):
        if name not in by_name or _is_invalid(world["stock"][name]):
            continue
        schema = by_name[name]
        instances, why = _instances(schema)
        if not instances:
            no_generator[name] = why
            continue
        ours_mem, _ = world["svc"].lookup(("json", json.dumps(schema)), False)  # memory hit: a copy
        disk_future, _ = world["restart"].lookup(("json", json.dumps(schema, indent=2)), False)
        ours_disk = disk_future.result(timeout=300)
        matchers = {"stock": world["stock"][name].matcher, "memory": ours_mem.matcher, "disk": ours_disk.matcher}
        for inst in instances:
            text = json.dumps(declared_order(inst, schema, schema), separators=(",", ":"), ensure_ascii=False)
            tokens = hf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            rec = _walk(matchers, tokens, vocab, stop)
            rec.update(schema=name, text=text, disk_source=disk_future.source)
            out.append(rec)
    return {"records": out, "no_generator": no_generator}


def test_masks_identical_to_stock_along_generated_instances(walks):
    records = walks["records"]
    assert len({r["schema"] for r in records}) >= MIN_PROPERTY_SCHEMAS, walks["no_generator"]
    # hypothesis-jsonschema cannot generate only for remote or recursive $refs
    assert all("RefResolutionError" in why for why in walks["no_generator"].values()), walks["no_generator"]
    bad = [(r["schema"], r["mismatch"], r["text"][:120]) for r in records if r["mismatch"] is not None]
    assert not bad, bad[:5]
    assert {r["disk_source"] for r in records} <= {"disk", "local_compile"}
    assert "disk" in {r["disk_source"] for r in records}


_OTHER_PROCESS = r"""
import hashlib, json, sys
import torch, xgrammar as xg
from transformers import AutoTokenizer
from dspark_harden.devtools.tiny_models import ensure_tokenizer
from tests.grammar.conftest import close_parts, persistent_backend, service_for

job = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(ensure_tokenizer(2048))
backend = persistent_backend(tok, job["cache"], **job["knobs"])
svc = service_for(backend)
out, sources = [], {}
for schema, tokens in job["walks"]:
    value, hit = svc.lookup(("json", schema), False)  # a schema with several instances: memory hits after the first
    grammar = value if hit else value.result(timeout=300)
    source = sources.setdefault(schema, "memory" if hit else value.source)
    m, mask, digests = grammar.matcher, xg.allocate_token_bitmask(1, len(tok)), []
    for t in tokens:
        mask.fill_(0)
        m.fill_next_token_bitmask(mask)
        digests.append(hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16] + ("+" if m.accept_token(t) else "-"))
        if digests[-1].endswith("-"):
            break
    out.append({"source": source, "digests": digests})
close_parts(svc, backend.grammar_compiler)
print(json.dumps(out))
"""


def test_masks_identical_to_stock_from_the_disk_cache_in_another_process(world, walks, schemas, hf_tokenizer):
    """Across processes: a fresh interpreter opens the corpus run's disk cache (a real scheduler-shaped
    backend: stock XGrammarGrammarBackend + our persistent compiler and service), loads every walked
    schema (a spelling this process never used) and walks the same token sequences; at every step its
    mask (digest) and accept decision equal stock's in this process, on a fresh stock matcher."""
    import hashlib
    import subprocess
    import sys

    by_name = dict(schemas)
    todo, want = [], []
    for r in walks["records"][:400]:
        schema = by_name[r["schema"]]
        tokens = hf_tokenizer.encode(r["text"], add_special_tokens=False, split_special_tokens=True)
        stock = world["stock"][r["schema"]].copy().matcher
        mask, digests = xg.allocate_token_bitmask(1, len(hf_tokenizer)), []
        for t in tokens:
            mask.fill_(0)
            stock.fill_next_token_bitmask(mask)
            digests.append(
                hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16] + ("+" if stock.accept_token(t) else "-")
            )
            if digests[-1].endswith("-"):
                break
        todo.append((json.dumps(schema, separators=(",", ":"), sort_keys=False) + " ", tokens))
        want.append(digests)
    job = {"cache": str(world["cache"]), "knobs": {k: str(v) for k, v in world["knobs"].items()}, "walks": todo}
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == len(want) >= MIN_PROPERTY_SCHEMAS
    bad = [(i, todo[i][0][:80]) for i, (g, w) in enumerate(zip(got, want)) if g["digests"] != w]
    assert not bad, bad[:5]
    sources = {g["source"] for g in got}
    assert sources <= {"disk", "local_compile"} and "disk" in sources, sources


def test_every_generated_instance_is_accepted(walks, schemas):
    names = {n for n, _ in schemas}
    assert set(KNOWN_XGRAMMAR_GAPS) <= names, "a listed xgrammar gap is no longer in the corpus"
    rejected = [
        (r["schema"], r["text"][:160], r["accepted"])
        for r in walks["records"]
        if r["schema"] not in KNOWN_XGRAMMAR_GAPS and not all(r["accepted"].values())
    ]
    assert not rejected, rejected[:8]
