"""A persistence helper that breaks the protocol on its first start (tests/grammar/test_no_wedge.py).

It speaks the real helper's protocol (private descriptors, tagged lines); on the first start (no
file at <state>) it answers its first job with MODE: ``wrong_key`` (a result tagged with another
key, as a shifted line would be), ``garbage`` (a line that is not JSON) or ``deadlock`` (it announces
the compile phase, then blocks forever on a lock its own thread holds, beside a second thread blocked
the same way: what the real helper did when xgrammar's thread pool could not create a thread); after
that it answers correctly. Publishing is not its business here: it reports what the real helper would.

usage: python _fake_helper.py <state> <mode> --parent-pid PID --proto-fds IN,OUT
"""

import json
import os
import sys
import threading


def main() -> None:
    state, mode = sys.argv[1], sys.argv[2]
    fd_in, fd_out = (int(x) for x in sys.argv[sys.argv.index("--proto-fds") + 1].split(","))
    first = not os.path.exists(state)
    open(state, "a").close()
    rd = os.fdopen(fd_in, "rb")
    out = os.fdopen(fd_out, "w")
    rd.readline()  # init
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "limit": 0}) + "\n")
    out.flush()
    for line in rd:
        job = json.loads(line)
        tag = {"job": job["job"], "key_hex": job["key_hex"]}
        if first and mode == "wrong_key":
            tag["key_hex"] = "0" * 64
        if first and mode == "deadlock":
            out.write(json.dumps({**tag, "phase": "compile"}) + "\n")
            out.flush()
            lock = threading.Lock()
            lock.acquire()
            threading.Thread(target=lock.acquire, daemon=True).start()
            lock.acquire()  # never returns: every thread asleep on a futex, no CPU
        if first and mode == "garbage":
            out.write("Compiling grammar... done\n")
        else:
            out.write(
                json.dumps(
                    {**tag, "status": "published", "stored": "serialized", "reason": "", "total": 1, "pruned": 0}
                )
                + "\n"
            )
        out.flush()
        first = False


if __name__ == "__main__":
    main()
