"""``dspark-harden bench soak --minutes M [--adversarial]``: constant mixed load from the trace
generator on one real plugin DP2 server, with the checks of docs/e2e.md: zero 5xx, ``/health_scheduler``
200 at every poll, RSS of each process role sampled (slope reported), grammar memory and disk
bytes within their limits, open fds and /dev/shm entries flat, ``/metrics`` scraped throughout.

``--adversarial``: the first third of the run is clean (the reference latency), then abusive
requests (see :data:`ABUSE`) are mixed into the same well-formed load; each must be answered with
a 4xx (or the documented outcome) whose text names the problem, the server must not crash, and
no well-formed request may fail. The well-formed latency p99 is reported per phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from .. import server as _server
from . import client as _client
from . import procs as _procs
from . import serve as _serve
from . import trace as _trace

#: explicit grammar cache limits for the soak (so "within the limit" means something)
GRAMMAR_LIMITS = {
    "DSPARK_HARDEN_GRAMMAR_CACHE_BYTES": str(256 << 20),
    "DSPARK_HARDEN_GRAMMAR_CACHE_ENTRIES": "500",
    "DSPARK_HARDEN_GRAMMAR_DISK_BYTES": str(1 << 30),
    "DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT": "20",
}


def log(msg: str) -> None:
    sys.stderr.write(f"[bench soak {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def _deep(n: int) -> str:
    return '{"type":"object","properties":{"a":' * n + '{"type":"integer"}' + "}}" * n


def _big_schema() -> str:
    props = {f"field_{i:06d}": {"type": "string", "enum": [f"v{i}a", f"v{i}b"]} for i in range(165_000)}
    return json.dumps({"type": "object", "properties": props})


def _gen(text: str = "abuse", **sp: Any) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, **sp}}


#: name -> (request body, expected: "4xx" or "200" (documented as served), substring the answer must contain)
ABUSE: dict[str, tuple] = {
    "routed_rank_-1": ({**_gen(), "routed_dp_rank": -1}, "4xx", "routed_dp_rank"),
    "routed_rank_2": ({**_gen(), "routed_dp_rank": 2}, "4xx", "routed_dp_rank"),
    "routed_rank_2**63": ({**_gen(), "routed_dp_rank": 2**63}, "4xx", "routed_dp_rank"),
    # answered by the request parser before SGLang sees it: 400 "invalid type: string \"1\", expected i64"
    "routed_rank_'1'": ({**_gen(), "routed_dp_rank": "1"}, "4xx", "expected i64"),
    "routed_rank_null": ({**_gen(), "routed_dp_rank": None}, "200", ""),  # null = not routed (documented)
    "batch_routed_rank_2": ({**_gen(), "text": ["a", "b"], "routed_dp_rank": 2}, "4xx", "routed_dp_rank"),
    "schema_invalid_json": (_gen(json_schema='{"type": "object", "properties": {'), "4xx", ""),
    "schema_10MB": (None, "4xx", ""),  # built lazily (10 MB)
    "schema_10000_deep": (_gen(json_schema=_deep(10_000)), "4xx", ""),
    "schema_recursive_ref": (
        _gen(
            json_schema=json.dumps(
                {
                    "$ref": "#/definitions/a",
                    "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"$ref": "#/definitions/a"}},
                }
            )
        ),
        "4xx",
        "",
    ),
    "schema_unsupported_keyword": (
        _gen(
            json_schema=json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "x": {
                            "type": "string",
                            "contentEncoding": "base64",
                            "if": {"minLength": 1},
                            "then": {"maxLength": 3},
                        }
                    },
                    "dependentSchemas": {"x": {"required": ["y"]}},
                }
            )
        ),
        "200|4xx",
        "",
    ),
    "regex_catastrophic": (_gen(regex="(a+)+$"), "200|4xx", ""),
    "regex_malformed": (_gen(regex="([a-z"), "4xx", ""),
    "ebnf_malformed": (_gen(ebnf='root ::= "a" | '), "4xx", ""),
    "ebnf_undefined_rule": (_gen(ebnf="root ::= missing_rule"), "4xx", ""),
    "schema_pathological_slow": (
        _gen(
            json_schema=json.dumps(
                {
                    "type": "object",
                    "properties": {
                        f"p{i}": {
                            "type": "string",
                            "minLength": 400,
                            "maxLength": 2000,
                            "pattern": "^[a-z0-9]{400,2000}$",
                        }
                        for i in range(40)
                    },
                }
            )
        ),
        "200|4xx",
        "",
    ),
}


#: sent once per soak, after the cheap ones
HEAVY = ("schema_pathological_slow", "burst_500_new_schema", "schema_10MB")


def _abuse_body(name: str) -> dict:
    body = ABUSE[name][0]
    if body is None:
        body = _gen(json_schema=_big_schema())
        ABUSE[name] = (body, *ABUSE[name][1:])
    return body


def _expected(expect: str, status: int) -> bool:
    return any((e == "4xx" and 400 <= status < 500) or (e == "200" and status == 200) for e in expect.split("|"))


async def _post(session, url: str, body: dict, timeout: float = 300.0) -> tuple[int, str, float]:
    import aiohttp

    t0 = time.monotonic()
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, (await r.text())[:400], time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001
        return 0, f"{type(exc).__name__}: {exc}"[:400], time.monotonic() - t0


async def _disconnect_mid_stream(session, url: str) -> tuple[int, str, float]:
    import aiohttp

    t0 = time.monotonic()
    body = {**_gen(max_new_tokens=256), "stream": True}
    body["sampling_params"]["ignore_eos"] = True
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            async for raw in r.content:
                if raw.startswith(b"data:"):
                    break  # first token arrived: drop the connection
            status = r.status
            r.close()
        return status, "disconnected after the first chunk", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001
        return 0, f"{type(exc).__name__}: {exc}"[:400], time.monotonic() - t0


async def _burst_500(session, url: str, seed: int) -> tuple[int, str, float]:
    """500 concurrent requests of one brand-new (valid) schema: all must be served."""
    schema = json.dumps(
        {
            "title": f"burst_{seed}",
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["ok", "n"],
        }
    )
    t0 = time.monotonic()
    res = await asyncio.gather(
        *(_post(session, url, _gen(f"item {i}", json_schema=schema, max_new_tokens=24)) for i in range(500))
    )
    bad = [r for r in res if r[0] != 200]
    statuses = sorted({r[0] for r in res})
    return (200 if not bad else bad[0][0]), f"{500 - len(bad)}/500 served, statuses {statuses}", time.monotonic() - t0


class Soak:
    def __init__(
        self,
        minutes: float,
        rate: float,
        seed: int,
        adversarial: bool,
        poll_s: float,
        skip: tuple = (),
        health_path: str = "/health_scheduler",
    ):
        self.minutes, self.rate, self.seed, self.adversarial, self.poll_s = minutes, rate, seed, adversarial, poll_s
        self.skip = tuple(skip)
        self.health_path = health_path
        self.results: list = []  # (phase, Result)
        self.health: list = []
        self.samples: list = []
        self.scrapes: list = []
        self.abuse: list = []
        self.loads: list = []  # (t, {dp_rank: (running, waiting, timestamp)}) from /v1/loads
        self.drain: Optional[dict] = None  # check_drained() after the last answer
        self.phase = "clean"

    async def load(self, session, url: str, deadline: float) -> None:
        chunk = 0
        tasks = []
        while time.monotonic() < deadline:
            entries = _trace.generate(
                seed=self.seed * 1000 + chunk,
                requests=max(int(self.rate * 30), 4),
                rate=self.rate,
                batches=1,
                burst=8,
                stream_fraction=0.3,
            )
            for e in entries:
                e["id"] = f"c{chunk}-{e['id']}"
            start = time.monotonic()
            for e in entries:
                delay = start + e["t"] - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.monotonic() >= deadline:
                    break
                tasks.append(asyncio.ensure_future(self._one(session, url, e)))
            chunk += 1
        await asyncio.gather(*tasks)

    async def _one(self, session, url: str, e: dict) -> None:
        phase = self.phase
        r = await _client.send(session, url, e)
        self.results.append((phase, r))

    async def monitor(self, session, url: str, pid: int, deadline: float) -> None:
        import aiohttp

        i = 0
        while time.monotonic() < deadline:
            t = time.monotonic()
            try:
                async with session.get(url + self.health_path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    self.health.append((t, r.status, "" if r.status == 200 else (await r.text())[:200]))
            except Exception as exc:  # noqa: BLE001
                self.health.append((t, 0, f"{type(exc).__name__}: {exc}"[:200]))
            self.samples.append((t, _procs.sample(pid), len(_procs.shm_entries())))
            try:
                async with session.get(url + "/v1/loads?include=core", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status == 200:
                        self.loads.append((t, rank_loads(await r.json())))
            except Exception:  # noqa: BLE001 - a missed sample; the health poll reports a dead server
                pass
            if i % 3 == 0:
                try:
                    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=20)) as r:
                        self.scrapes.append((t, r.status, _gauges(await r.text()) if r.status == 200 else {}))
                except Exception as exc:  # noqa: BLE001
                    self.scrapes.append((t, 0, {"error": str(exc)[:200]}))
            i += 1
            await asyncio.sleep(max(0.0, self.poll_s - (time.monotonic() - t)))

    async def abuse_loop(self, session, url: str, start_at: float, deadline: float, corrupt: Optional[dict]) -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        self.phase = "abuse"
        log("abuse phase begins")
        # cheap ones every round; the heavy ones once, last the 10 MB schema (it can take the
        # scheduler's memory past what a small machine has: see docs/e2e.md)
        names = (
            [n for n in ABUSE if n not in HEAVY]
            + ["disconnect_mid_stream"]
            + (["corrupt_disk_entry"] if corrupt else [])
            + list(HEAVY)
        )
        names = [n for n in names if n not in self.skip]
        rnd = 0
        while time.monotonic() < deadline - 10:
            for name in names:
                if time.monotonic() >= deadline - 10:
                    break
                if name == "disconnect_mid_stream":
                    status, text, dt = await _disconnect_mid_stream(session, url)
                    good = status == 200
                elif name in HEAVY and rnd > 0:
                    continue  # once per soak
                elif name == "burst_500_new_schema":
                    status, text, dt = await _burst_500(session, url, self.seed)
                    good = status == 200
                elif name == "corrupt_disk_entry":
                    status, text, dt = await _post(session, url, corrupt["body"])
                    # the plugin's answer: 400 "persistent grammar cache entry is invalid: <path> ..."
                    good = 400 <= status < 500 and ("corrupt" in text.lower() or "entry is invalid" in text.lower())
                else:
                    body, expect, needle = _abuse_body(name), ABUSE[name][1], ABUSE[name][2]
                    status, text, dt = await _post(session, url, body)
                    good = _expected(expect, status) and (needle.lower() in text.lower())
                self.abuse.append(
                    {
                        "name": name,
                        "round": rnd,
                        "status": status,
                        "seconds": round(dt, 2),
                        "as_expected": bool(good),
                        "answer": text[:240],
                    }
                )
                await asyncio.sleep(1.0)
            rnd += 1


def rank_loads(answer: dict) -> dict:
    """``{dp_rank: (running, waiting, snapshot timestamp)}`` of a stock ``/v1/loads`` answer."""
    out = {}
    for load in answer.get("loads", ()):
        out[str(load.get("dp_rank", 0))] = (
            int(load.get("num_running_reqs", 0)),
            int(load.get("num_waiting_reqs", 0)),
            float(load.get("timestamp", 0.0)),
        )
    return out


def max_active(loads: list) -> dict:
    """Per ``dp_rank``: the largest running + waiting request count any poll of ``loads`` saw."""
    out: dict = {}
    for _, ranks in loads:
        for rank, (running, waiting, _ts) in ranks.items():
            out[rank] = max(out.get(rank, 0), running + waiting)
    return dict(sorted(out.items()))


def drained(ranks: dict, since: float, expected: int) -> bool:
    """Every one of ``expected`` ranks published a snapshot after ``since`` (wall clock) with nothing
    running or waiting."""
    return len(ranks) == expected and all(r == 0 and w == 0 and ts > since for r, w, ts in ranks.values())


def check_drained(get, expected: int, timeout_s: float = 30.0, every_s: float = 0.5) -> dict:
    """After the last answer: poll ``/v1/loads`` (``get(path)`` -> response) until every rank's fresh
    snapshot shows empty queues, at most ``timeout_s``. A rank still holding requests once every client
    got its answer is a leak (an aborted or disconnected request the scheduler never released)."""
    since = time.time()
    t0 = time.monotonic()
    last: dict = {}
    while True:
        try:
            r = get("/v1/loads?include=core", timeout=10)
            if r.status_code == 200:
                last = rank_loads(r.json())
        except Exception:  # noqa: BLE001 - keep polling until the deadline
            pass
        ok = drained(last, since, expected)
        if ok or time.monotonic() - t0 >= timeout_s:
            return {
                "ok": ok,
                "waited_s": round(time.monotonic() - t0, 2),
                "ranks": {k: {"running": v[0], "waiting": v[1]} for k, v in sorted(last.items())},
            }
        time.sleep(every_s)


def _gauges(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        if line.startswith(
            (
                "dspark_harden_grammar_memory_cache_bytes",
                "dspark_harden_grammar_disk_cache_bytes",
                "dspark_harden_grammar_memory_cache_entries",
                "dspark_harden_grammar_corrupt_entries_total",
            )
        ):
            name, value = line.split("{", 1)[0] if "{" in line else line.split()[0], line.rsplit(" ", 1)[1]
            out[name] = max(out.get(name, 0.0), float(value))
    return out


def _slope(points: list) -> Optional[float]:
    """Least-squares slope (units per minute) of [(seconds, value)]."""
    if len(points) < 3:
        return None
    xs = [p[0] / 60 for p in points]
    ys = [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


async def _prepare_corrupt_entry(url: str, grammar_dir: str) -> Optional[dict]:
    """Compile one schema (published to the disk cache), corrupt its entry on disk, flush the
    memory cache: the next request for that schema must fail naming the corrupt entry."""
    import aiohttp

    schema = json.dumps(
        {"title": "corrupt_me", "type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"]}
    )
    body = _gen("corrupt", json_schema=schema)
    before = set(Path(grammar_dir).rglob("*.xgc"))
    async with aiohttp.ClientSession() as session:
        status, text, _ = await _post(session, url, body)
        if status != 200:
            log(f"corrupt-entry setup: first request HTTP {status}: {text}")
            return None
        deadline = time.monotonic() + 60
        new: set = set()
        while time.monotonic() < deadline and not new:
            await asyncio.sleep(1.0)
            new = set(Path(grammar_dir).rglob("*.xgc")) - before
        if not new:
            log("corrupt-entry setup: no disk entry appeared (kept as a compile-locally marker?); skipped")
            return None
        path = sorted(new)[0]
        raw = bytearray(path.read_bytes())
        mid = len(raw) // 2
        raw[mid : mid + 16] = b"\x00CORRUPTED-BYTES"[: len(raw[mid : mid + 16])]
        path.write_bytes(bytes(raw))
        async with session.post(url + "/flush_cache") as r:
            await r.read()
    return {"body": body, "path": str(path)}


STOCK_ADVERSARIAL = (
    "--stock cannot be combined with --adversarial: stock SGLang is taken down by some of the "
    "abuses (docs/e2e.md); soak stock with well-formed load only"
)

DEFAULT_LIMITS = {
    "DSPARK_HARDEN_GRAMMAR_CACHE_BYTES": str(4 << 30),
    "DSPARK_HARDEN_GRAMMAR_CACHE_ENTRIES": "10000",
    "DSPARK_HARDEN_GRAMMAR_DISK_BYTES": str(20 << 30),
}


def run(
    minutes: float, rate: float, seed: int, adversarial: bool, poll_s: float, skip: tuple = (), stock: bool = False
) -> dict:
    """Start a plugin DP2 server (native DP2 exchange on, explicit grammar limits, fresh disk cache),
    or with ``stock`` the same DP2 server without the plugin (the reference for RSS and fds; health
    polled on stock's ``/health``), soak it, stop it, check /dev/shm afterwards."""
    if stock and adversarial:
        raise ValueError(STOCK_ADVERSARIAL)
    grammar_dir = tempfile.mkdtemp(prefix="dsh-soak-grammar-", dir="/tmp")
    cfg = _serve.stock_config() if stock else _serve.plugin_config(grammar_dir, GRAMMAR_LIMITS, name="e2e-soak")
    shm0 = _procs.shm_entries()
    p = _serve.start(cfg)
    try:
        rep = run_on(
            p.server,
            Soak(
                minutes, rate, seed, adversarial, poll_s, skip, health_path="/health" if stock else "/health_scheduler"
            ),
        )
        rep["server"] = "stock" if stock else "plugin"
    finally:
        p.stop()
    shm1 = _procs.shm_entries()
    rep["dev_shm"]["before_start"] = len(shm0)
    rep["dev_shm"]["after_stop"] = len(shm1)
    rep["dev_shm"]["left_behind"] = sorted(set(shm1) - set(shm0))
    rep["ok"] = rep["ok"] and not rep["dev_shm"]["left_behind"]
    return rep


def run_on(s: "_server.SGLangServer", soak: Soak) -> dict:
    """Soak a started server (left running); the report of :func:`report`."""
    env = dict(s.config.env)
    limits = {k: env.get(k, v) for k, v in DEFAULT_LIMITS.items()}
    grammar_dir = env.get("DSPARK_HARDEN_GRAMMAR_DISK_DIR", os.path.expanduser("~/.cache/dspark-harden/grammar"))
    crashed = None
    t_start = time.monotonic()
    corrupt = asyncio.run(_prepare_corrupt_entry(s.url, grammar_dir)) if soak.adversarial else None
    fds0 = {pid: v["fds"] for pid, v in _procs.sample(s.pid).items()}
    shm_start = _procs.shm_entries()
    minutes = soak.minutes

    async def main() -> None:
        import aiohttp

        t0 = time.monotonic()
        deadline = t0 + minutes * 60
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
            jobs = [soak.load(session, s.url, deadline), soak.monitor(session, s.url, s.pid, deadline)]
            if soak.adversarial:
                jobs.append(soak.abuse_loop(session, s.url, t0 + minutes * 60 / 3, deadline, corrupt))
            await asyncio.gather(*jobs)

    log(
        f"soak: {minutes} min at {soak.rate} entries/s{' with abuse after the first third' if soak.adversarial else ''}"
    )
    asyncio.run(main())
    alive = s.proc.poll() is None and s._http_ok(soak.health_path, timeout=10)
    if not alive:
        crashed = f"server not healthy after the soak (exit code {s.proc.poll()})"
    soak.drain = check_drained(s.get, expected=max(1, len(max_active(soak.loads)))) if alive else None
    return report(soak, minutes, time.monotonic() - t_start, crashed, fds0, shm_start, _procs.shm_entries(), limits)


def report(
    soak: Soak, minutes: float, wall: float, crashed: Optional[str], fds0: dict, shm0: list, shm1: list, limits: dict
) -> dict:
    out: dict = {"minutes": minutes, "wall_s": round(wall, 1), "adversarial": soak.adversarial, "crashed": crashed}
    wf: dict = {}
    for phase in ("clean", "abuse", "all"):
        rs = [r for ph, r in soak.results if phase == "all" or ph == phase]
        if not rs:
            continue
        e2e = [r.e2e_s for r in rs if r.ok]
        wf[phase] = {
            "entries": len(rs),
            "errors": sum(1 for r in rs if not r.ok),
            "5xx": sum(1 for r in rs if r.status >= 500),
            "constrained_invalid": sum(len(r.invalid) for r in rs),
            "e2e_p50_s": _round(_client.pct(e2e, 0.5)),
            "e2e_p99_s": _round(_client.pct(e2e, 0.99)),
            "error_examples": [f"{r.id} HTTP {r.status}: {r.error}" for r in rs if not r.ok][:5],
        }
    out["well_formed"] = wf
    out["health_scheduler"] = {
        "path": soak.health_path,
        "polls": len(soak.health),
        "non_200": sum(1 for h in soak.health if h[1] != 200),
        "examples": [h[2] for h in soak.health if h[1] != 200][:5],
    }
    t0 = soak.samples[0][0] if soak.samples else 0.0
    rss: dict = {}
    for role in sorted({v["role"] for _, smp, _ in soak.samples for v in smp.values()}):
        pts = [(t - t0, sum(v["rss_bytes"] for v in smp.values() if v["role"] == role)) for t, smp, _ in soak.samples]
        half = pts[len(pts) // 2 :]
        rss[role] = {
            "first_mib": round(pts[0][1] / 2**20, 1),
            "last_mib": round(pts[-1][1] / 2**20, 1),
            "max_mib": round(max(p[1] for p in pts) / 2**20, 1),
            "slope_mib_per_min": _round((_slope(pts) or 0) / 2**20),
            "second_half_slope_mib_per_min": _round((_slope(half) or 0) / 2**20),
        }
    out["rss"] = rss
    fds = [sum(v["fds"] for v in smp.values() if v["role"] != "other") for _, smp, _ in soak.samples]
    out["fds"] = {
        "start": sum(fds0.values()),
        "first": fds[0] if fds else None,
        "last": fds[-1] if fds else None,
        "max": max(fds) if fds else None,
        "slope_per_min": _round(_slope([(t - t0, f) for (t, _, _), f in zip(soak.samples, fds)])),
    }
    shm = [n for _, _, n in soak.samples]
    out["dev_shm"] = {
        "at_start": len(shm0),
        "during_min": min(shm) if shm else None,
        "during_max": max(shm) if shm else None,
        "at_end": len(shm1),
        "left_behind": [],
    }
    g = [sc[2] for sc in soak.scrapes if sc[1] == 200]
    out["grammar"] = {
        "memory_bytes_max": max((x.get("dspark_harden_grammar_memory_cache_bytes", 0) for x in g), default=None),
        "memory_bytes_limit": int(limits["DSPARK_HARDEN_GRAMMAR_CACHE_BYTES"]),
        "memory_entries_max": max((x.get("dspark_harden_grammar_memory_cache_entries", 0) for x in g), default=None),
        "memory_entries_limit": int(limits["DSPARK_HARDEN_GRAMMAR_CACHE_ENTRIES"]),
        "disk_bytes_max": max((x.get("dspark_harden_grammar_disk_cache_bytes", 0) for x in g), default=None),
        "disk_bytes_limit": int(limits["DSPARK_HARDEN_GRAMMAR_DISK_BYTES"]),
        "corrupt_entries_total": max(
            (x.get("dspark_harden_grammar_corrupt_entries_total", 0) for x in g), default=None
        ),
    }
    out["metrics_scrapes"] = {"total": len(soak.scrapes), "failed": sum(1 for sc in soak.scrapes if sc[1] != 200)}
    out["active_requests"] = {"polls": len(soak.loads), "max_per_rank": max_active(soak.loads)}
    out["queues_drained"] = soak.drain
    if soak.adversarial:
        by: dict = {}
        for a in soak.abuse:
            b = by.setdefault(a["name"], {"sent": 0, "as_expected": 0, "statuses": set(), "example": a["answer"]})
            b["sent"] += 1
            b["as_expected"] += a["as_expected"]
            b["statuses"].add(a["status"])
            if not a["as_expected"]:
                b["example"] = a["answer"]
        out["abuse"] = {k: {**v, "statuses": sorted(v["statuses"])} for k, v in by.items()}
    allwf = wf.get("all", {})
    g_ok = all(
        (out["grammar"][k] or 0) <= out["grammar"][k.replace("_max", "_limit")]
        for k in ("memory_bytes_max", "memory_entries_max", "disk_bytes_max")
    )
    out["ok"] = bool(
        not crashed
        and allwf.get("errors", 1) == 0
        and allwf.get("constrained_invalid", 1) == 0
        and out["health_scheduler"]["non_200"] == 0
        and g_ok
        and not out["dev_shm"]["left_behind"]
        and out["metrics_scrapes"]["failed"] == 0
        and bool((out["queues_drained"] or {}).get("ok"))
        and all(v["as_expected"] == v["sent"] for v in out.get("abuse", {}).values())
    )
    return out


def _round(v: Optional[float], n: int = 4) -> Optional[float]:
    return None if v is None else round(v, n)


def main(args) -> int:
    import signal

    if args.stock and args.adversarial:
        print(f"bench soak: {STOCK_ADVERSARIAL}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _serve._term_as_interrupt)  # stop the server on SIGTERM too
    problem = _server.cpu_platform_problem()
    if problem:
        print(f"bench soak: {problem}", file=sys.stderr)
        return 2
    skip = tuple(x.strip() for x in (args.skip_abuse or "").split(",") if x.strip())
    known = set(ABUSE) | {"disconnect_mid_stream", "corrupt_disk_entry", "burst_500_new_schema"}
    if set(skip) - known:
        print(f"bench soak: --skip-abuse: unknown {sorted(set(skip) - known)}; known: {sorted(known)}", file=sys.stderr)
        return 2
    rep = run(args.minutes, args.rate, args.seed, args.adversarial, args.poll_s, skip, stock=args.stock)
    rep["skipped_abuse"] = list(skip)
    print(json.dumps(rep, indent=2) if args.json else _human(rep))
    return 0 if rep["ok"] else 1


def _human(r: dict) -> str:
    return json.dumps(r, indent=1)
