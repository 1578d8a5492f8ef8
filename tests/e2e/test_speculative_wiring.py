"""``bench serve --speculative dspark`` and ``--corpus N`` wiring, without a server (issue 23 items
2 and 3): the option parses, the servers' configurations, the constrained-weighted trace, the
corpus entries and their draft-aware check, the accept-length summary, the mask-metrics parsing and
the report's gates."""

from __future__ import annotations

import types

import pytest

from dspark_harden.devtools.e2e import client, serve, trace


def test_cli_parses_speculative_and_corpus():
    from dspark_harden.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--speculative", "dspark", "--corpus", "12", "--json"])
    assert args.speculative == "dspark" and args.corpus == 12
    assert build_parser().parse_args(["bench", "serve"]).speculative is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--speculative", "eagle"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--corpus", "0"])


def test_dspark_server_configs():
    stock = serve.stock_config("dspark")
    plugin = serve.plugin_config("/tmp/g", speculative="dspark")
    off_feature, off_env = serve.SPECULATIVE["dspark"]["ablation"]
    ablated = serve.plugin_config("/tmp/g2", off_env, speculative="dspark")
    for c in (stock, plugin, ablated):
        assert c.arch == "qwen3" and c.dp_size == 2 and c.tp_size == 2 and c.dp_attention
        args = list(c.extra_args)
        assert args[args.index("--speculative-algorithm") + 1] == "DSPARK"
        assert "--speculative-draft-model-path" in args and "--enable-dp-lm-head" in args
    assert stock.plugins is None
    assert dict(plugin.env)["DSPARK_HARDEN_DSPARK_MASKS"] == "1"
    assert off_feature == "dspark-masks" and dict(ablated.env)["DSPARK_HARDEN_DSPARK_MASKS"] == "0"
    # without --speculative: the DeepseekV3 DP2 servers of the plain bench, no draft
    assert (
        serve.stock_config().arch == "deepseek_v3" and "--speculative-algorithm" not in serve.stock_config().extra_args
    )


def test_constrained_mix_and_default_trace_unchanged():
    assert trace.generate(seed=3, requests=60) == trace.generate(seed=3, requests=60, mix=trace.DEFAULT_MIX)
    kinds = trace.describe(trace.generate(seed=0, requests=200, batches=0, burst=0, mix=trace.CONSTRAINED_MIX))[
        "by_kind"
    ]
    constrained = kinds.get("json", 0) + kinds.get("regex", 0) + kinds.get("ebnf", 0)
    assert constrained >= 0.7 * sum(kinds.values()), kinds
    with pytest.raises(ValueError):
        trace.generate(mix={"json": 0.9, "regex": 0.3})


def test_corpus_entries_and_draft_checks(monkeypatch, tmp_path):
    d4 = tmp_path / "node_modules" / trace.CORPUS_PACKAGE / "tests"
    (d4 / "draft4").mkdir(parents=True)
    (d4 / "draft3").mkdir(parents=True)
    (d4 / "draft4" / "maximum.json").write_text(
        '[{"schema": {"maximum": 3, "exclusiveMaximum": true}}, {"schema": {"type": "boolean"}}, {"schema": true}]'
    )
    (d4 / "draft3" / "required.json").write_text(
        '[{"schema": {"properties": {"a": {"required": true}}}}, {"schema": {"type": "boolean"}}]'
    )
    monkeypatch.setenv("DSPARK_HARDEN_NPM_PREFIX", str(tmp_path))
    base = trace.generate(seed=0, requests=10)
    entries, info = trace.corpus_entries(10, base, compiles=lambda s: "maximum" not in s)
    # left out: draft4 maximum#0 (not compiled, here by the stand-in predicate) and draft3 required#0
    # (a boolean "required", which xgrammar does not apply)
    assert info == {
        "corpus_schemas": 3,
        "usable": 1,
        "drawn": 1,
        "left_out": {
            "draft-3 keywords xgrammar does not apply": 1,
            "not held by the server's grammar (usable_reason)": 1,
        },
    }
    assert [e["corpus"] for e in entries] == ["draft4/maximum#1"] and entries[0]["kind"] == "corpus"
    assert all(0 <= e["t"] <= max(b["t"] for b in base) for e in entries)
    assert entries[0]["check"]["draft"] == "draft4"
    # draft semantics of the check: draft3 'required: true' inside properties, draft4 boolean exclusiveMaximum
    d3 = {"type": "json_schema", "schema": {"properties": {"a": {"required": True}}}, "draft": "draft3"}
    assert trace.check_output(d3, "{}")
    assert trace.check_output(d3, '{"a": 1}') is None
    assert trace.check_output(
        {"type": "json_schema", "schema": {"maximum": 3, "exclusiveMaximum": True}, "draft": "draft4"}, "3"
    )
    monkeypatch.setenv("DSPARK_HARDEN_NPM_PREFIX", str(tmp_path / "nowhere"))
    with pytest.raises(trace.TraceError, match="install.sh"):
        trace.corpus_entries(1, base)


