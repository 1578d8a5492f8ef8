"""What the DP2 server tests read from a running server: its derived session id (log), the DP2 segments its
processes map and the session id they inherited (/proc), and its exchange metrics (/metrics)."""

from __future__ import annotations

import re
import time

from dspark_harden.core import procfs

SESSION_RE = re.compile(r"derived (auto-\d+-[0-9a-f]{16}) for this launch")


def session_of(server) -> str:
    """The session id the server's main process derived (exactly one such line in its log)."""
    found = SESSION_RE.findall(server.log_text())
    assert len(found) == 1, (found, server.log_tail(4000))
    return found[0]


def mapped_dp2_segments(pgid: int) -> set:
    """/dev/shm names of the DP2 segments the processes of the server's group have mapped now (unlinked once
    both ranks opened them: the name the mapping shows, without `` (deleted)``)."""
    out = set()
    for pid in procfs.group_pids(pgid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[-1].removesuffix(" (deleted)")
                    if path.startswith("/dev/shm/dspark_dp2_"):
                        out.add(path[len("/dev/shm") :])
        except OSError:
            continue
    return out


def group_session_ids(pgid: int, variable: str) -> dict:
    """{pid: value} of ``variable`` in the environment (as they were started with it) of the server's
    process-group members that carry it."""
    out = {}
    for pid in procfs.group_pids(pgid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        value = env.get(variable.encode())
        if value is not None:
            out[pid] = value.decode()
    return out


def samples(text: str, name: str) -> dict:
    """{sorted label pairs: value} of one metric family in a /metrics text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(value)
    return out


def mlp_calls(server) -> dict:
    """{dp_rank: native exchange calls on the ``mlp`` channel} of the server."""
    calls = samples(server.metrics_text(), "dspark_harden_dp2_exchange_calls_total")
    return {dict(k).get("dp_rank"): v for k, v in calls.items() if dict(k).get("channel") == "mlp"}


def serve_on_both_ranks(server, *, prefix: str, max_new_tokens: int = 8, timeout: float = 300.0) -> tuple:
    """Route requests alternately to each DP rank until both ranks' native exchange calls grew (at least
    four requests); returns (ranks that answered, calls before, calls after)."""
    before = mlp_calls(server)
    ranks, calls, i = set(), dict(before), 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = server.generate(f"def {prefix}{i}(x):", max_new_tokens=max_new_tokens, routed_dp_rank=i % 2)
        assert out["text"] is not None
        ranks.add(out["meta_info"].get("dp_rank", i % 2))
        i += 1
        calls = mlp_calls(server)
        if i >= 4 and all(calls.get(r, 0) > before.get(r, 0) for r in ("0", "1")):
            break
    return ranks, before, calls
