"""The replay client: sends trace entries to ``POST /generate`` at their arrival times (asyncio +
aiohttp, no concurrency limit: an open-loop replay), or one at a time; records per request the
HTTP status, time to first token (streaming), end-to-end latency, output token ids and text, and
whether a constrained output satisfies its check."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from . import trace as _trace

REQUEST_TIMEOUT_S = 600.0


@dataclass
class Result:
    id: str
    kind: str
    status: int = 0  # HTTP status; 0: no answer (connection error / timeout)
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    e2e_s: float = 0.0
    #: one item per request (a batch has several)
    outputs: list = field(default_factory=list)  # [(output_ids tuple, text, finish_reason type)]
    completion_tokens: int = 0
    #: speculative verify steps (``meta_info.spec_verify_ct``; 0 without speculative decoding)
    spec_verify_ct: int = 0
    invalid: list = field(default_factory=list)  # reasons, one per failed constrained output
    truncated: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def _finish(meta: dict) -> str:
    fr = meta.get("finish_reason")
    return fr.get("type", "") if isinstance(fr, dict) else str(fr or "")


def _absorb(res: Result, entry: dict, answers: list, tokenizer_dir: Optional[str] = None) -> None:
    for a in answers:
        meta = a.get("meta_info", {})
        res.completion_tokens += int(meta.get("completion_tokens", 0))
        res.spec_verify_ct += int(meta.get("spec_verify_ct", 0) or 0)
        finish = _finish(meta)
        res.outputs.append((tuple(a.get("output_ids") or ()), a.get("text", ""), finish))
        if entry.get("check"):
            if finish == "length":
                res.truncated += 1
            if finish == "length" and tokenizer_dir:
                # cut by max_new_tokens: the constraint held if a real matcher accepts every token
                why = _trace.check_prefix(entry["check"], a.get("output_ids") or (), tokenizer_dir)
            else:
                why = _trace.check_output(entry["check"], a.get("text", ""))
            if why:
                res.invalid.append(f"{finish}: {why}")


async def send(
    session,
    url: str,
    entry: dict,
    *,
    stream: Optional[bool] = None,
    extra: Optional[dict] = None,
    timeout: float = REQUEST_TIMEOUT_S,
    tokenizer_dir: Optional[str] = None,
) -> Result:
    """One request; constrained outputs are checked (truncated ones as token prefixes when
    ``tokenizer_dir``, the server's tokenizer, is given; else as complete documents)."""
    import aiohttp

    stream = entry.get("stream", False) if stream is None else stream
    body = dict(entry["body"])
    body.update(extra or {})
    if stream:
        body["stream"] = True
    res = Result(entry.get("id", "?"), entry.get("kind", "?"))
    t0 = time.monotonic()
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.text())[:500]
            elif not stream:
                a = await r.json(content_type=None)
                _absorb(res, entry, a if isinstance(a, list) else [a], tokenizer_dir)
            else:
                ids: list = []
                last: dict = {}
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = json.dumps(chunk["error"])[:500]
                        break
                    if res.ttft_s is None:
                        res.ttft_s = time.monotonic() - t0
                    new = list(chunk.get("output_ids") or [])
                    # cumulative (stock default) or incremental (--incremental-streaming-output)
                    ids = new if new[: len(ids)] == ids and len(new) >= len(ids) else ids + new
                    last = chunk
                if res.error is None:
                    if last:
                        last = dict(last)
                        last["output_ids"] = ids
                    _absorb(res, entry, [last] if last else [], tokenizer_dir)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout:.0f}s"
    except Exception as exc:  # noqa: BLE001 - a client-side failure is a recorded error, not a crash
        res.error = f"{type(exc).__name__}: {exc}"[:500]
    res.e2e_s = time.monotonic() - t0
    if not stream and res.ok:
        res.ttft_s = None
    return res


async def _replay(
    url: str,
    entries: list[dict],
    *,
    sequential: bool,
    stream_override: Optional[bool],
    tokenizer_dir: Optional[str] = None,
) -> tuple[list, float]:
    import aiohttp

    # force_close: a fresh connection per request (a reused keep-alive connection that uvicorn closes
    # at its 5 s idle timeout just as the client sends shows up as "Server disconnected")
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.monotonic()
        if sequential:
            results = [
                await send(session, url, e, stream=stream_override, tokenizer_dir=tokenizer_dir) for e in entries
            ]
        else:

            async def at(e):
                delay = start + e["t"] - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                return await send(session, url, e, stream=stream_override, tokenizer_dir=tokenizer_dir)

            results = await asyncio.gather(*(at(e) for e in entries))
        return list(results), time.monotonic() - start


def replay(
    url: str,
    entries: list[dict],
    *,
    sequential: bool = False,
    stream_override: Optional[bool] = None,
    tokenizer_dir: Optional[str] = None,
) -> tuple[list, float]:
    """Replay ``entries`` (open loop at their ``t``, or one at a time); (results, wall seconds)."""
    return asyncio.run(
        _replay(url, entries, sequential=sequential, stream_override=stream_override, tokenizer_dir=tokenizer_dir)
    )


