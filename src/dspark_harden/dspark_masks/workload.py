"""Realistic DSpark grammar workloads on real SGLang grammar objects (bench and tests).

Requests carry the grammar objects SGLang 0.5.23 itself builds: ``XGrammarGrammar`` from the stock
``XGrammarGrammarBackend`` (real tokenizer, real xgrammar compile of a mix of JSON schemas and a
regex; mix ``all`` adds an EBNF grammar with free-text identifiers), some wrapped in a stock ``ReasonerGrammarObject`` (thinking and generation
phases). Each request has accepted a random valid prefix of an instance of its grammar; its draft
chain (column 0 = the committed token) continues that instance and may carry an invalid token at
any depth, an out-of-vocab token, the end-of-sequence token (grammar terminates mid-chain) or, in
the thinking phase, the think-end token at any depth. Some requests have no grammar.

Stand-in: the request objects are :class:`Req` (``rid`` + ``grammar``), not SGLang's ``Req`` (whose
constructor needs a tokenized request); stock ``generate_token_bitmask`` reads only ``req.grammar``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

SCHEMAS = [
    (
        "json",
        '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}',
        '{"name": "Alice Smith", "age": 42}',
    ),
    ("json", '{"type":"array","items":{"type":"number"}}', "[1.5, 2, 3.25, 4, 5, 6.125, 7]"),
    (
        "json",
        '{"type":"object","properties":{"color":{"enum":["red","green","blue"]},"point":{"type":"object",'
        '"properties":{"x":{"type":"integer"},"y":{"type":"integer"}},"required":["x","y"]}},'
        '"required":["color","point"]}',
        '{"color": "green", "point": {"x": 10, "y": -3}}',
    ),
    (
        "json",
        '{"type":"object","properties":{"id":{"type":"string","pattern":"^[a-z]{3}-[0-9]{4}$"},'
        '"tags":{"type":"array","items":{"type":"string"}},"ok":{"type":"boolean"}},"required":["id","tags","ok"]}',
        '{"id": "abc-1234", "tags": ["x", "yy", "zzz"], "ok": true}',
    ),
    ("regex", r"(\d{3}-){2}\d{4} (yes|no)", "555-123-4567 yes"),
]
# Free-text identifier states are where xgrammar's own mask fill is expensive (~0.1-0.25 ms per
# fill at a 32k code-trained vocabulary, vs 1-30 us for JSON structure and strings); stock and ours
# do exactly the same fills, so such grammars bound the speedup (docs/dspark_masks.md).
EXPENSIVE = [
    (
        "ebnf",
        'root ::= "SELECT " cols " FROM " name ";"\ncols ::= name (", " name)*\nname ::= [a-z]+',
        "SELECT alpha, beta, gamma FROM delta;",
    ),
]
MIXES = {"json": SCHEMAS, "all": SCHEMAS + EXPENSIVE}


@dataclass
class Req:
    rid: str
    grammar: Any = None


@dataclass
class Workload:
    reqs: list
    draft: torch.Tensor  # (bs, chain) int64
    vocab_size: int
    think_end_ids: tuple
    eos_id: int
    kinds: list = field(default_factory=list)  # per request: what its chain exercises


class GrammarFactory:
    """Compiles each grammar once with the stock backend; hands out per-request copies."""

    def __init__(self, vocab: int = 32000, pad: int = 0, mix: str = "json") -> None:
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
        from transformers import AutoTokenizer

        from ..devtools.tiny_models import ensure_tokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(ensure_tokenizer(vocab))
        # model vocab padded past the tokenizer, as real checkpoints do
        self.vocab_size = len(self.tokenizer) + pad
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.think_end_ids = (self.tokenizer.convert_tokens_to_ids("</think>"),)
        self.backend = XGrammarGrammarBackend(
            self.tokenizer, vocab_size=self.vocab_size, model_eos_token_ids=[self.eos_id]
        )
        self.compiled = []
        if mix not in MIXES:
            raise ValueError(f"unknown grammar mix {mix!r}; expected one of {sorted(MIXES)}")
        for kind, spec, instance in MIXES[mix]:
            g = getattr(self.backend, f"dispatch_{kind}")(spec)
            ids = self.tokenizer.encode(instance, add_special_tokens=False)
            m = g.copy()
            for i, t in enumerate(ids):
                if not m.matcher.accept_token(t):
                    raise RuntimeError(f"instance token {i} of {instance!r} not accepted by its own grammar")
            self.compiled.append((g, ids + [self.eos_id]))

    def reasoner(self, inner, reasoning: bool):
        from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

        obj = ReasonerGrammarObject(inner, think_end_ids=self.think_end_ids)
        obj.maybe_init_reasoning(reasoning)
        return obj

    def workload(
        self,
        bs: int,
        chain: int,
        seed: int = 0,
        *,
        no_grammar: float = 0.1,
        reasoning: float = 0.2,
        corrupt: float = 0.3,
        tail: float = 1.0,
    ) -> Workload:
        """``corrupt``: fraction of grammar chains with one invalid / out-of-vocab / stop token at a
        random depth; ``tail``: fraction whose accepted prefix is drawn from the whole instance (so
        the chain may run into the end of the instance and the stop token: termination mid-chain);
        the others continue inside the instance (a draft model that follows the grammar)."""
        rng = random.Random(seed)
        V = self.vocab_size
        reqs, rows, kinds = [], [], []
        for r in range(bs):
            base, ids = self.compiled[rng.randrange(len(self.compiled))]
            roll = rng.random()
            if roll < no_grammar:
                reqs.append(Req(f"req-{r}", None))
                rows.append([rng.randrange(V) for _ in range(chain)])
                kinds.append("no-grammar")
                continue
            g = base.copy()
            kind = "plain"
            # prefix already accepted (with `tail`: possibly the whole instance, even the eos)
            k = rng.randint(0, len(ids)) if rng.random() < tail else rng.randint(0, max(0, len(ids) - chain))
            thinking = roll < no_grammar + reasoning
            if thinking:
                obj = self.reasoner(g, reasoning=True)
                think = [rng.randrange(4, len(self.tokenizer) - 2) for _ in range(rng.randint(0, 3))]
                for t in think:
                    obj.accept_token(t)
                pos = rng.randint(1, chain)  # think-end at this chain position (== chain: not inside)
                body = [rng.randrange(4, len(self.tokenizer) - 2) for _ in range(pos - 1)]
                row = [think[-1] if think else 7] + body
                if pos < chain:
                    row += list(self.think_end_ids) + ids[: chain - pos - 1]
                kind = f"thinking(end@{pos if pos < chain else '-'})"
                grammar = obj
            else:
                for t in ids[:k]:
                    g.accept_token(t)
                grammar = self.reasoner(g, reasoning=False) if rng.random() < 0.3 else g
                if grammar is not g:
                    # generation phase of a reasoning request: accepted tokens went through the wrapper
                    kind = "generation"
                if g.is_terminated():
                    kind += "+terminated"
                row = [ids[k - 1] if k else 7] + ids[k : k + chain - 1]
            while len(row) < chain:
                row.append(rng.randrange(V))
            row = row[:chain]
            if rng.random() < corrupt and chain > 1:
                p = rng.randrange(1, chain)
                choice = rng.random()
                if choice < 0.15:
                    row[p] = V + rng.randrange(64)  # beyond the model vocab: stock rejects it outright
                elif choice < 0.3:
                    row[p] = self.eos_id
                else:
                    row[p] = rng.randrange(V)
                kind += f"+corrupt@{p}"
            if self.eos_id in row[1:]:
                kind += "+eos"
            reqs.append(Req(f"req-{r}", grammar))
            rows.append(row)
            kinds.append(kind)
        draft = torch.tensor(rows, dtype=torch.int64)
        return Workload(reqs, draft, V, self.think_end_ids, self.eos_id, kinds)


def matcher_state(grammar: Any) -> Optional[tuple]:
    """Observable state of a request's grammar object (matcher internals, wrapper phase)."""
    if grammar is None:
        return None
    inner = getattr(grammar, "grammar", None) if hasattr(grammar, "think_end_ids") else grammar
    wrapper = None
    if inner is not grammar:
        wrapper = (
            grammar.tokens_in_think,
            grammar.tokens_after_end,
            grammar._matched_think_end_tokens,
            tuple(grammar._thinking_match_history),
        )
    if inner is None:
        return (wrapper,)
    m = inner.matcher
    return (wrapper, m._debug_print_internal_state(), m.is_terminated(), tuple(inner.accepted_tokens))


