#!/usr/bin/env python3
"""CPU seconds per test module of a suite run, every descendant process included.

The per-module seconds `.ci/run` prints are wall time under two pytest-xdist workers sharing two cores;
what a cut must shrink is CPU. This maps the kernel's process accounting onto the tests:

    sudo accton /tmp/pacct                       # Debian package `acct`
    DSPARK_TEST_TIMELINE=/tmp/timeline.tsv make test
    sudo accton off
    python scripts/cpu_ledger.py /tmp/pacct /tmp/timeline.tsv [--top 40]

Each process record (acct v3: pid, ppid, start second, user+system CPU, command name) is charged to the
test its pytest worker ran when the worker's child in its ancestry started (a server started in a shared
fixture is charged to the test that started it). A process whose parent had exited first (reparented)
is charged by its own start time to the worker that ran a server-group test then, else left unattributed
and listed by command name.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import struct

_REC = struct.Struct("<cBHIIIIIIfHHHHHHHH16s")  # struct acct_v3, 64 bytes
AHZ = 100.0


def _comp(c: int) -> float:
    return ((c & 0x1FFF) << (3 * (c >> 13))) / AHZ


def records(path: str) -> list:
    out = []
    data = open(path, "rb").read()
    for off in range(0, len(data) - len(data) % 64, 64):
        f = _REC.unpack_from(data, off)
        if f[1] & 0x7F != 3:
            raise SystemExit(f"{path}: record at {off} is not acct v3 (version byte {f[1]})")
        out.append(
            {
                "pid": f[6],
                "ppid": f[7],
                "start": float(f[8]),
                "end": f[8] + f[9] / AHZ,
                "cpu": _comp(f[10]) + _comp(f[11]),
                "comm": f[18].split(b"\0", 1)[0].decode(errors="replace"),
            }
        )
    return out


def timeline(path: str) -> dict:
    """worker pid -> sorted [(start, end, nodeid)]."""
    by = collections.defaultdict(list)
    for line in open(path):
        pid, start, end, nodeid = line.rstrip("\n").split("\t", 3)
        by[int(pid)].append((float(start), float(end), nodeid.split("@", 1)[0]))
    return {k: sorted(v) for k, v in by.items()}


def _test_at(windows: list, t: float):
    i = bisect.bisect_right([w[0] for w in windows], t + 1.0) - 1  # start seconds are truncated
    return windows[i][2] if i >= 0 else None


def ledger(recs: list, tl: dict) -> tuple:
    by_pid = collections.defaultdict(list)
    for r in recs:
        by_pid[r["pid"]].append(r)

    def parent(r):
        cands = [p for p in by_pid.get(r["ppid"], ()) if p["start"] <= r["start"] + 1 and p["end"] >= r["start"] - 1]
        return cands[0] if cands else None

    per_test = collections.Counter()
    unattributed = collections.Counter()
    workers = set(tl)
    for r in recs:
        if r["pid"] in workers and r["ppid"] not in workers:
            per_test["(pytest workers themselves)"] += r["cpu"]
            continue
        cur, test = r, None
        for _ in range(64):
            if cur["ppid"] in workers:
                test = _test_at(tl[cur["ppid"]], cur["start"])
                break
            nxt = parent(cur)
            if nxt is None:
                break
            cur = nxt
        if test is None:
            unattributed[r["comm"]] += r["cpu"]
        else:
            per_test[test] += r["cpu"]
    return per_test, unattributed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pacct")
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    recs = records(a.pacct)
    per_test, unattributed = ledger(recs, timeline(a.timeline))
    per_module = collections.Counter()
    for test, cpu in per_test.items():
        per_module[test.split("::", 1)[0]] += cpu
    total = sum(r["cpu"] for r in recs)
    print(f"{len(recs)} processes, {total / 60:.1f} CPU-min in all")
    print(f"\nCPU seconds per module (descendants included; top {a.top}):")
    for mod, cpu in per_module.most_common(a.top):
        print(f"{cpu:9.1f}  {mod}")
    print(f"\nunattributed ({sum(unattributed.values()):.0f} s) by command:")
    for comm, cpu in unattributed.most_common(15):
        print(f"{cpu:9.1f}  {comm}")
    print(f"\nCPU seconds per test (top {a.top}):")
    for test, cpu in per_test.most_common(a.top):
        print(f"{cpu:9.1f}  {test}")


if __name__ == "__main__":
    main()
