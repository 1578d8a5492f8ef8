"""The production-shaped trace: a seeded generator and the JSONL format ``--trace FILE`` replays.

One trace entry is one HTTP request to ``POST /generate`` (SGLang's native API: it carries
``routed_dp_rank`` and returns ``output_ids``). A JSONL trace file has one JSON object per line:

``t`` (required)
    arrival offset in seconds from the start of the replay (non-negative; lines need not be sorted)
``body`` (required)
    the ``/generate`` request body exactly as sent (``text`` a string, or a list for a batch;
    ``sampling_params``; optional ``routed_dp_rank``). ``stream`` is set by the replay, not here.
``stream`` (optional, default false)
    send with ``"stream": true`` and read server-sent events (time to first token is measured)
``check`` (optional)
    ``{"type": "json_schema", "schema": {...}}`` (every output must parse and validate with
    jsonschema) or ``{"type": "regex", "pattern": "..."}`` (every output must ``re.fullmatch``);
    EBNF entries of the generated trace carry an equivalent regex
``id``, ``kind`` (optional)
    a name for reports and a class (json, regex, ebnf, plain, routed, batch, burst, ...)

The generated trace (:func:`generate`) mixes, by default over 120 entries at 4 entries/s: JSON-schema requests
over many distinct real-world-like schemas (each used several times, also as whitespace and
schema-keyword-order variants that stock SGLang caches as different keys); a concurrent burst of
one brand-new schema; regex and EBNF requests; two explicitly routed batches of 64; single requests
routed to each DP rank; unrouted (load-balanced) requests; prompts that share one of a few long
prefixes (prefill served from the radix cache) and unique prompts of varied length; varied output
lengths (plain requests use ``ignore_eos`` so they produce exactly ``max_new_tokens``); ~30 %
streaming; Poisson arrivals at ``rate`` entries per second. Greedy (temperature 0) throughout.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

_WORDS = (
    "def",
    "return",
    "class",
    "self",
    "import",
    "value",
    "result",
    "for",
    "in",
    "range",
    "if",
    "else",
    "print",
    "list",
    "dict",
    "key",
    "items",
    "data",
    "path",
    "open",
    "read",
    "write",
    "config",
    "server",
    "request",
    "response",
    "token",
    "batch",
    "cache",
    "error",
    "None",
    "True",
    "False",
    "yield",
    "async",
    "await",
    "lambda",
    "with",
    "try",
    "except",
)

# Field pool of the generated schemas: every field's JSON text is bounded (enums, booleans,
# bounded integers, short patterned strings), so a random-weight model's constrained output ends.
# No free-form strings: xgrammar 0.2.7's JSON string rule admits raw control characters and
# byte tokens that do not decode as UTF-8 (measured: {"tag": "ified\x1d"} under maxLength 6, for
# stock and plugin alike), so a random model's free-form string is often not valid JSON.
_FIELDS: list[tuple[str, dict]] = [
    ("status", {"type": "string", "enum": ["active", "inactive", "pending"]}),
    ("priority", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("enabled", {"type": "boolean"}),
    ("currency", {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]}),
    ("code", {"type": "string", "pattern": "^[A-Z]{3}$"}),
    ("tag", {"type": "string", "pattern": "^[a-z]{1,6}$"}),
    ("count", {"type": "integer", "minimum": 0, "maximum": 99}),
    ("level", {"type": "string", "enum": ["debug", "info", "warn", "error"]}),
    ("role", {"type": "string", "enum": ["admin", "user", "guest"]}),
    ("verified", {"type": "boolean"}),
    ("zip", {"type": "string", "pattern": "^[0-9]{5}$"}),
    ("color", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("retries", {"type": "integer", "minimum": 0, "maximum": 9}),
    ("region", {"type": "string", "enum": ["eu", "us", "ap"]}),
    (
        "address",
        {
            "type": "object",
            "properties": {
                "country": {"type": "string", "enum": ["DE", "FR", "US"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["country", "zip"],
            "additionalProperties": False,
        },
    ),
    ("labels", {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}),
]
_DOMAINS = (
    "user",
    "order",
    "invoice",
    "event",
    "ticket",
    "device",
    "shipment",
    "account",
    "alert",
    "job",
    "sensor",
    "payment",
    "review",
    "session",
    "build",
    "policy",
)

REGEXES: list[str] = [
    r"(yes|no|maybe)",
    r"[0-9]{3}-[0-9]{4}",
    r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
    r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)",
    r"#[0-9a-f]{6}",
]
#: (EBNF grammar, an equivalent regex the output must fullmatch)
EBNFS: list[tuple[str, str]] = [
    ('root ::= "answer: " ("yes" | "no" | "unknown")', r"answer: (yes|no|unknown)"),
    ('root ::= digit digit? " " op " " digit\ndigit ::= [0-9]\nop ::= "+" | "-" | "*"', r"[0-9][0-9]? [+\-*] [0-9]"),
    ('root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= "x" | "y" | "z"', r"\[[xyz](,[xyz])?(,[xyz])?\]"),
]

BATCH_SIZE = 64
#: enough for the largest generated schema's compact JSON (2-4 bounded fields)
JSON_MAX_NEW_TOKENS = 96


def schema_pool(rng: random.Random, n: int) -> list[dict]:
    """``n`` distinct real-world-like object schemas (a domain title, 2-4 fields, all required)."""
    out, seen = [], set()
    while len(out) < n:
        domain = rng.choice(_DOMAINS)
        k = rng.randint(2, 4)
        fields = rng.sample(_FIELDS, k)
        key = (domain, tuple(f for f, _ in fields))
        if key in seen:
            continue
        seen.add(key)
        out.append(
            {
                "title": f"{domain}_{len(out)}",
                "description": f"A {domain} record",
                "type": "object",
                "properties": {name: dict(spec) for name, spec in fields},
                "required": [name for name, _ in fields],
                "additionalProperties": False,
            }
        )
    return out


def schema_variant(schema: dict, rng: random.Random) -> str:
    """One spelling of ``schema``: compact, pretty-printed, with a trailing newline, or with its
    top-level keywords in another order (never the order of ``properties``: that changes the grammar)."""
    choice = rng.randrange(4)
    if choice == 0:
        return json.dumps(schema)
    if choice == 1:
        return json.dumps(schema, indent=2)
    if choice == 2:
        return json.dumps(schema, separators=(",", ":")) + "\n"
    keys = list(schema)
    rng.shuffle(keys)
    return json.dumps({k: schema[k] for k in keys}, indent=rng.choice([None, 1, 4]))


@dataclass
class Prompts:
    rng: random.Random
    prefixes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefixes = [self.words(self.rng.randint(120, 220)) + "\n" for _ in range(3)]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def prompt(self) -> str:
        """Half share one of a few long prefixes (cached prefill after the first), half are unique
        and of varied length."""
        if self.rng.random() < 0.5:
            return self.rng.choice(self.prefixes) + self.words(self.rng.randint(3, 30))
        return self.words(int(self.rng.choice([4, 8, 16, 48, 120, 250])))


def _sp(max_new_tokens: int, **extra: Any) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra}


#: the default trace's kinds of single entries (fractions; the rest is plain)
DEFAULT_MIX = {"json": 0.38, "regex": 0.08, "ebnf": 0.05, "routed": 0.10}
#: ``bench serve --speculative``: weighted towards grammar-constrained requests (80 % constrained)
CONSTRAINED_MIX = {"json": 0.45, "regex": 0.20, "ebnf": 0.15, "routed": 0.10}


def _cuts(mix: dict) -> tuple:
    unknown = set(mix) - set(DEFAULT_MIX)
    if unknown or any(v < 0 for v in mix.values()) or sum(mix.values()) > 1.0 + 1e-9:
        raise ValueError(f"trace mix {mix}: kinds {sorted(DEFAULT_MIX)}, fractions >= 0 summing to <= 1")
    out, acc = [], 0.0
    for kind in ("json", "regex", "ebnf", "routed"):
        acc = round(acc + mix.get(kind, 0.0), 10)
        out.append(acc)
    return tuple(out)


def generate(
    seed: int = 0,
    requests: int = 120,
    rate: float = 4.0,
    *,
    batches: int = 2,
    burst: int = 12,
    schemas: int = 30,
    stream_fraction: float = 0.3,
    mix: Optional[dict] = None,
) -> list[dict]:
    """The default production-shaped trace (see the module docstring), ``requests`` entries, sorted by ``t``.
    ``mix``: fractions of the single entries by kind (json, regex, ebnf, routed; the rest plain),
    default :data:`DEFAULT_MIX`; :data:`CONSTRAINED_MIX` weights the trace towards grammar requests."""
    cut = _cuts(mix or DEFAULT_MIX)
    if requests < 1 or rate <= 0:
        raise ValueError("requests must be >= 1 and rate > 0")
    rng = random.Random(seed)
    prompts = Prompts(rng)
    pool = schema_pool(rng, schemas + 1)
    burst_schema, pool = pool[-1], pool[:-1]
    # a Zipf-like popularity: a few schemas are hot, many are rare (all of the first ones repeat)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(pool))]
    entries: list[dict] = []
    t = 0.0
    n_single = max(requests - batches - burst, 1)
    batch_at = {int(n_single * (i + 1) / (batches + 1)) for i in range(batches)}
    burst_at = n_single // 2 if burst else -1
    for i in range(n_single):
        t += rng.expovariate(rate)
        if i in batch_at:
            rank = len([e for e in entries if e["kind"] == "batch"]) % 2
            entries.append(
                {
                    "kind": "batch",
                    "t": t,
                    "stream": False,
                    "check": None,
                    "body": {
                        "text": [prompts.prompt() for _ in range(BATCH_SIZE)],
                        "sampling_params": _sp(rng.choice([8, 16]), ignore_eos=True),
                        "routed_dp_rank": rank,
                    },
                }
            )
            t += rng.expovariate(rate)
        if i == burst_at:
            # a burst of one schema nobody sent before, all at the same instant
            text = json.dumps(burst_schema)
            for _ in range(burst):
                entries.append(
                    {
                        "kind": "burst",
                        "t": t,
                        "stream": False,
                        "check": {"type": "json_schema", "schema": burst_schema},
                        "body": {
                            "text": prompts.prompt() + "\nJSON:",
                            "sampling_params": _sp(JSON_MAX_NEW_TOKENS, json_schema=text),
                        },
                    }
                )
            t += rng.expovariate(rate)
        r = rng.random()
        stream = rng.random() < stream_fraction
        if r < cut[0]:
            schema = rng.choices(pool, weights)[0]
            entries.append(
                {
                    "kind": "json",
                    "t": t,
                    "stream": stream,
                    "check": {"type": "json_schema", "schema": schema},
                    "body": {
                        "text": prompts.prompt() + "\nJSON:",
                        "sampling_params": _sp(JSON_MAX_NEW_TOKENS, json_schema=schema_variant(schema, rng)),
                    },
                }
            )
        elif r < cut[1]:
            pattern = rng.choice(REGEXES)
            entries.append(
                {
                    "kind": "regex",
                    "t": t,
                    "stream": stream,
                    "check": {"type": "regex", "pattern": pattern},
                    "body": {"text": prompts.prompt(), "sampling_params": _sp(32, regex=pattern)},
                }
            )
        elif r < cut[2]:
            grammar, pattern = rng.choice(EBNFS)
            entries.append(
                {
                    "kind": "ebnf",
                    "t": t,
                    "stream": stream,
                    "check": {"type": "regex", "pattern": pattern},
                    "body": {"text": prompts.prompt(), "sampling_params": _sp(32, ebnf=grammar)},
                }
            )
        elif r < cut[3]:
            entries.append(
                {
                    "kind": "routed",
                    "t": t,
                    "stream": stream,
                    "check": None,
                    "body": {
                        "text": prompts.prompt(),
                        "routed_dp_rank": rng.randrange(2),
                        "sampling_params": _sp(rng.choice([8, 16, 32]), ignore_eos=True),
                    },
                }
            )
        else:
            entries.append(
                {
                    "kind": "plain",
                    "t": t,
                    "stream": stream,
                    "check": None,
                    "body": {
                        "text": prompts.prompt(),
                        "sampling_params": _sp(rng.choice([8, 16, 32, 48]), ignore_eos=True),
                    },
                }
            )
    for i, e in enumerate(entries):
        e["id"] = f"r{i:05d}"
        e["t"] = round(e["t"], 4)
    return sorted(entries, key=lambda e: e["t"])


class TraceError(ValueError):
    """A ``--trace`` file line is not a valid trace entry (the message names the line)."""


def load(path: str | Path) -> list[dict]:
    """Read a JSONL trace (see the module docstring); raises :class:`TraceError` naming the bad line."""
    entries = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                e = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc})") from None
            if not isinstance(e, dict):
                raise TraceError(f"{where}: a trace entry is a JSON object")
            t = e.get("t")
            if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
                raise TraceError(f"{where}: 't' must be a non-negative number of seconds")
            body = e.get("body")
            if not isinstance(body, dict) or not isinstance(body.get("text"), (str, list)):
                raise TraceError(f"{where}: 'body' must be a /generate body object with 'text' (string or list)")
            if "stream" in body:
                raise TraceError(f"{where}: put 'stream' next to 'body', not inside it")
            check = e.get("check")
            if check is not None and not (
                isinstance(check, dict)
                and (
                    (check.get("type") == "json_schema" and isinstance(check.get("schema"), dict))
                    or (check.get("type") == "regex" and isinstance(check.get("pattern"), str))
                )
            ):
                raise TraceError(
                    f"{where}: 'check' must be {{'type': 'json_schema', 'schema': {{...}}}} "
                    f"or {{'type': 'regex', 'pattern': '...'}}"
                )
            stream = e.get("stream", False)
            if not isinstance(stream, bool):
                raise TraceError(f"{where}: 'stream' must be true or false")
            if stream and isinstance(body["text"], list):
                raise TraceError(f"{where}: a batch (list 'text') cannot be streamed by this replay")
            entries.append(
                {
                    "id": str(e.get("id", f"l{lineno}")),
                    "kind": str(e.get("kind", "custom")),
                    "t": float(t),
                    "stream": stream,
                    "check": check,
                    "body": body,
                }
            )
    if not entries:
        raise TraceError(f"{path}: no trace entries")
    return sorted(entries, key=lambda e: e["t"])


def dump(entries: list[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")


def items(entry: dict) -> int:
    """Requests an entry stands for (a batch of 64 is 64 requests)."""
    text = entry["body"]["text"]
    return len(text) if isinstance(text, list) else 1


#: output tokens of each request of the sequential gate (it compares tokens; one request at a time
#: on 2 loaded cores costs ~0.2-1 s per token)
SEQ_MAX_NEW_TOKENS = 16


def sequential_subset(entries: list[dict], n: int, max_new_tokens: int = SEQ_MAX_NEW_TOKENS) -> list[dict]:
    """Copies of the first ``n`` single (non-batch) entries, spread over every kind present, for the
    one-at-a-time correctness gate (sent non-streaming: the gate compares tokens, not timing), each
    capped at ``max_new_tokens`` output tokens (a capped constrained output is not validated)."""
    singles = [e for e in entries if items(e) == 1 and not isinstance(e["body"]["text"], list)]
    by_kind: dict[str, list[dict]] = {}
    for e in singles:
        by_kind.setdefault(e["kind"], []).append(e)
    out: list[dict] = []
    while len(out) < min(n, len(singles)):
        for kind in sorted(by_kind):
            if by_kind[kind] and len(out) < n:
                out.append(by_kind[kind].pop(0))
    capped = []
    for e in out:
        sp = dict(e["body"].get("sampling_params", {}))
        sp["max_new_tokens"] = min(int(sp.get("max_new_tokens", max_new_tokens)), max_new_tokens)
        capped.append({**e, "check": None, "body": {**e["body"], "sampling_params": sp}})
    return capped


def describe(entries: list[dict]) -> dict:
    kinds: dict[str, int] = {}
    for e in entries:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + items(e)
    schemas = {
        json.dumps(e["check"]["schema"], sort_keys=True)
        for e in entries
        if e.get("check") and e["check"]["type"] == "json_schema"
    }
    spellings = {
        e["body"]["sampling_params"].get("json_schema")
        for e in entries
        if "json_schema" in e["body"].get("sampling_params", {})
    }
    return {
        "entries": len(entries),
        "requests": sum(items(e) for e in entries),
        "by_kind": kinds,
        "distinct_schemas": len(schemas),
        "distinct_schema_spellings": len(spellings),
        "streaming": sum(1 for e in entries if e.get("stream")),
        "duration_s": round(max(e["t"] for e in entries), 3),
    }


def check_output(check: Optional[dict], text: str) -> Optional[str]:
    """None when ``text`` satisfies ``check``, else why not."""
    if not check:
        return None
    if check["type"] == "regex":
        import re

        return None if re.fullmatch(check["pattern"], text) else f"does not match /{check['pattern']}/"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc})"
    import jsonschema

    try:
        # corpus schemas name their draft (the JSON Schema Test Suite's draft3/draft4 have no $schema)
        validator = {"draft3": jsonschema.Draft3Validator, "draft4": jsonschema.Draft4Validator}.get(check.get("draft"))
        if validator is not None:
            validator(check["schema"]).validate(value)
        else:
            jsonschema.validate(value, check["schema"])
    except jsonschema.ValidationError as exc:
        return f"schema violation: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - a schema the validator cannot use is a failed check, not a crash
        return f"the validator could not check it: {type(exc).__name__}: {str(exc)[:200]}"
    return None


#: the JSON Schema Test Suite (npm package, installed by scripts/install.sh; tests/grammar/corpus.py)
CORPUS_PACKAGE = "json-schema-test-suite"
CORPUS_DRAFTS = ("draft4", "draft3")


def corpus_dir() -> Path:
    import os

    prefix = os.environ.get("DSPARK_HARDEN_NPM_PREFIX", os.path.join("~", ".cache", "dspark-harden", "npm"))
    return Path(os.path.expanduser(prefix)).resolve() / "node_modules" / CORPUS_PACKAGE / "tests"


def load_corpus(drafts=CORPUS_DRAFTS, *, with_cases: bool = False) -> list[tuple]:
    """[(name, draft, schema)]: every distinct object schema of the suite's test groups, stable order
    (as tests/grammar/corpus.py); ``with_cases``: (name, draft, schema, [the suite's test data of every
    group with that schema]). Raises :class:`TraceError` naming the set-up step when missing."""
    root = corpus_dir()
    if not all((root / d).is_dir() for d in drafts):
        raise TraceError(
            f"--corpus: the JSON Schema Test Suite is missing at {root}: run scripts/install.sh "
            f"(npm package {CORPUS_PACKAGE})"
        )
    seen: dict[str, tuple] = {}
    for draft in drafts:
        for path in sorted((root / draft).rglob("*.json")):
            for i, group in enumerate(json.loads(path.read_text(encoding="utf-8"))):
                schema = group.get("schema")
                if isinstance(schema, dict):
                    key = json.dumps(schema, sort_keys=True)
                    entry = seen.setdefault(key, (f"{path.relative_to(root).with_suffix('')}#{i}", draft, schema, []))
                    entry[3].extend(t["data"] for t in group.get("tests", ()) if "data" in t)
    return [v if with_cases else v[:3] for v in seen.values()]


def _refs(node) -> list:
    if isinstance(node, dict):
        out = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        for v in node.values():
            out += _refs(v)
        return out
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


#: keywords bounding a JSON *number* that xgrammar's grammar does not enforce: its number rule lets an
#: exponent through, so "maximum" 9.7e26 still admits 121212e1000 (parsed as inf). Seen in a bench run;
#: a schema with them would report xgrammar's limit, identical on stock and plugin, as an invalid output.
NUMBER_BOUNDS = ("maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum", "multipleOf")


def _number_bounds(node) -> bool:
    if isinstance(node, dict):
        typ = node.get("type")
        numeric = typ == "number" or (isinstance(typ, list) and "number" in typ) or typ is None
        if numeric and any(k in node for k in NUMBER_BOUNDS) and typ != "integer":
            return True
        return any(_number_bounds(v) for v in node.values())
    if isinstance(node, list):
        return any(_number_bounds(v) for v in node)
    return False


#: draft-3 keywords whose meaning xgrammar (a draft-2020 reader) does not apply: a property's boolean
#: ``required`` (seen in a bench run: ``{}`` passed xgrammar for a draft-3 schema requiring "bar").
DRAFT3_ONLY = ("divisibleBy", "disallow", "extends")


def _draft3_only(node) -> bool:
    if isinstance(node, dict):
        if isinstance(node.get("required"), bool) or any(k in node for k in DRAFT3_ONLY):
            return True
        return any(_draft3_only(v) for v in node.values())
    if isinstance(node, list):
        return any(_draft3_only(v) for v in node)
    return False


def usable_reason(schema: dict, draft: Optional[str] = None) -> Optional[str]:
    """None when the server compiles ``schema`` the way SGLang's xgrammar backend does
    (``validate_xgrammar_json_schema`` then xgrammar) and the grammar enforces what the validator
    checks; else why the corpus draw leaves it out."""
    if draft == "draft3" and _draft3_only(schema):
        return "draft-3 keywords xgrammar does not apply (boolean required, divisibleBy, disallow, extends)"
    remote = [r for r in _refs(schema) if not r.startswith("#")]
    if remote:
        return f"non-local $ref {remote[0]!r} (neither xgrammar nor the validator resolves it)"
    if _number_bounds(schema):
        return "bounds on a JSON number (xgrammar admits any exponent)"
    try:
        import xgrammar as xgr
        from sglang.srt.constrained.xgrammar_backend import validate_xgrammar_json_schema

        validate_xgrammar_json_schema(schema)
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as exc:  # noqa: BLE001 - unsupported keywords, invalid schemas
        return f"not compiled: {type(exc).__name__}: {str(exc)[:120]}"
    return None


def _compiles(schema: dict) -> bool:
    """Whether the server's backend compiles ``schema`` into a grammar that enforces it."""
    return usable_reason(schema) is None


