"""Tokenizer-side eligibility on real ``GenerateReqInput`` batches, the multi-tokenizer app
module in a fresh interpreter, and the SGLANG_HTTP_SERVER_APP_PATH policy."""

from __future__ import annotations

from sglang.srt.managers.io_struct import GenerateReqInput

from dspark_harden.core.patch import Role
from dspark_harden.core.settings import Settings
from dspark_harden.ingress import feature as F
from dspark_harden.ingress import tokenizer as T
from tests.plugin._proc import run_py


class _TM:
    is_generation = True


def batch(**kw) -> GenerateReqInput:
    obj = GenerateReqInput(sampling_params={"max_new_tokens": 1}, **kw)
    obj.normalize_batch_and_arguments()
    return obj


def eligible(obj) -> bool:
    return T.routed_batch_eligible(_TM(), obj.batch_size, obj)


def test_routed_text_batch_is_kept_together():
    assert eligible(batch(text=["a", "b", "c"], routed_dp_rank=1))


def test_routed_pretokenized_batch_is_kept_together():
    assert eligible(batch(input_ids=[[1, 2], [3]], routed_dp_rank=0))


def test_text_ids_mix_and_multimodal_keep_stock_path():
    mixed = batch(text=["a", "b"], routed_dp_rank=1)
    mixed[1].input_ids = [5, 6]
    assert not eligible(mixed)
    mm = batch(text=["a", "b"], image_data=["img0.png", "img1.png"], routed_dp_rank=1)
    assert mm[0].contains_mm_input() and not eligible(mm)


def test_unrouted_batch_keeps_stock_path():
    assert not eligible(batch(text=["a", "b"]))


def test_items_whose_route_differs_keep_stock_path():
    obj = batch(text=["a", "b"], routed_dp_rank=1)
    obj[1].routed_dp_rank = 0  # items are cached sub-objects: a per-item override is visible
    assert obj[1].routed_dp_rank == 0
    assert not eligible(obj)


def test_wrapper_keeps_stock_true_and_adds_only_under_dp_attention(monkeypatch):
    obj = batch(text=["a", "b"], routed_dp_rank=1)
    always = T.build_should_use_batch_tokenization(lambda self, n, r: True)
    never = T.build_should_use_batch_tokenization(lambda self, n, r: False)
    monkeypatch.setattr(T, "_attn_dp_enabled", lambda: False)
    assert always(_TM(), 2, obj) is True
    assert never(_TM(), 2, obj) is False  # no DP attention: stock answer stands
    monkeypatch.setattr(T, "_attn_dp_enabled", lambda: True)
    assert never(_TM(), 2, obj) is True
    assert never(_TM(), 2, batch(text=["a", "b"])) is False


def _settings(atomic=True, health=True):
    return Settings(values={F.ATOMIC_SWITCH: atomic, F.LOOP_SWITCH: True, F.POLL_MS: 100, F.HEALTH_SWITCH: health})


def test_app_path_is_pointed_at_our_module_when_unset_or_stock():
    for start in ({}, {F.APP_PATH_VAR: F.STOCK_APP_PATH}, {F.APP_PATH_VAR: F.OUR_APP_PATH}):
        env = dict(start)
        assert F.app_path_problem(_settings(), env) is None
        assert env[F.APP_PATH_VAR] == F.OUR_APP_PATH


def test_foreign_app_path_is_refused_while_features_need_workers():
    env = {F.APP_PATH_VAR: "myapp:app"}
    problem = F.app_path_problem(_settings(), env)
    assert problem and "myapp:app" in problem and F.OUR_APP_PATH in problem
    assert F.app_path_problem(_settings(atomic=False, health=False), env) is None
    assert F.app_path_problem(_settings(atomic=False, health=True), dict(env))


def test_patches_per_role_follow_switches():
    s = _settings()
    assert [p.target.rsplit(".", 1)[1] for p in F.patches(Role.MAIN, s)] == ["_should_use_batch_tokenization"]
    assert sorted(p.target.rsplit(".", 1)[1] for p in F.patches(Role.CONTROLLER, s)) == [
        "dispatch_batch_generate",
        "dispatching_with_trace",
        "event_loop",
    ]
    assert [p.target.rsplit(".", 1)[1] for p in F.patches(Role.SCHEDULER, s)] == ["handle_batch_generate_request"]
    off = Settings(values={F.ATOMIC_SWITCH: False, F.LOOP_SWITCH: False, F.POLL_MS: 100})
    assert F.patches(Role.CONTROLLER, off) == []


def test_multi_tokenizer_worker_app_module_binds_plugin():
    """What a Granian/uvicorn worker does: import SGLANG_HTTP_SERVER_APP_PATH's module in a fresh
    interpreter that never ran load_plugins()."""
    code = """
    import importlib, os
    module, _, attr = os.environ["SGLANG_HTTP_SERVER_APP_PATH"].partition(":")
    app = getattr(importlib.import_module(module), attr)
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.managers.multi_tokenizer_mixin import TokenizerWorker
    from dspark_harden.core import binder
    fn = TokenizerWorker._should_use_batch_tokenization
    emit({
        "same_app": app is http_server.app,
        "routes": [r.path for r in app.router.routes if getattr(r, "path", None) == "/health_scheduler"],
        "patched": getattr(fn, "__dspark_patch__", None),
        "role": binder.STATE.report.role,
        "ok": binder.STATE.report.ok,
    })
    """
    rc, res, out = run_py(
        code, env={"SGLANG_HTTP_SERVER_APP_PATH": F.OUR_APP_PATH, "SGLANG_PLUGINS": "dspark_harden"}, timeout=600
    )
    assert rc == 0 and res, out[-3000:]
    assert res["same_app"] and res["routes"] == ["/health_scheduler"]
    assert res["patched"] and res["patched"].endswith("_should_use_batch_tokenization")
    assert res["role"] == "main" and res["ok"]
