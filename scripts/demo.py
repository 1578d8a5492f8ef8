"""`make demo`: the plugin on a real SGLang 0.5.23 server, on this CPU-only machine.

1. `dspark-harden check` against the installed SGLang (fresh child per process role; test-only
   features hidden, as in any operator's view);
2. `sglang.launch_server --dp-size 2 --tp-size 2 --enable-dp-attention` with a tiny locally generated
   DeepseekV3-architecture model, SGLANG_PLUGINS=dspark_harden and the native DP2 exchange on
   (SGLANG_DSPARK_DP2_SHM_MLP_SYNC=1: DP2 / attention-TP1 is exactly its geometry; no session id to
   manage). No GPU here: SGLang runs on the CPU platform of the test-support distribution
   (``pip install -e tests/support``, done by ``make install``; SGLang finds it through its own
   platform entry points, the demo imports nothing from tests/);
3. plain, routed (rank 0 and 1), routed batch and JSON-schema-constrained requests, plus /health_scheduler;
4. what the plugin did: a short per-feature summary (what ran where, how often, its key figure);
   ``--full`` also prints every non-zero ``dspark_harden_*`` series;
5. clean shutdown (SIGTERM to the server's main process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from dspark_harden.devtools.server import DP2_CONFIG, start_server
from dspark_harden.observability import summary

#: the demo's server: DP2 attention over TP2 with the native DP2 exchange on
CONFIG = DP2_CONFIG.with_env(SGLANG_DSPARK_DP2_SHM_MLP_SYNC="1")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"type": "string", "enum": ["low", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="also print every non-zero dspark_harden_* series")
    args = ap.parse_args(argv)

    step("dspark-harden check (fresh child per SGLang process role)")
    env = {**os.environ, "SGLANG_PLUGINS": "dspark_harden", **dict(CONFIG.env)}
    rc = subprocess.call([sys.executable, "-m", "dspark_harden", "check"], env=env)
    if rc != 0:
        print("check failed: the server would refuse to start", file=sys.stderr)
        return rc

    step(
        "launching sglang.launch_server --dp-size 2 --tp-size 2 --enable-dp-attention (CPU, tiny DeepseekV3), "
        "native DP2 exchange on"
    )
    server = start_server(CONFIG)
    try:
        print(f"ready at {server.url} (log: {server.log_path})")
        print("plugin active in processes:", ", ".join(server.plugin_roles()))

        step("requests")
        out = server.generate("def fibonacci(n):", max_new_tokens=12)
        print(f"plain      -> dp_rank={out['meta_info'].get('dp_rank')} text={out['text']!r}")
        for rank in (0, 1):
            out = server.generate("import os", max_new_tokens=8, routed_dp_rank=rank)
            print(f"routed {rank}   -> dp_rank={out['meta_info'].get('dp_rank')} text={out['text']!r}")
        batch = server.post(
            "/generate",
            {
                "text": [f"x = {i}" for i in range(8)],
                "routed_dp_rank": 1,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            },
            timeout=300,
        ).json()
        print(f"routed batch of 8 to rank 1 -> ranks {sorted({b['meta_info'].get('dp_rank') for b in batch})}")
        bad = server.post("/generate", {"text": "x", "routed_dp_rank": 7, "sampling_params": {"max_new_tokens": 2}})
        print(f"routed to rank 7 -> HTTP {bad.status_code}: {bad.text[:160]}")
        out = server.generate("Answer in JSON:", max_new_tokens=48, sampling_params={"json_schema": json.dumps(SCHEMA)})
        print(f"json_schema -> {out['text']!r} (parses: {json.loads(out['text'])})")
        health = server.get("/health_scheduler")
        print(f"/health_scheduler -> HTTP {health.status_code} {health.text[:200]}")

        step("what the plugin did (per feature: where it is bound, how often it ran, its key figure)")
        text = server.metrics_text()
        for line in summary.summarize(text, hide=summary.test_only_features()):
            print("  " + line)
        if args.full:
            step("every non-zero dspark_harden_* series (--full)")
            for line in text.splitlines():
                if (
                    line.startswith("dspark_harden_")
                    and not line.rstrip().endswith(" 0.0")
                    and "_bucket{" not in line
                    and "_created" not in line
                ):
                    print("  " + line)
    finally:
        step("shutdown")
        rc = server.stop()
        print(f"server exited with {rc}")
        server.remove_workdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