def test_the_draw_leaves_out_what_the_server_or_the_grammar_cannot_hold():
    """Seen in a real DSpark bench run: a schema SGLang's backend refuses at dispatch (``not``: its
    validate_xgrammar_json_schema, not xgrammar, refuses it), a remote $ref nobody resolves (the
    validator crashed) and a number bound xgrammar's grammar does not enforce (121212e1000 under
    ``maximum``) each counted as an invalid output on stock and plugin alike."""
    assert "not compiled" in trace.usable_reason({"not": {"type": "integer"}})
    assert "non-local $ref" in trace.usable_reason({"$ref": "http://localhost:1234/integer.json"})
    assert "number" in trace.usable_reason({"properties": {"x": {"type": "number", "maximum": 3}}})
    assert trace.usable_reason({"properties": {"x": {"type": "integer", "maximum": 3}}}) is None
    assert trace.usable_reason({"$ref": "#/definitions/a", "definitions": {"a": {"type": "boolean"}}}) is None
    assert trace.usable_reason({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    # draft 3's boolean "required" is not applied by xgrammar ({} passed for a schema requiring "bar")
    d3 = {"type": "object", "properties": {"bar": {"enum": ["bar"], "required": True}}}
    assert "draft-3" in trace.usable_reason(d3, "draft3")
    # a validator that cannot run is a failed check with its cause, never a client crash
    why = trace.check_output({"type": "json_schema", "schema": {"$ref": "http://localhost:1234/x.json"}}, "1")
    assert why and why.startswith("the validator could not check it")


def test_a_truncated_output_is_checked_as_a_prefix_the_constraint_accepts():
    """An output cut by max_new_tokens cannot be a complete document; the constraint held when a real
    xgrammar matcher of the same schema (the server's tokenizer) accepts every token. Mutation: a
    token the schema forbids in the middle is reported."""
    from transformers import AutoTokenizer

    from dspark_harden.devtools import tiny_models

    tok_dir = tiny_models.ensure_model("qwen3")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    check = {
        "type": "json_schema",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        },
    }
    ids = tok.encode('{"name": "abcdefgh', add_special_tokens=False)
    assert trace.check_output(check, tok.decode(ids))  # not a complete document
    assert trace.check_prefix(check, ids, tok_dir) is None
    bad = tok.encode('{"nope": 1', add_special_tokens=False)
    assert "not accepted by the constraint" in trace.check_prefix(check, bad, tok_dir)
    regex = {"type": "regex", "pattern": "[0-9]+-[a-z]+"}
    assert trace.check_prefix(regex, tok.encode("123-ab", add_special_tokens=False), tok_dir) is None
    assert trace.check_prefix(regex, tok.encode("12a", add_special_tokens=False), tok_dir)


def test_a_schema_whose_grammar_admits_documents_the_validator_rejects_is_found():
    """The draw also leaves out schemas whose real xgrammar grammar (the server's tokenizer) admits
    one of the suite's own test documents that the validator rejects: ``maxLength`` without a
    ``type`` is not enforced ("foo" passes the grammar), with ``"type": "string"`` it is."""
    from dspark_harden.devtools import tiny_models

    tok_dir = tiny_models.ensure_model("qwen3")
    untyped = {"type": "json_schema", "schema": {"maxLength": 2}, "draft": "draft4"}
    assert trace.leak(untyped, ["f", "foo", 100], tok_dir) == '"foo"'
    typed = {"type": "json_schema", "schema": {"type": "string", "maxLength": 2}, "draft": "draft4"}
    assert trace.leak(typed, ["f", "foo"], tok_dir) is None


def test_accept_length_in_the_summary():
    enum = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"]}
    keys = {"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}
    entries = [
        {"id": "a", "kind": "json", "check": {"type": "json_schema", "schema": enum}, "body": {"text": "x"}},
        {"id": "b", "kind": "plain", "check": None, "body": {"text": "y"}},
        {"id": "c", "kind": "json", "check": {"type": "json_schema", "schema": keys}, "body": {"text": "z"}},
        {
            "id": "d",
            "kind": "corpus",
            "check": {"type": "json_schema", "schema": {"type": "string"}},
            "body": {"text": "w"},
        },
    ]
    results = []
    for e, (tokens, verify) in zip(entries, [(12, 6), (4, 4), (9, 3), (5, 5)]):
        r = client.Result(id=e["id"], kind=e["kind"], status=200)
        client._absorb(
            r, e, [{"meta_info": {"completion_tokens": tokens, "spec_verify_ct": verify}, "output_ids": [1]}]
        )
        results.append(r)
    s = client.summarize(results, 1.0, entries)
    assert s["spec_verify_ct"] == 18 and s["accept_length_mean"] == round(30 / 18, 4)
    assert s["accept_length_by_kind"] == {"corpus": 1.0, "json": round(21 / 9, 4), "plain": 1.0}
    assert s["accept_length_by_schema_shape"] == {"enum_const": 2.0, "fixed_keys": 3.0, "free": 1.0}
    assert "accept_length_mean" not in client.summarize(
        [client.Result(id="a", kind="json", status=200)], 1.0, entries[:1]
    )


METRICS = """\
dspark_harden_dspark_mask_engine{dp_rank="0",engine="native"} 1.0
dspark_harden_dspark_mask_engine{dp_rank="0",engine="python"} 0.0
dspark_harden_dspark_mask_engine{dp_rank="1",engine="native"} 1.0
dspark_harden_dspark_mask_steps_total{dp_rank="0",outcome="masked"} 7.0
dspark_harden_dspark_mask_steps_total{dp_rank="1",outcome="masked"} 5.0
dspark_harden_dspark_mask_steps_total{dp_rank="1",outcome="no_grammar"} 2.0
"""


def test_mask_state_and_speculative_report():
    assert serve.mask_state(METRICS) == {
        "engine_by_rank": {"0": "native", "1": "native"},
        "steps": {"masked": 12, "no_grammar": 2},
    }

    class _Srv:
        def metrics_text(self):
            return METRICS

    calls = []
    plugin = types.SimpleNamespace(
        server=_Srv(), resume=lambda: calls.append("resume"), pause=lambda: calls.append("pause")
    )
    report = {
        n: {"median": {"accept_length_mean": v}, "spread": {"accept_length_mean": [v, v]}}
        for n, v in (("stock", 1.1), ("plugin", 1.2))
    }
    sp = serve.speculative_report("dspark", report, plugin)
    assert sp["algorithm"] == "DSPARK" and sp["accept_length_mean"] == {"stock": 1.1, "plugin": 1.2}
    assert sp["mask_engine"] == "native" and sp["mask_steps"] == {"masked": 12, "no_grammar": 2}
    assert calls == ["resume", "pause"]


def test_ok_gates_the_mask_ablation():
    seq = {"checked": 2, "identical": 2, "failed_requests": []}
    side = {"errors": 0, "constrained_invalid": 0}
    r = {
        "identical_sequential": seq,
        "stock": side,
        "plugin": side,
        "speculative": {"ablation": {"errors": 0, "constrained_invalid": 0}},
    }
    assert serve.ok(r)
    r["speculative"]["ablation"]["constrained_invalid"] = 1
    assert not serve.ok(r)
    r["speculative"]["ablation"]["constrained_invalid"] = 0
    r["identical_sequential"] = {**seq, "identical": 1}
    assert not serve.ok(r)


def test_run_speculative_flow_with_fake_servers(monkeypatch):
    """serve.run(speculative="dspark") end to end over fake servers: which configurations start, in
    which order, and the report's shape (the real servers are exercised by the bench itself)."""
    started, passes = [], []

    class _Fake:
        def __init__(self, cfg):
            self.server = types.SimpleNamespace(config=cfg, ready_seconds=1.0, metrics_text=lambda: METRICS)
            self.name = cfg.name

        def pause(self):
            pass

        def resume(self):
            pass

        def stop(self):
            started.append(f"stop {self.name}")

    def fake_start(cfg):
        started.append(f"start {cfg.name} masks={dict(cfg.env).get('DSPARK_HARDEN_DSPARK_MASKS')}")
        return _Fake(cfg)

    def fake_pass(p, entries, *, sequential=False):
        passes.append((p.name, sequential))
        s = {k: 1.0 for k in serve.SUMMARY_KEYS}
        s.update(
            errors=0,
            constrained_invalid=0,
            constrained_truncated=0,
            cpu_s_by_role={"scheduler": 1.0},
            cpu_s_total=1.0,
            accept_length_mean=1.05 if "stock" in p.name else 1.1,
        )
        return {"summary": s, "outputs": {e["id"]: ((1, 2),) for e in entries}, "results": []}

    monkeypatch.setattr(serve, "start", fake_start)
    monkeypatch.setattr(serve, "one_pass", fake_pass)
    monkeypatch.setattr(serve._server._lock, "acquire", lambda: None)
    monkeypatch.setattr(serve._server._lock, "release", lambda: None)
    import dspark_harden.devtools.tiny_models as tm

    monkeypatch.setattr(tm, "ensure_dspark_draft", lambda: "/tmp/draft")
    entries = trace.generate(seed=0, requests=12, mix=trace.CONSTRAINED_MIX)
    r = serve.run(entries, rounds=2, seq_requests=4, speculative="dspark")
    assert started[:2] == ["start e2e-stock masks=None", "start e2e-plugin masks=1"]
    assert "stop e2e-plugin" in started and "start e2e-no-dspark-masks masks=0" in started
    sp = r["speculative"]
    assert sp["accept_length_mean"] == {"stock": 1.05, "plugin": 1.1} and sp["mask_engine"] == "native"
    assert sp["ablation"]["feature"] == "dspark-masks" and sp["ablation"]["rounds"] == 2
    assert sp["ablation"]["accept_length_mean"] == 1.1
    assert r["ok"] and "DSpark" not in r["method"]["servers"] and "DSPARK draft" in r["method"]["servers"]
    # ablation: warm-up + (plugin-without, stock) per round
    assert [n for n, _ in passes[-5:]] == ["e2e-no-dspark-masks"] + ["e2e-no-dspark-masks", "e2e-stock"] * 2
    assert serve.human(r).count("speculative: DSPARK") == 1