def check_prefix(check: dict, output_ids, tokenizer_dir: str) -> Optional[str]:
    """For an output cut by ``max_new_tokens``: None when a real xgrammar matcher of the same
    constraint accepts every output token (a valid prefix: the constraint held), else why not."""
    import xgrammar as xgr

    compiler = _prefix_compiler(tokenizer_dir)
    if check["type"] == "regex":
        ctx = compiler.compile_regex(check["pattern"])
    else:
        ctx = compiler.compile_json_schema(json.dumps(check["schema"]), any_whitespace=False)
    matcher = xgr.GrammarMatcher(ctx)
    for i, tok in enumerate(output_ids):
        if not matcher.accept_token(int(tok)):
            return f"token {i} ({int(tok)}) of a truncated output is not accepted by the constraint"
    return None


_COMPILERS: dict = {}


def _prefix_compiler(tokenizer_dir: str):
    comp = _COMPILERS.get(tokenizer_dir)
    if comp is None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        comp = _COMPILERS[tokenizer_dir] = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    return comp


def leak(check: dict, documents: list, tokenizer_dir: str) -> Optional[str]:
    """The first document the constraint's real xgrammar grammar accepts although :func:`check_output`
    rejects it (the grammar does not enforce part of the schema: e.g. ``maxLength`` without a
    ``type``), or None. Documents are tried in both JSON spellings xgrammar may expect."""
    import xgrammar as xgr

    ctx = _prefix_compiler(tokenizer_dir).compile_json_schema(json.dumps(check["schema"]), any_whitespace=False)
    for doc in documents:
        for seps in ((", ", ": "), (",", ":")):
            text = json.dumps(doc, separators=seps)
            m = xgr.GrammarMatcher(ctx)
            if m.accept_string(text) and m.accept_token(m.stop_token_ids[0]) and m.is_terminated():
                if check_output(check, text):
                    return text[:80]
                break
    return None


