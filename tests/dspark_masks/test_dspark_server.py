"""A real DSpark server with the plugin (issue 23): ``python -m sglang.launch_server
--speculative-algorithm DSPARK`` on the CPU test platform, tiny Qwen3 target + tiny random DSpark
draft (``ensure_dspark_draft``, built before the shared server starts), ``--dp-size 2 --tp-size 2 --enable-dp-attention --enable-dp-lm-head``,
``DSPARK_HARDEN_DSPARK_MASKS=1``, ``DSPARK_HARDEN_DSPARK_RESULTS=1`` and ``DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1`` (shared fixture
``dspark_dp2_server``, one start per run).

Every decode step runs the real ``DSparkWorkerV2`` (draft block forward, target verify) and every
grammar verify step builds its draft mask through the plugin's native traversal; the CPU platform
provides the CPU forms of the CUDA-only pieces (docs/testing.md, "DSpark on the CPU platform").
The draft's weights are random, so almost no draft token is accepted: the test checks that the
masked path runs and that constrained outputs are valid, not acceptance. Not compared with the
feature disabled here (a second server start); the masks' bit-identity to stock is covered by
tests/dspark_masks/test_traversal_differential.py and test_integration.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe)"
STEPS = re.compile(r'^dspark_harden_dspark_mask_steps_total\{dp_rank="(\d)",outcome="(\w+)"\} ([0-9.e+]+)$', re.M)
RESULTS = re.compile(r'^dspark_harden_dspark_results_total\{dp_rank="(\d)",outcome="(\w+)"\} ([0-9.e+]+)$', re.M)
DRAFT = re.compile(
    r"^dspark_harden_dspark_(draft_masked_tokens_total|draft_blocks_cut_total|accept_length_count|accept_length_sum)"
    r'\{dp_rank="(\d)"(?:,kind="(\w+)")?\} ([0-9.e+]+)$',
    re.M,
)
ENGINE = re.compile(r'^dspark_harden_dspark_mask_engine\{dp_rank="(\d)",engine="(\w+)"\} ([0-9.e+]+)$', re.M)


def _steps(server) -> dict:
    return {(rank, outcome): float(v) for rank, outcome, v in STEPS.findall(server.metrics_text())}


def test_plugin_active_and_native_engine_on_both_ranks(dspark_dp2_server):
    log = dspark_dp2_server.log_text()
    roles = dspark_dp2_server.plugin_roles()
    assert roles.count("scheduler") == 2, (roles, dspark_dp2_server.log_tail(4000))
    engines = {(r, e): float(v) for r, e, v in ENGINE.findall(dspark_dp2_server.metrics_text())}
    assert engines.get(("0", "native")) == 1.0 and engines.get(("1", "native")) == 1.0, engines
    # with the feature on, the stock-path warning of the disabled feature is not logged
    assert "traverse_tree" not in log


@pytest.mark.parametrize("rank", [0, 1])
def test_constrained_requests_validate_and_every_verify_step_is_masked_natively(dspark_dp2_server, rank):
    r = str(rank)
    before = _steps(dspark_dp2_server)
    plain = dspark_dp2_server.generate("def main():", max_new_tokens=8, routed_dp_rank=rank)
    assert plain["meta_info"]["spec_verify_ct"] > 0, plain["meta_info"]  # the DSpark decode ran
    after_plain = _steps(dspark_dp2_server)
    assert after_plain.get((r, "masked")) == before.get((r, "masked")), "an unconstrained request counted mask steps"

    out_re = dspark_dp2_server.generate(
        "Answer:", max_new_tokens=16, routed_dp_rank=rank, sampling_params={"regex": REGEX}
    )
    assert re.fullmatch(REGEX, out_re["text"]), out_re["text"]
    out_js = dspark_dp2_server.generate(
        "Answer in JSON:", max_new_tokens=64, routed_dp_rank=rank, sampling_params={"json_schema": json.dumps(SCHEMA)}
    )
    assert out_js["meta_info"]["finish_reason"]["type"] == "stop", out_js["meta_info"]["finish_reason"]
    jsonschema.validate(json.loads(out_js["text"]), SCHEMA)
    for out in (out_re, out_js):
        assert out["meta_info"]["dp_rank"] == rank, out["meta_info"]

    after = _steps(dspark_dp2_server)
    masked = after[(r, "masked")] - after_plain.get((r, "masked"), 0.0)
    verify_steps = sum(o["meta_info"]["spec_verify_ct"] for o in (out_re, out_js))
    # each committed verify step of a grammar request went through the plugin's masked path (an
    # overlapped step still in flight when a request finishes is masked but not committed)
    assert verify_steps > 0 and masked >= verify_steps, (masked, verify_steps, after)
    other = str(1 - rank)
    assert after.get((other, "masked")) == after_plain.get((other, "masked")), "steps counted on the other rank"
    assert after[(r, "thinking_only")] == after_plain.get((r, "thinking_only"))


@pytest.mark.parametrize("rank", [0, 1])
def test_every_decode_step_is_read_from_a_materialized_record(dspark_dp2_server, rank):
    """The DSpark result materializer end to end (issue 24) on the real DSpark server with overlap
    scheduling: every verify step of a request on this rank was materialized (by the background thread,
    or converted by the consumer that got there first) and read by stock's consumers from its record --
    a step without one would have stopped the server (``record_of``); no step failed, timed out, lost its
    thread or carried another step's record; the same greedy constrained request twice gives the same
    text. (Before the copy wrapper decided from the result instead of the batch's forward mode, this
    server stopped at its warm-up request: stock copies while DSpark's verify has the batch in
    TARGET_VERIFY.)"""
    r = str(rank)

    def counts() -> dict:
        return {(k, o): float(v) for k, o, v in RESULTS.findall(dspark_dp2_server.metrics_text())}

    before = counts()
    outs = [
        dspark_dp2_server.generate(
            "Answer yes, no or maybe:", max_new_tokens=12, routed_dp_rank=rank, sampling_params={"regex": REGEX}
        )
        for _ in range(2)
    ]
    after = counts()
    assert outs[0]["text"] == outs[1]["text"] and re.fullmatch(REGEX, outs[0]["text"]), [o["text"] for o in outs]
    verify_steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    done = sum(after.get((r, o), 0.0) - before.get((r, o), 0.0) for o in ("materialized", "converted_by_consumer"))
    assert verify_steps > 0 and done >= verify_steps, (done, verify_steps, after)
    bad = {(k, o): v for (k, o), v in after.items() if o not in ("materialized", "converted_by_consumer") and v}
    assert not bad, bad
    # the scheduler processes' GIL switch interval, set once per process with its first materializer
    # (DSPARK_HARDEN_DSPARK_RESULTS_SWITCH_INTERVAL_US, default 200)
    switched = dspark_dp2_server.log_text().count("GIL switch interval 5000 µs -> 200 µs")
    assert 1 <= switched <= 2, switched


@pytest.mark.parametrize("rank", [0, 1])
def test_draft_masks_make_the_grammar_forced_positions_of_a_random_draft_accepted(dspark_dp2_server, rank):
    """Grammar-aware drafting (issue 43) on the real server. The draft's weights are random: a free
    request commits about one token per verify step (the bonus), and so would a constrained one with only
    the verify masked. With the draft masked, every position the grammar forces (the schema's keys,
    quotes, braces) is drafted as the one token allowed there, and the target, masked the same way,
    accepts it: the JSON request commits clearly more than one token per verify step. Its rank counts
    the masked draft positions and the accept lengths by kind; the other rank counts none of it. Fails
    if the draft is not masked (the JSON request's ratio falls to the free request's), or the counters
    miss or mislabel the rank."""
    r, other = str(rank), str(1 - rank)

    def snap() -> dict:
        return {(n, k, kind or ""): float(v) for n, k, kind, v in DRAFT.findall(dspark_dp2_server.metrics_text())}

    before = snap()
    free = dspark_dp2_server.generate("Once upon a time", max_new_tokens=24, routed_dp_rank=rank)
    mid = snap()
    js = dspark_dp2_server.generate(
        "Answer in JSON:", max_new_tokens=64, routed_dp_rank=rank, sampling_params={"json_schema": json.dumps(SCHEMA)}
    )
    after = snap()
    jsonschema.validate(json.loads(js["text"]), SCHEMA)

    def per_step(out):
        m = out["meta_info"]
        return m["completion_tokens"] / m["spec_verify_ct"]

    assert per_step(free) < 1.3, free["meta_info"]
    assert per_step(js) >= 1.5, (per_step(js), js["meta_info"], js["text"])

    def delta(a, b, name, rank_label, kind=""):
        return b.get((name, rank_label, kind), 0.0) - a.get((name, rank_label, kind), 0.0)

    assert delta(before, mid, "draft_masked_tokens_total", r) == 0, "a free request's draft was masked"
    assert delta(before, mid, "accept_length_count", r, "free") >= 1
    assert delta(mid, after, "draft_masked_tokens_total", r) >= js["meta_info"]["spec_verify_ct"]
    assert delta(mid, after, "accept_length_count", r, "constrained") >= 1
    assert delta(mid, after, "accept_length_sum", r, "constrained") > delta(
        mid, after, "accept_length_count", r, "constrained"
    )
    for name, kind in (("draft_masked_tokens_total", ""), ("accept_length_count", "constrained")):
        assert delta(before, after, name, other, kind) == 0, (name, "counted on the other rank")
