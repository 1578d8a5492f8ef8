"""A server's process tree from /proc: the processes of its process group (the harness starts each
server in its own session), their role (from SGLang's process titles), CPU seconds, RSS and open
file descriptors; pausing / resuming the whole group (SIGSTOP / SIGCONT)."""

from __future__ import annotations

import os
import signal

from ...core import procfs

_PAGE = os.sysconf("SC_PAGE_SIZE")


def role_of(pid: int, main_pid: int, cmdline: str) -> str:
    """main (HTTP server + tokenizer), controller, scheduler, detokenizer or other (e.g. helpers)."""
    if pid == main_pid:
        return "main"
    if "data_parallel_controller" in cmdline:
        return "controller"
    if "sglang::scheduler" in cmdline:
        return "scheduler"
    if "detokenizer" in cmdline:
        return "detokenizer"
    return "other"


def sample(main_pid: int) -> dict[int, dict]:
    """{pid: {role, cpu_s, rss_bytes, fds}} for every live process of the server's group."""
    out = {}
    for pid in procfs.group_pids(main_pid):
        st, cmd = procfs.stat(pid), procfs.cmdline(pid)
        if st is None or cmd is None:
            continue
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * _PAGE
        except OSError:
            continue
        try:
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            fds = -1
        out[pid] = {"role": role_of(pid, main_pid, cmd), "cpu_s": st.cpu_seconds, "rss_bytes": rss, "fds": fds}
    return out


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each role spent between two samples (processes in both; new ones from 0)."""
    out: dict[str, float] = {}
    for pid, a in after.items():
        b = before.get(pid, {"cpu_s": 0.0})
        out[a["role"]] = round(out.get(a["role"], 0.0) + a["cpu_s"] - b["cpu_s"], 3)
    return dict(sorted(out.items()))


def pause(pgid: int) -> None:
    os.killpg(pgid, signal.SIGSTOP)


def resume(pgid: int) -> None:
    os.killpg(pgid, signal.SIGCONT)


def shm_entries(prefixes: tuple = ("dspark", "sglang", "psm_", "torch_")) -> list[str]:
    """/dev/shm names that look like ours or SGLang's / torch's (other users' files are ignored)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))
    except OSError:
        return []