def corpus_entries(
    n: int,
    entries: list[dict],
    *,
    seed: int = 0,
    max_new_tokens: int = JSON_MAX_NEW_TOKENS,
    compiles=_compiles,
    tokenizer_dir: Optional[str] = None,
) -> tuple[list[dict], dict]:
    """``n`` json_schema entries drawn (seeded, spread over the whole corpus) from the schemas of the
    JSON Schema Test Suite the server can hold (:func:`usable_reason`; with ``tokenizer_dir``, also
    none of the suite's own test documents of that schema may pass the grammar while failing the
    validator: :func:`leak`), at arrival times spread over ``entries``' duration; the check
    validates each output with the schema's own draft. Returns the entries and what was drawn from
    (corpus size, usable, left out by reason)."""
    corpus = load_corpus(with_cases=True)
    usable, left_out = [], {}

    def skip(why: str) -> None:
        left_out[why] = left_out.get(why, 0) + 1

    for name, draft, schema, cases in corpus:
        if draft == "draft3" and _draft3_only(schema):
            skip("draft-3 keywords xgrammar does not apply")
        elif not compiles(schema):
            skip("not held by the server's grammar (usable_reason)")
        elif tokenizer_dir and leak({"type": "json_schema", "schema": schema, "draft": draft}, cases, tokenizer_dir):
            skip("a test document of the suite passes the grammar but fails the schema")
        else:
            usable.append((name, draft, schema))
    rng = random.Random(seed + 7919)
    chosen = rng.sample(usable, min(n, len(usable)))
    span = max((e["t"] for e in entries), default=1.0) or 1.0
    prompts = Prompts(rng)
    out = []
    for i, (name, draft, schema) in enumerate(chosen):
        out.append(
            {
                "id": f"c{i:05d}",
                "kind": "corpus",
                "t": round(rng.uniform(0, span), 4),
                "stream": False,
                "corpus": name,
                "check": {"type": "json_schema", "schema": schema, "draft": draft},
                "body": {
                    "text": prompts.prompt() + "\nJSON:",
                    "sampling_params": _sp(max_new_tokens, json_schema=json.dumps(schema)),
                },
            }
        )
    info = {"corpus_schemas": len(corpus), "usable": len(usable), "drawn": len(out), "left_out": left_out}
    return out, info