class NativeFactory:
    """The same grammar mix compiled with xgrammar directly (no SGLang: the GPU machine has none).

    ``batch(bs, chain, seed)`` returns per-row matchers (``None`` = no grammar), per-row roots (a
    root > 0 stands for a reasoning request whose think-end token sits at that chain position) and
    the (bs, chain) draft, with valid continuations, invalid and out-of-vocab tokens and stop tokens
    at random depths, and matchers already terminated.
    """

    def __init__(self, vocab: int = 32000, pad: int = 64) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        from ..devtools.tiny_models import ensure_tokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(ensure_tokenizer(vocab))
        self.vocab_size = len(self.tokenizer) + pad
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.eos_id]
        )
        compiler = xgr.GrammarCompiler(info)
        self.compiled = []
        for kind, spec, instance in SCHEMAS:
            if kind == "json":
                cg = compiler.compile_json_schema(spec)
            elif kind == "regex":
                cg = compiler.compile_regex(spec)
            else:
                cg = compiler.compile_grammar(spec)
            ids = self.tokenizer.encode(instance, add_special_tokens=False) + [self.eos_id]
            self.compiled.append((cg, ids))
        self._xgr = xgr

    def batch(self, bs: int, chain: int, seed: int = 0):
        rng = random.Random(seed)
        V = self.vocab_size
        matchers, roots, rows = [], [], []
        for _ in range(bs):
            cg, ids = self.compiled[rng.randrange(len(self.compiled))]
            if rng.random() < 0.1:
                matchers.append(None)
                roots.append(0)
                rows.append([rng.randrange(V) for _ in range(chain)])
                continue
            m = self._xgr.GrammarMatcher(cg)  # rollback history is unlimited in xgrammar 0.2
            k = rng.randint(0, len(ids))
            for t in ids[:k]:
                if not m.accept_token(t):
                    raise RuntimeError("instance token refused by its own grammar")
            root = rng.randrange(chain) if rng.random() < 0.2 else 0
            row = [rng.randrange(V) for _ in range(root)] + [ids[k - 1] if k else 7] + ids[k : k + chain - root - 1]
            while len(row) < chain:
                row.append(rng.randrange(V))
            if rng.random() < 0.3 and chain > 1:
                p = rng.randrange(1, chain)
                c = rng.random()
                row[p] = V + rng.randrange(64) if c < 0.15 else (self.eos_id if c < 0.3 else rng.randrange(V))
            matchers.append(m)
            roots.append(root)
            rows.append(row[:chain])
        return matchers, roots, torch.tensor(rows, dtype=torch.int64)


