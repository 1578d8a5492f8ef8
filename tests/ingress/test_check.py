"""``dspark-harden check`` (fresh child per role, SGLang's own ``load_plugins()``) lists the
ingress and health features bound, and refuses a foreign multi-tokenizer app path."""

from __future__ import annotations

import json
import os
import sys

from tests.harness import warm


def _check(*args, **env):
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--json", *args],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("DSPARK_HARDEN_")},
            "SGLANG_PLUGINS": "dspark_harden",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_check_lists_ingress_and_health_features_bound():
    rc, data = _check()
    feats = {f["name"]: f for f in data["features"]}
    expected = {
        "atomic-routed-batch": {
            ("sglang.srt.managers.tokenizer_manager:TokenizerManager._should_use_batch_tokenization", "main"),
            (
                "sglang.srt.managers.data_parallel_controller:DataParallelController.dispatch_batch_generate",
                "controller",
            ),
            (
                "sglang.srt.managers.data_parallel_controller:DataParallelController.dispatching_with_trace",
                "controller",
            ),
            ("sglang.srt.managers.scheduler:Scheduler.handle_batch_generate_request", "scheduler"),
        },
        "dp-controller-blocking-loop": {
            ("sglang.srt.managers.data_parallel_controller:DataParallelController.event_loop", "controller"),
        },
        "health-scheduler": {("sglang.srt.entrypoints.http_server:app/health_scheduler", "main")},
    }
    for name, targets in expected.items():
        assert feats[name]["status"] == "bound", feats.get(name)
        got = {(t["target"], t["role"]) for t in feats[name]["targets"] if t["bound"]}
        assert got == targets, (name, got)
    assert rc == 0 and data["ok"], data["problems"]


def test_check_refuses_foreign_multi_tokenizer_app_path():
    rc, data = _check("--role", "main", SGLANG_HTTP_SERVER_APP_PATH="myapp.server:app")
    assert rc == 1 and not data["ok"]
    assert any("SGLANG_HTTP_SERVER_APP_PATH='myapp.server:app'" in p for p in data["problems"]), data
    # with both features that need the workers switched off, the same path is accepted
    rc, data = _check(
        "--role",
        "main",
        SGLANG_HTTP_SERVER_APP_PATH="myapp.server:app",
        DSPARK_HARDEN_ATOMIC_ROUTED_BATCH="0",
        DSPARK_HARDEN_HEALTH_SCHEDULER="0",
    )
    assert rc == 0 and data["ok"], data["problems"]
