"""The production-shaped trace of ``bench serve`` / ``bench soak`` (no server): seeded and
deterministic, every class the issue asks for is present, the JSONL format round-trips and a bad
line is named, constrained outputs are checked with jsonschema / regex, and every generated JSON
schema spelling canonicalises to the schema it was derived from."""

from __future__ import annotations

import json

import pytest

from dspark_harden.devtools.e2e import client, trace


def test_generated_trace_is_seeded_and_production_shaped():
    a, b = trace.generate(seed=3), trace.generate(seed=3)
    assert a == b and a != trace.generate(seed=4)
    d = trace.describe(a)
    assert {"json", "regex", "ebnf", "plain", "routed", "batch", "burst"} <= set(d["by_kind"])
    assert d["by_kind"]["batch"] == 2 * trace.BATCH_SIZE
    assert d["distinct_schemas"] >= 15 and d["distinct_schema_spellings"] > d["distinct_schemas"]  # variants
    assert 0 < d["streaming"] < d["entries"]
    assert [e["t"] for e in a] == sorted(e["t"] for e in a)
    burst = [e for e in a if e["kind"] == "burst"]
    assert len({e["t"] for e in burst}) == 1 and len({e["body"]["sampling_params"]["json_schema"] for e in burst}) == 1
    prefixes = trace.Prompts(__import__("random").Random(0)).prefixes
    assert len(prefixes) == 3
    batches = [e for e in a if e["kind"] == "batch"]
    assert {e["body"]["routed_dp_rank"] for e in batches} == {0, 1}


def test_schema_variants_parse_to_the_same_schema():
    import random

    rng = random.Random(0)
    for schema in trace.schema_pool(rng, 10):
        for _ in range(6):
            assert json.loads(trace.schema_variant(schema, rng)) == schema


def test_jsonl_round_trip_and_errors_name_the_line(tmp_path):
    entries = trace.generate(seed=1, requests=20)
    p = tmp_path / "t.jsonl"
    trace.dump(entries, p)
    assert [e["id"] for e in trace.load(p)] == [e["id"] for e in entries]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "body": {"text": "x"}}\n{"t": -1, "body": {"text": "x"}}\n')
    with pytest.raises(trace.TraceError, match=r"bad.jsonl:2: 't' must be"):
        trace.load(bad)
    bad.write_text('{"t": 0, "body": {"text": "x", "stream": true}}\n')
    with pytest.raises(trace.TraceError, match="put 'stream' next to 'body'"):
        trace.load(bad)
    bad.write_text('{"t": 0, "body": {"text": "x"}, "check": {"type": "regex"}}\n')
    with pytest.raises(trace.TraceError, match="'check' must be"):
        trace.load(bad)


def test_checks_validate_constrained_outputs():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert trace.check_output({"type": "json_schema", "schema": schema}, '{"ok":true}') is None
    assert "schema violation" in trace.check_output({"type": "json_schema", "schema": schema}, '{"ok":1}')
    assert "not JSON" in trace.check_output({"type": "json_schema", "schema": schema}, '{"ok":')
    assert trace.check_output({"type": "regex", "pattern": r"[0-9]{3}"}, "123") is None
    assert trace.check_output({"type": "regex", "pattern": r"[0-9]{3}"}, "1234")
    for grammar, regex in trace.EBNFS:  # the regex that stands for each EBNF grammar accepts its language
        assert grammar.startswith("root ::=") and regex


def test_sequential_subset_covers_every_single_kind():
    entries = trace.generate(seed=0)
    seq = trace.sequential_subset(entries, 30)
    assert (
        len(seq) == 30
        and all(e["body"]["sampling_params"]["max_new_tokens"] <= 16 for e in seq)
        and {e["kind"] for e in seq} == {"json", "regex", "ebnf", "plain", "routed", "burst"}
    )


def test_percentiles_and_identical_fraction():
    assert client.pct([1, 2, 3, 4, 5], 0.5) == 3 and client.pct([], 0.5) is None
    assert client.identical_fraction({"a": ((1, 2),), "b": ((3,), (4,))}, {"a": ((1, 2),), "b": ((3,), (5,))}) == round(
        2 / 3, 4
    )


def test_cli_parses_serve_and_soak():
    from dspark_harden.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "serve", "--json", "--rounds", "4", "--rate", "2.5", "--requests", "50", "--ablate"]
    )
    assert (args.rounds, args.rate, args.requests, args.ablate) == (4, 2.5, 50, True)
    args = build_parser().parse_args(["bench", "soak", "--minutes", "0.5", "--adversarial"])
    assert args.minutes == 0.5 and args.adversarial
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--rounds", "0"])


def test_soak_stock_with_adversarial_is_refused_before_any_server_starts(capsys):
    """Stock SGLang is taken down by some of the abuses, so a stock adversarial soak would only
    measure a dead server: refused with exit 2 and the reason, before anything is started."""
    from dspark_harden.cli import build_parser
    from dspark_harden.devtools.e2e import soak

    args = build_parser().parse_args(["bench", "soak", "--minutes", "1", "--stock", "--adversarial"])
    assert args.stock and args.adversarial
    assert soak.main(args) == 2
    assert "--stock cannot be combined with --adversarial" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--stock cannot be combined with --adversarial"):
        soak.run(1, 4.0, 1, True, 5.0, stock=True)
    args = build_parser().parse_args(["bench", "soak", "--minutes", "1", "--stock"])
    assert args.stock and not args.adversarial