def native_jobs(matchers, roots, draft: torch.Tensor, vocab_size: int) -> list:
    """Traversal jobs for :class:`NativeFactory` batches, read from ``draft`` (e.g. a pipeline's
    pinned host copy)."""
    from .traversal import Job, chain_end

    toks = draft.tolist()
    jobs = []
    for row, (m, root) in enumerate(zip(matchers, roots)):
        if m is None:
            continue
        end = chain_end(toks[row], root + 1, vocab_size, f"row{row}")
        # stock rejects a chain at the first out-of-vocab token before the root too
        if any(t >= vocab_size for t in toks[row][1 : root + 1]):
            continue
        jobs.append(Job(row=row, matcher=m, root=root, end=end, rid=f"row{row}"))
    return jobs


def reference_masks(matchers, roots, draft: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The stock bitmask of a :class:`NativeFactory` batch, built one node at a time with plain
    xgrammar calls in stock's order (``fill_next_token_bitmask``, a bit test of the next draft
    token, ``accept_token``, ``rollback`` at the end) -- no ``traverse_draft_tree``, no engine of
    :mod:`.traversal`: the independent reference every engine is compared with on the GPU host.

    Rows stock never fills stay all-ones: rows without a matcher, rows before the root, a matcher
    terminated at its root, the row of a rejected node (outside its parent's mask or ``>= vocab``)
    or of a node whose token terminated the grammar, and every row after it."""
    bs, chain = draft.shape
    words = (vocab_size + 31) // 32
    out = torch.full((bs * chain, words), -1, dtype=torch.int32)
    toks = draft.tolist()
    for j in native_jobs(matchers, roots, draft, vocab_size):
        m = j.matcher
        if m.is_terminated():
            continue
        accepted = 0
        for i in range(j.root, j.end):
            m.fill_next_token_bitmask(out, j.row * chain + i)
            if i + 1 >= j.end:
                break
            t = toks[j.row][i + 1]
            word = int(out[j.row * chain + i, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1 or not m.accept_token(t):
                break
            accepted += 1
            if m.is_terminated():
                break
        if accepted:
            m.rollback(accepted)
    return out
