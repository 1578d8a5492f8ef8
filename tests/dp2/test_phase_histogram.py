"""``dspark_harden_dp2_exchange_phase_seconds``: the per-phase histogram of the native DP2 exchange, exact,
through the real prometheus_client multiprocess files. Two real processes exchange over the real native
channel; each records every call's native split from the channel's stats struct (what the native call
bucketed itself) and its own ``_Acc`` flushes once; the parent reads both ranks' files with a real
``MultiProcessCollector`` and compares every bucket with the calls bucketed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

N = 300

_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from dspark_harden.dp2.channels import PHASES, _Acc, check_hist_edges
    from dspark_harden.dp2.native import Channel
    rank, session, n = int(os.environ["RANK"]), os.environ["SESSION"], int(os.environ["N"])
    check_hist_edges()
    ch = Channel(session, "mlp", rank=rank, width=3, timeout_ms=20000, config_digest=11)
    acc = _Acc("mlp", str(rank), True, ch.stats)
    acc.deadline = float("inf")  # one flush, at the end
    st = ch.stats
    per_call = {p: [] for p in PHASES}
    for i in range(n):
        ch.exchange([rank, i, 7])
        call_s = (i % 7) * 1.5e-6 + (0.002 if i % 50 == 0 else 0.0)  # a known whole-call time
        acc.record(call_s, 0.0)
        per_call["call_total"].append(call_s)
        per_call["exchange_total"].append(st.total_ns)
        per_call["peer_wait"].append(st.peer_wait_ns)
        per_call["arrival_skew"].append(st.arrival_skew_ns)
        per_call["post_latest_arrival"].append(st.post_latest_arrival_ns)
    acc.flush()
    ch.close()
    print("@@" + json.dumps(per_call), flush=True)
    """
)


def _bucket_ns(v: int, edges_ns) -> int:
    for b, e in enumerate(edges_ns):
        if v <= e:
            return b
    return len(edges_ns)


def test_phase_histogram_buckets_every_call_exactly(tmp_path):
    from prometheus_client import CollectorRegistry, multiprocess
    from prometheus_client.parser import text_string_to_metric_families

    from dspark_harden.dp2.metrics import DP2_HIST_EDGES_NS, DP2_HIST_EDGES_S, DP2_PHASES

    session = f"hist-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "SESSION": session, "N": str(N)}
    env.pop("DSPARK_HARDEN_ROLE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for r in (0, 1)
    ]
    per_rank = {}
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-3000:]
        line = [x for x in out.decode().splitlines() if x.startswith("@@")][-1]
        per_rank[str(r)] = json.loads(line[2:])

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    from prometheus_client import generate_latest

    got: dict = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        if fam.name != "dspark_harden_dp2_exchange_phase_seconds":
            continue
        for s in fam.samples:
            key = (s.labels["dp_rank"], s.labels["phase"], s.name.rsplit("_", 1)[-1], s.labels.get("le"))
            got[key] = s.value
    les = [repr(float(e)) for e in DP2_HIST_EDGES_S] + ["+Inf"]
    for dp, calls in per_rank.items():
        for phase in DP2_PHASES:
            values = calls[phase]
            if phase == "call_total":
                buckets = [_bucket_ns(round(v * 1e9), DP2_HIST_EDGES_NS) for v in values]
                total = sum(values)
            else:
                buckets = [_bucket_ns(v, DP2_HIST_EDGES_NS) for v in values]
                total = sum(values) * 1e-9
            assert got[(dp, phase, "count", None)] == N, (dp, phase)
            assert abs(got[(dp, phase, "sum", None)] - total) <= 1e-9 * N, (dp, phase)
            cumulative = 0
            for b, le in enumerate(les):
                cumulative += buckets.count(b)
                assert got[(dp, phase, "bucket", le)] == cumulative, (dp, phase, le)
        # the known whole-call times span several buckets: 0, 1.5, 3, 4.5, 6, 7.5, 9 us and 2 ms
        call_buckets = {_bucket_ns(round(v * 1e9), DP2_HIST_EDGES_NS) for v in calls["call_total"]}
        assert len(call_buckets) >= 5
