"""The offline ``sglang.Engine`` path with the plugin active leaves nothing in /dev/shm (issue 27 item 2).

Real parts: stock ``sglang.Engine`` (in-process main) on the CPU DP2 harness (tiny Qwen3, tp 2, dp 2,
DP attention, the test CPU platform), a JSON-schema request through xgrammar, stock
``Engine.shutdown``; two Engines one after the other in the same process (the second must start with
a run directory its children accept and be tracked on its own). Stock alone leaves 4 entries per
Engine here (2 ``sem.mp-*``, ``sgl_shm_mq_*``, ``sglang_loads_*``); the wrapped shutdown must leave 0.
The /dev/shm entries counted are the ones the probe's process tree mapped or held (scanned every second and
after the request), so entries other processes of the host create meanwhile are not counted.

Servers: two offline Engines of its own (no HTTP server can stand for ``sglang.Engine``, and the second
Engine's start after the first one's shutdown is what is tested).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest

from dspark_harden.devtools import lock
from dspark_harden.devtools.server import PLATFORM_ENV, PLUGIN_ACTIVE_RE, free_port

#: processes that log 'dspark-harden ... active in <role> process' across the probe's two DP2 Engines
ENGINE_ROLES = {"main": 1, "controller": 2, "scheduler": 4, "detokenizer": 2}


def two_port_bases() -> list:
    """Two free ports (each checked with the ports SGLang derives from it) far enough apart that the two
    Engines' ranges cannot overlap."""
    first = free_port()
    for _ in range(50):
        second = free_port()
        if abs(second - first) > 1000:
            return [str(first), str(second)]
    raise RuntimeError("no second free port range")


# not host_exclusive: an Engine's /dev/shm entries are the ones its process tree mapped or held
# (dspark_harden.devtools.shmwatch), so tests of the other pytest-xdist worker may create theirs meanwhile
pytestmark = [pytest.mark.server]

PROBE = textwrap.dedent("""
    import json, os, sys

    def main():
        import sglang as sgl
        from dspark_harden.devtools.tiny_models import ensure_model

        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
                  "required": ["ok", "color"], "additionalProperties": False}
        report = []
        from dspark_harden.devtools import shmwatch

        for i in range(2):
            before = shmwatch.entries()
            # what this process tree (this process and the Engine's children) maps or holds, scanned while it
            # runs: another test's entries are not this Engine's (no host-wide diff)
            watch = shmwatch.watch(os.getpid(), every_s=1.0)
            # a port range of its own per Engine: the first Engine's ports stay bound in this process
            port = int(sys.argv[1 + i])
            eng = sgl.Engine(model_path=ensure_model("qwen3"), device="cpu", attention_backend="torch_native",
                             sampling_backend="pytorch", disable_cuda_graph=True, max_total_tokens=8192,
                             grammar_backend="xgrammar", constrained_json_disable_any_whitespace=True,
                             tp_size=2, dp_size=2, enable_dp_attention=True, log_level="warning",
                             port=port)
            out = eng.generate("JSON:", sampling_params={"json_schema": json.dumps(schema), "max_new_tokens": 64,
                                                         "temperature": 0})
            watch.scan()
            during = shmwatch.created(watch, before)
            from dspark_harden.lifecycle.proctree import is_subreaper
            subreaper = is_subreaper()  # the caller's own process: never made a child subreaper
            eng.shutdown()
            # created by the tree and still there, in use by this process or not (the caller keeps running)
            watch.stop()
            left = sorted(os.path.basename(p) for p in shmwatch.created(watch, before))
            report.append({"text": out["text"], "finish": out["meta_info"]["finish_reason"]["type"],
                           "created": len(during), "left": left, "subreaper": subreaper})
        print("PROBE " + json.dumps(report), flush=True)

    if __name__ == "__main__":
        main()
""")


def test_two_offline_engines_in_one_process_leave_nothing_in_dev_shm(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_HARDEN_") and k != "PYTEST_CURRENT_TEST"}
    env.update(
        PLATFORM_ENV,
        SGLANG_PLUGINS="dspark_harden",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        SGLANG_CPU_OMP_THREADS_BIND="0|1",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp_path),
    )
    with lock.server_lock():
        r = subprocess.run(
            [sys.executable, str(script), *two_port_bases()],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            start_new_session=True,  # apart from pytest's process group
        )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert r.returncode == 0 and lines, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    report = json.loads(lines[-1][6:])
    assert len(report) == 2
    for engine in report:
        assert engine["created"] > 0  # the tree did create shared memory: the check can see leftovers
        if engine["left"]:  # the wrapper's lines name why (pytest.fail: its message is never shortened)
            why = [ln[:1500] for ln in r.stderr.splitlines() if "dspark-harden lifecycle" in ln]
            pytest.fail(f"left {engine['left']} of {report}; lifecycle log: " + "\n".join(why or ["(none)"]))
        assert engine["finish"] == "stop", engine  # the schema's grammar ended the answer
        assert engine["subreaper"] is False, engine  # the user's process adopts no orphans (issue 39)
        value = json.loads(engine["text"])
        assert sorted(value) == ["color", "ok"] and isinstance(value["ok"], bool), engine
    # the plugin bound in every process of both trees: the caller's own process once (it is the main
    # process of both Engines), and each Engine's DP controller, two schedulers and detokenizer
    roles = collections.Counter(m.group(1) for m in PLUGIN_ACTIVE_RE.finditer(r.stderr))
    assert dict(roles) == ENGINE_ROLES, (dict(roles), r.stderr[-4000:])
