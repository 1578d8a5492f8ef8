"""Installed everywhere, harmful nowhere: real CPU servers of deployments the plugin is not built for,
with the plugin installed but not named (``SGLANG_PLUGINS`` empty: stock SGLang loads every installed
plugin) against stock (``SGLANG_PLUGINS`` naming no installed plugin) -- issue 39.

Each configuration must start, give token-identical greedy outputs (plain and JSON-schema constrained)
to stock, exit 0 on SIGTERM, and leave nothing behind (no process of its group after the main process
exited, no ``/dev/shm`` entry it created). Stock's side is recorded once per SGLang version and model
recipe in a committed fixture by ``python -m dspark_harden.devtools.matrix --record FILE`` (which runs
both arms of every configuration and fails on any difference); the test suite runs the installed arm of
a subset against that fixture (tests/integration/test_matrix.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Optional

from . import server as S
from . import shmwatch
from .tiny_models import RECIPE_VERSION, dspark_draft_dir, ensure_dspark_draft, ensure_model

#: SGLANG_PLUGINS of each arm: "" loads every installed plugin (dspark_harden included), the other
#: names none (S.STOCK_PLUGINS)
ARMS = {"installed": "", "stock": None}

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
#: how long the main process may take to exit after SIGTERM (4 TP ranks on 2 busy cores: over a minute)
EXIT_WAIT_S = 240.0
PROMPTS = ("def main():", "The capital of France is", "import numpy as np\n")


def _qwen(**kw) -> S.ServerConfig:
    return S.ServerConfig(arch="qwen3", **kw)


#: name -> (configuration, what it shows). "engine" is the offline sglang.Engine path (run_engine).
#: No non-DSpark speculative algorithm runs on this CPU platform in stock 0.5.23 (NGRAM's scheduler
#: imports sgl_kernel's CUDA build and dies before ready; EAGLE/standalone need CUDA kernels too): their
#: applicability is decided on real parsed ServerArgs instead (tests/plugin/test_applicability.py).
CONFIGS = {
    "single": (_qwen(name="m-single"), "one process, xgrammar: the grammar service applies"),
    "tp2-no-overlap": (
        _qwen(tp_size=2, extra_args=("--disable-overlap-schedule",), name="m-tp2"),
        "a TP group of 2 without DP attention, overlap scheduling off",
    ),
    "dp2-llguidance": (
        _qwen(dp_size=2, extra_args=("--grammar-backend", "llguidance"), name="m-dp2"),
        "DP2 without DP attention on another grammar backend: grammar-service unavailable",
    ),
    "dp2-attn-tp4": (
        S.ServerConfig(arch="deepseek_v3", dp_size=2, tp_size=4, dp_attention=True, name="m-dp2tp4"),
        "DP attention with attention-TP 2 (--dp 2 --tp 4; MLA: the tiny Qwen3's 2 KV heads do not shard 4 ways)",
    ),
    "dp4-attn": (
        S.ServerConfig(arch="deepseek_v3", dp_size=4, tp_size=4, dp_attention=True, name="m-dp4"),
        "DP4 under DP attention",
    ),
    "dspark": (
        _qwen(
            dp_size=2,
            tp_size=2,
            dp_attention=True,
            name="m-dspark",
            extra_args=("--speculative-algorithm", "DSPARK", "--enable-dp-lm-head"),
        ),
        "the target geometry (DSpark, DP2 attention) with the plugin installed but not named",
    ),
    "engine": (None, "the offline sglang.Engine path, single process"),
}


def _requests(post) -> list:
    """The greedy outputs of a configuration: ``post(text, sampling_params) -> (text, finish_type)``."""
    out = []
    for text in PROMPTS:
        out.append(post(text, {"max_new_tokens": 12, "temperature": 0.0}))
    out.append(post("JSON:", {"max_new_tokens": 48, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)}))
    return [list(o) for o in out]


def run_server(name: str, arm: str) -> dict:
    config, _ = CONFIGS[name]
    if "DSPARK" in config.extra_args:
        ensure_dspark_draft()
        config = S.ServerConfig(
            **{
                **config.__dict__,
                "extra_args": config.extra_args + ("--speculative-draft-model-path", dspark_draft_dir()),
            }
        )
    config = S.ServerConfig(**{**config.__dict__, "plugins": ARMS[arm]})
    server = S.SGLangServer(config, watch_shm=True).start()
    try:

        def post(text, sp):
            r = server.generate(text, sampling_params=sp, timeout=300)
            return r["text"], r["meta_info"]["finish_reason"]["type"]

        outputs = _requests(post)
        roles = sorted(set(server.plugin_roles()))
        pgid = server.pid
        os.kill(pgid, signal.SIGTERM)
        t_term = time.monotonic()
        rc = server.wait_exit(EXIT_WAIT_S)
        exit_s = time.monotonic() - t_term
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and S._group_alive(pgid):
            time.sleep(0.25)
        stragglers = S._group_alive(pgid)
    finally:
        server.stop()
    log = server.log_text()
    server.remove_workdir()
    return {
        "outputs": outputs,
        "exit": rc,
        "stragglers": stragglers,
        "exit_s": round(exit_s, 1),
        "left_shm": shmwatch.leftovers(server.shm_watch, server.shm_before),
        "plugin_roles": roles,
        "presence": presence_lines(log),
        "log_tail": log[-3000:],
    }


ENGINE_PROBE = textwrap.dedent("""
    import json, sys
    def main():
        import sglang as sgl
        from dspark_harden.devtools.matrix import PROMPTS, SCHEMA, _requests
        from dspark_harden.devtools.tiny_models import ensure_model
        eng = sgl.Engine(model_path=ensure_model("qwen3"), device="cpu", attention_backend="torch_native",
                         sampling_backend="pytorch", disable_cuda_graph=True, max_total_tokens=8192,
                         grammar_backend="xgrammar", constrained_json_disable_any_whitespace=True,
                         log_level="warning", port=int(sys.argv[1]))
        def post(text, sp):
            r = eng.generate(text, sampling_params=sp)
            return r["text"], r["meta_info"]["finish_reason"]["type"]
        outputs = _requests(post)
        eng.shutdown()
        print("MATRIX " + json.dumps(outputs), flush=True)
    if __name__ == "__main__":
        main()
