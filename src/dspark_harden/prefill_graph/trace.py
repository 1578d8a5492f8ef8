"""DP2 prefill traces: the JSONL format (docs/prefill_graph.md#trace-format) and a seeded
production-shaped generator (:mod:`.world` turns a step into real ScheduleBatches).

One JSON object per line, one line per scheduler step::

    {"ranks": [
       {"mode": "extend", "reqs": [{"extend": 900, "prefix": 4096, "logprob": true},
                                   {"extend": 12, "hidden": true}]},
       {"mode": "idle"}
    ]}

``mode``: ``extend`` | ``mixed`` | ``decode`` | ``idle``. ``extend`` / ``mixed`` need ``reqs``
(each ``extend`` >= 1 new tokens, optional ``prefix`` cached tokens, flags ``logprob``,
``hidden`` (return_hidden_states), ``pool`` (multi-position pooling readout, e.g. scoring: a batch
whose requests all carry it is a prefill-only readout batch),
``embeds`` (input embeddings instead of ids), ``mm`` (multimodal inputs), ``replace``
(positional embedding overrides; never a prefix hit)). ``decode`` needs ``seq``: the sequence
length of each running request; ``mixed`` may give ``seq`` for the running requests it mixes in
(default: one of 512 tokens). Exactly two ranks per step (DP2).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Iterable

MODES = ("extend", "mixed", "decode", "idle")
REQ_FLAGS = ("logprob", "hidden", "pool", "embeds", "mm", "replace")


class TraceError(ValueError):
    """A trace line does not follow the format; the message names the line and field."""


@dataclass(frozen=True)
class TraceReq:
    extend: int
    prefix: int = 0
    logprob: bool = False
    hidden: bool = False
    pool: bool = False
    embeds: bool = False
    mm: bool = False
    replace: bool = False


@dataclass(frozen=True)
class RankStep:
    mode: str
    reqs: tuple = ()
    seq: tuple = ()  # decode: running sequence lengths

    @property
    def extend_tokens(self) -> int:
        return sum(r.extend for r in self.reqs) if self.mode in ("extend", "mixed") else 0


@dataclass(frozen=True)
class Step:
    ranks: tuple  # two RankStep


def _int(value: Any, where: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise TraceError(f"{where} must be an integer >= {lo}, got {value!r}")
    return value


def _seq(value: Any, w: str, mode: str) -> tuple:
    if not isinstance(value, list) or not value:
        raise TraceError(f"{w}.seq must be a non-empty list of sequence lengths for mode {mode}")
    return tuple(_int(v, f"{w}.seq[]", 1) for v in value)


def parse_step(obj: Any, where: str = "step") -> Step:
    if not isinstance(obj, dict) or not isinstance(obj.get("ranks"), list):
        raise TraceError(f"{where}: expected an object with a 'ranks' list")
    ranks = obj["ranks"]
    if len(ranks) != 2:
        raise TraceError(f"{where}: 'ranks' must have exactly 2 entries (DP2), got {len(ranks)}")
    out = []
    for i, r in enumerate(ranks):
        w = f"{where}.ranks[{i}]"
        if not isinstance(r, dict):
            raise TraceError(f"{w}: expected an object")
        mode = r.get("mode")
        if mode not in MODES:
            raise TraceError(f"{w}.mode must be one of {', '.join(MODES)}, got {mode!r}")
        unknown = set(r) - {"mode", "reqs", "seq"}
        if "seq" in r and mode not in ("decode", "mixed"):
            raise TraceError(f"{w}.seq is only valid for modes decode and mixed, not {mode}")
        if unknown:
            raise TraceError(f"{w}: unknown field(s) {sorted(unknown)}")
        reqs: list = []
        seq: tuple = ()
        if mode in ("extend", "mixed"):
            if not isinstance(r.get("reqs"), list) or not r["reqs"]:
                raise TraceError(f"{w}.reqs must be a non-empty list for mode {mode}")
            for j, q in enumerate(r["reqs"]):
                wq = f"{w}.reqs[{j}]"
                if not isinstance(q, dict):
                    raise TraceError(f"{wq}: expected an object")
                bad = set(q) - {"extend", "prefix", *REQ_FLAGS}
                if bad:
                    raise TraceError(f"{wq}: unknown field(s) {sorted(bad)}")
                flags = {}
                for f in REQ_FLAGS:
                    v = q.get(f, False)
                    if not isinstance(v, bool):
                        raise TraceError(f"{wq}.{f} must be true or false, got {v!r}")
                    flags[f] = v
                req = TraceReq(
                    extend=_int(q.get("extend"), f"{wq}.extend", 1),
                    prefix=_int(q.get("prefix", 0), f"{wq}.prefix", 0),
                    **flags,
                )
                if req.replace and req.prefix:
                    raise TraceError(
                        f"{wq}: a 'replace' request (positional embedding override) never hits the "
                        f"prefix cache (stock disables matching): prefix must be 0, got {req.prefix}"
                    )
                reqs.append(req)
            if mode == "mixed" and "seq" in r:
                seq = _seq(r["seq"], w, mode)
        elif mode == "decode":
            seq = _seq(r.get("seq"), w, mode)
        out.append(RankStep(mode=mode, reqs=tuple(reqs), seq=seq))
    return Step(ranks=tuple(out))


def read_jsonl(path: str) -> list:
    steps = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{n}: not JSON: {exc}") from None
            steps.append(parse_step(obj, f"{path}:{n}"))
    if not steps:
        raise TraceError(f"{path}: no steps")
    return steps


def step_to_json(step: Step) -> dict:
    ranks = []
    for r in step.ranks:
        d: dict = {"mode": r.mode}
        if r.reqs:
            d["reqs"] = [
                {
                    "extend": q.extend,
                    **({"prefix": q.prefix} if q.prefix else {}),
                    **{f: True for f in REQ_FLAGS if getattr(q, f)},
                }
                for q in r.reqs
            ]
        if r.seq:
            d["seq"] = list(r.seq)
        ranks.append(d)
    return {"ranks": ranks}


def write_jsonl(steps: Iterable[Step], path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for s in steps:
            fh.write(json.dumps(step_to_json(s)) + "\n")


# -- the built-in generator ---------------------------------------------------------------------


@dataclass(frozen=True)
class TraceShape:
    """Parameters of :func:`generate` (reported by the bench, documented in docs/prefill_graph.md)."""

    steps: int = 4000
    seed: int = 13
    chunk: int = 16384  # --chunked-prefill-size: most new tokens one rank prefills per step
    max_len: int = 16384  # request prompt lengths are log-uniform in [1, max_len]
    p_cached: float = 0.5  # a request hits the prefix cache ...
    max_prefix: int = 12288  # ... for a log-uniform prefix of up to this many tokens
    # what the peer of a prefilling rank does (asymmetric arrival: rank 0 gets more traffic)
    p_peer_prefill: float = 0.42
    p_peer_idle: float = 0.50
    p_peer_decode: float = 0.08
    p_small_batch_burst: float = 0.02  # many tiny requests at once (beyond the request slots)
    p_logprob: float = 0.08
    p_hidden: float = 0.002  # return_hidden_states (the graph captures none)
    p_pool: float = 0.002  # multi-position pooling readout (scoring)
    p_embeds: float = 0.001  # input embeddings
    p_mm: float = 0.0  # multimodal inputs (not in the built-in text trace)
    p_replace: float = 0.0  # positional embedding overrides (not in the built-in trace)


def _loguniform(rng: random.Random, hi: int) -> int:
    import math

    return max(1, min(hi, int(round(math.exp(rng.uniform(0.0, math.log(hi)))))))


def _prefill_rank(rng: random.Random, shape: TraceShape) -> RankStep:
    if rng.random() < shape.p_small_batch_burst:
        n = rng.randint(33, 64)
        reqs = tuple(TraceReq(extend=rng.randint(1, 24)) for _ in range(n))
        return RankStep("extend", reqs)
    reqs = []
    mode = rng.choice(("extend",) * 9 + ("mixed",))
    # a mixed step carries running requests' decode rows inside the same token budget
    seq = tuple(_loguniform(rng, 16384) + 1 for _ in range(rng.randint(1, 4))) if mode == "mixed" else ()
    budget = shape.chunk - len(seq)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 6, 8))):
        if budget <= 0:
            break
        length = _loguniform(rng, shape.max_len)  # prompt tokens
        prefix = 0
        if length > 1 and rng.random() < shape.p_cached:
            prefix = min(_loguniform(rng, shape.max_prefix), length - 1)  # served from the prefix cache
        extend = min(length - prefix, budget)  # chunked prefill: the rest comes in later steps
        budget -= extend
        replace = shape.p_replace > 0 and rng.random() < shape.p_replace
        reqs.append(
            TraceReq(
                extend=extend,
                prefix=0 if replace else prefix,
                logprob=rng.random() < shape.p_logprob,
                hidden=rng.random() < shape.p_hidden,
                pool=rng.random() < shape.p_pool,
                embeds=rng.random() < shape.p_embeds,
                mm=shape.p_mm > 0 and rng.random() < shape.p_mm,
                replace=replace,
            )
        )
    return RankStep(mode, tuple(reqs), seq)


def _decode_rank(rng: random.Random) -> RankStep:
    return RankStep("decode", seq=tuple(_loguniform(rng, 16384) + 1 for _ in range(rng.randint(1, 48))))


def generate(shape: TraceShape = TraceShape()) -> list:
    """Seeded DP2 steps in which at least one rank prefills (steps without any prefill do not
    reach the prefill-graph decision)."""
    rng = random.Random(shape.seed)
    steps = []
    for _ in range(shape.steps):
        busy = 0 if rng.random() < 0.65 else 1  # asymmetric arrival
        main = _prefill_rank(rng, shape)
        u = rng.random()
        if u < shape.p_peer_prefill:
            peer = _prefill_rank(rng, shape)
        elif u < shape.p_peer_prefill + shape.p_peer_idle:
            peer = RankStep("idle")
        else:
            peer = _decode_rank(rng)
        ranks = (main, peer) if busy == 0 else (peer, main)
        steps.append(Step(ranks=ranks))
    return steps


def num_tokens(rank: RankStep) -> int:
    """The trace's local token count: 0 idle, one per row decode, new tokens (plus mixed decode rows)."""
    if rank.mode == "idle":
        return 0
    if rank.mode == "decode":
        return len(rank.seq)
    return rank.extend_tokens + (len(rank.seq or (1,)) if rank.mode == "mixed" else 0)
