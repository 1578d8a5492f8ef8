"""Peer process for the native DP2 fault tests (run as a plain script; no sglang import).

usage: python peer.py <mode> <session> <rank> [args...]; prints JSON lines on stdout.
"""

import json
import os
import sys
import time

from dspark_harden.dp2.native import Channel, Dp2Error


def say(**kw):
    print(json.dumps(kw), flush=True)


def main():
    mode, session, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = sys.argv[4:]
    width = int(os.environ.get("PEER_WIDTH", "11"))
    timeout_ms = int(os.environ.get("PEER_TIMEOUT_MS", "20000"))
    digest = int(os.environ.get("PEER_DIGEST", "7"))
    try:
        ch = Channel(session, "mlp", rank=rank, width=width, timeout_ms=timeout_ms, config_digest=digest)
    except Dp2Error as exc:
        say(event="open_failed", code=exc.name, message=str(exc))
        return
    say(event="opened", pid=os.getpid(), name=ch.shm_name)
    n = int(args[0]) if args else 0
    try:
        for i in range(n):
            ch.exchange([rank * 1000 + i] * width)
        if mode == "exchange-then-sleep":
            say(event="ready", n=n)
            time.sleep(600)
        elif mode == "exchange-then-close":
            ch.close()
            say(event="closed", n=n)
        elif mode == "exchange-then-late":
            say(event="ready", n=n)
            time.sleep(float(args[1]))
            out = ch.exchange([rank * 1000 + n] * width)
            say(event="late_exchange_done", out=out)
        elif mode == "exchange-then-poison":
            err = ch.poison("peer failed a later step")
            say(event="poisoned", code=err.name)
        elif mode == "exchange-then-exit":
            say(event="exiting", n=n)
            os._exit(0)  # no close: the slot still names this pid, which becomes a zombie
        elif mode == "exchange-then-skip":
            go = os.environ.get("PEER_GO_FILE")
            deadline = time.monotonic() + 60
            while go and not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.005)  # the local end has finished reading the last row: skipping now cannot race it
            ch.debug_skip_sequence(int(args[1]), args[2] == "1")
            say(event="skipped")
            ch.exchange([0] * width)
            say(event="unexpected_success")
        elif mode == "exchange-then-wait":
            say(event="ready", n=n)
            ch.exchange([0] * width)
            say(event="unexpected_success")
    except Dp2Error as exc:
        say(event="error", code=exc.name, message=str(exc))
    finally:
        ch.close()


if __name__ == "__main__":
    main()