""")


def run_engine(arm: str) -> dict:
    import tempfile

    ensure_model("qwen3")
    with tempfile.TemporaryDirectory(prefix="dspark-matrix-engine-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_HARDEN_")}
        env.update(S.PLATFORM_ENV, TMPDIR=tmp, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env["SGLANG_PLUGINS"] = S.STOCK_PLUGINS if ARMS[arm] is None else ARMS[arm]
        before = shmwatch.entries()
        with S._lock.server_lock():
            p = subprocess.Popen(
                [sys.executable, "-c", ENGINE_PROBE, str(S.free_port())],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp,
                start_new_session=True,
            )
            watch = shmwatch.watch(p.pid)
            try:
                stdout, stderr = p.communicate(timeout=900)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                watch.stop()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("MATRIX ")]
    return {
        "outputs": json.loads(lines[-1][7:]) if lines else None,
        "exit": p.returncode,
        "stragglers": False,
        "left_shm": shmwatch.leftovers(watch, before),
        "plugin_roles": sorted({m.group(1) for m in S.PLUGIN_ACTIVE_RE.finditer(stderr)}),
        "presence": presence_lines(stderr),
        "log_tail": stderr[-3000:],
    }


def presence_lines(log: str) -> list:
    """The plugin's one line per process (entry.presence_line): why it was loaded, what applies."""
    return [ln for ln in log.splitlines() if S.PLUGIN_ACTIVE_RE.search(ln)]


def run(name: str, arm: str) -> dict:
    return run_engine(arm) if name == "engine" else run_server(name, arm)


def problems(name: str, installed: dict, stock: dict) -> list:
    """What the installed arm did that stock did not (empty: identical to stock, clean exit)."""
    out = []
    if installed["outputs"] != stock["outputs"]:
        out.append(f"{name}: outputs differ: installed {installed['outputs']} vs stock {stock['outputs']}")
    if installed["exit"] != 0:
        out.append(f"{name}: exit code {installed['exit']} on SIGTERM (stock {stock['exit']})")
    if installed["stragglers"]:
        out.append(f"{name}: processes of the server's group outlived the main process")
    if installed["left_shm"]:
        out.append(f"{name}: left /dev/shm entries {installed['left_shm']}")
    if name != "engine" and not installed["plugin_roles"]:
        out.append(f"{name}: the plugin logged no presence line (was it loaded at all?)")
    return out


def fixture_key() -> dict:
    from importlib.metadata import version

    return {"sglang": version("sglang"), "model_recipe": RECIPE_VERSION}


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_harden.devtools.matrix", description=__doc__)
    p.add_argument("--record", metavar="FILE", help="run both arms of every configuration, write stock's side")
    p.add_argument("--only", action="append", choices=sorted(CONFIGS), help="only these configurations")
    args = p.parse_args(argv)
    names = args.only or list(CONFIGS)
    record = {**fixture_key(), "configs": {}}
    if args.record and os.path.exists(args.record):  # --only runs add to a fixture of the same key
        with open(args.record) as f:
            old = json.load(f)
        if all(old.get(k) == v for k, v in fixture_key().items()):
            record["configs"].update(old.get("configs", {}))
    failures = []
    for name in names:
        results = {}
        for arm in ("stock", "installed"):
            t0 = time.monotonic()
            try:
                results[arm] = run(name, arm)
            except S.ServerError as exc:
                results[arm] = {
                    "outputs": None,
                    "exit": None,
                    "stragglers": False,
                    "left_shm": [],
                    "plugin_roles": [],
                    "log_tail": str(exc)[-3000:],
                }
            print(
                f"[matrix] {name} {arm}: exit {results[arm]['exit']} "
                f"({results[arm].get('exit_s', '?')} s after SIGTERM), {time.monotonic() - t0:.0f} s in all",
                flush=True,
            )
        found = problems(name, results["installed"], results["stock"])
        if results["stock"]["outputs"] is None or results["stock"]["exit"] != 0:
            found.append(f"{name}: stock itself did not serve and exit cleanly: {results['stock']['log_tail']}")
        failures += found
        record["configs"][name] = {k: results["stock"][k] for k in ("outputs", "exit")}
        print(
            json.dumps(
                {
                    "config": name,
                    "problems": found,
                    "installed_roles": results["installed"]["plugin_roles"],
                    "installed_presence": results["installed"].get("presence", []),
                }
            ),
            flush=True,
        )
    if args.record and not failures:
        with open(args.record, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
    for line in failures:
        print("MATRIX PROBLEM: " + line[:4000], file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