def pct(values: list, q: float) -> Optional[float]:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(results: list, wall_s: float, entries: list[dict]) -> dict:
    """One round's figures (seconds, tokens/s, requests/s) from its results."""
    reqs = sum(_trace.items(e) for e in entries)
    tokens = sum(r.completion_tokens for r in results)
    e2e = [r.e2e_s for r in results if r.ok]
    ttft = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    errors = [r for r in results if not r.ok]
    status: dict[str, int] = {}
    for r in errors:
        status[str(r.status)] = status.get(str(r.status), 0) + 1
    invalid = [(r.id, why) for r in results for why in r.invalid]
    out = {
        "wall_s": round(wall_s, 3),
        "requests": reqs,
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "req_s": round(reqs / wall_s, 3) if wall_s > 0 else None,
        "errors": len(errors),
        "errors_by_status": status,
        "constrained_outputs": sum(len(r.outputs) for r in results if r.ok and _has_check(entries, r.id)),
        "constrained_invalid": len(invalid),
        "constrained_truncated": sum(r.truncated for r in results),
    }
    verify = sum(r.spec_verify_ct for r in results if r.ok)
    if verify:
        # tokens per verify step over every answered request (includes the bonus token): as stock's
        # meta_info.spec_accept_length, pooled
        out["spec_verify_ct"] = verify
        out["accept_length_mean"] = round(sum(r.completion_tokens for r in results if r.ok) / verify, 4)
        out["accept_length_by_kind"] = _pooled_accept(results, lambda r: r.kind)
        shapes = {e["id"]: schema_shape(e["check"]["schema"]) for e in entries if _json_check(e)}
        out["accept_length_by_schema_shape"] = _pooled_accept(results, lambda r: shapes.get(r.id))
    for name, series in (("e2e", e2e), ("ttft", ttft)):
        for q, label in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            v = pct(series, q)
            out[f"{name}_{label}_s"] = round(v, 4) if v is not None else None
    out["e2e_mean_s"] = round(statistics.fmean(e2e), 4) if e2e else None
    if errors:
        out["error_examples"] = [f"{r.id} ({r.kind}) HTTP {r.status}: {r.error}" for r in errors[:5]]
    if invalid:
        out["invalid_examples"] = [f"{i}: {why}" for i, why in invalid[:5]]
    return out


_CHECKED: dict = {}


def _pooled_accept(results: list, group) -> dict:
    """Output tokens per verify step, pooled over the answered speculative requests of each
    ``group(result)`` (None: the request is left out)."""
    sums: dict = {}
    for r in results:
        key = group(r) if r.ok and r.spec_verify_ct else None
        if key is not None:
            t, v = sums.get(key, (0, 0))
            sums[key] = (t + r.completion_tokens, v + r.spec_verify_ct)
    return {k: round(t / v, 4) for k, (t, v) in sorted(sums.items())}


def _json_check(entry: dict) -> bool:
    check = entry.get("check") or {}
    return check.get("type") == "json_schema" and isinstance(check.get("schema"), (dict, bool))


def schema_shape(schema) -> str:
    """What a JSON schema leaves a draft to guess, coarsely: ``enum_const`` (an enum or const anywhere: values
    the grammar spells out once begun), ``fixed_keys`` (an object with required properties: keys, quotes and
    braces forced), ``free`` (the rest: free strings, numbers, permissive schemas)."""
    stack, required = [schema], False
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if "enum" in node or "const" in node:
                return "enum_const"
            required |= bool(node.get("required")) and isinstance(node.get("properties"), dict)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return "fixed_keys" if required else "free"


def _has_check(entries: list[dict], rid: str) -> bool:
    key = id(entries)
    if key not in _CHECKED:
        _CHECKED.clear()
        _CHECKED[key] = {e["id"] for e in entries if e.get("check")}
    return rid in _CHECKED[key]


def outputs_by_id(results: list) -> dict:
    """{entry id: tuple of per-item output id tuples} for successful results."""
    return {r.id: tuple(o[0] for o in r.outputs) for r in results if r.ok}


def identical_fraction(a: dict, b: dict) -> Optional[float]:
    """Fraction of requests (batch items counted singly) whose output ids are equal in both runs."""
    same = total = 0
    for rid in set(a) & set(b):
        for x, y in zip(a[rid], b[rid]):
            total += 1
            same += x == y
    return round(same / total, 4) if total else None


def as_dict(r: Result) -> dict[str, Any]:
    return {
        "id": r.id,
        "kind": r.kind,
        "status": r.status,
        "error": r.error,
        "e2e_s": round(r.e2e_s, 4),
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
        "completion_tokens": r.completion_tokens,
        "invalid": r.invalid,
        "outputs": [[list(ids), text, fin] for ids, text, fin in r.outputs],
    }
