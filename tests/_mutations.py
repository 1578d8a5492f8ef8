"""The runner shared by the mutation scripts (tests/*/mutations.py): each mutation replaces one exact
snippet of a source file, runs the named test (it must fail), and restores the file."""

import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(root: str, muts: list, *, timeout: int = 120, summary: bool = False) -> int:
    """``muts``: ``(name, file under root, old, new, test)``; ``sys.argv[1:]`` selects by the name's first
    word. Returns the number of survivors (prints each result, and ``red/total`` when ``summary``)."""
    sel = sys.argv[1:]
    red = total = 0
    for name, f, old, new, test in muts:
        if sel and name.split()[0] not in sel:
            continue
        path = os.path.join(root, f)
        src = open(path).read()
        assert src.count(old) == 1, (name, src.count(old))
        backup = tempfile.mktemp()
        shutil.copy(path, backup)
        try:
            open(path, "w").write(src.replace(old, new))
            r = subprocess.run(
                ["timeout", str(timeout), sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
                + ["-W", "ignore", test],
                capture_output=True,
                text=True,
                cwd=REPO,
            )
            last = [ln for ln in r.stdout.splitlines() if "passed" in ln or "failed" in ln or "error" in ln][-1:]
            total += 1
            red += bool(r.returncode)
            print(f"{name}: rc={r.returncode} {'RED' if r.returncode else 'GREEN(!)'} {last}", flush=True)
        finally:
            shutil.copy(backup, path)
            os.unlink(backup)
    if summary:
        print(f"{red}/{total} red")
    return total - red
