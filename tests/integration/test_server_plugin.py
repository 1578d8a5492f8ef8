"""A real SGLang 0.5.23 server on CPU with the plugin active (issue 2: platform end to end).

Stand-ins (cpu-e2e.md): the tiny random-weight DeepseekV3 (MLA + MoE) model instead of DeepSeek V4,
and the test-only ``dspark_test_cpu`` platform instead of a GPU. Everything else is stock:
``python -m sglang.launch_server --dp-size 2 --tp-size 2 --enable-dp-attention``, real ZMQ, gloo,
xgrammar, HTTP.

The DP2 server is the shared ``dp2_server`` fixture (started once per run, see
tests/harness/shared.py); the refusal tests start servers that must die during startup (the
main process refuses before any scheduler is spawned, so they are cheap).
"""

from __future__ import annotations

import collections
import json

import pytest

from tests.harness import ServerConfig, start_expect_failure

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

# Processes of --dp-size 2 --tp-size 2 --enable-dp-attention: the launcher (tokenizer manager +
# HTTP), one DP controller, one scheduler per TP rank (each is one DP-attention rank), one detokenizer.
DP2_ROLES = {"main": 1, "controller": 1, "scheduler": 2, "detokenizer": 1}

BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3]},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


def assert_plugin_in_every_role(server) -> None:
    """One 'dspark-harden ... active in <role> process' line per process of a DP2 server (shared by every
    launch path's test)."""
    roles = collections.Counter(server.plugin_roles())
    assert dict(roles) == DP2_ROLES, (
        f"expected one 'dspark-harden ... active in <role> process' line per process {DP2_ROLES}, "
        f"found {dict(roles)}\n{server.log_tail(8000)}"
    )


def test_plugin_active_in_every_process_role(dp2_server):
    assert_plugin_in_every_role(dp2_server)


def test_plain_generate(dp2_server):
    out = dp2_server.generate("def main():", max_new_tokens=8)
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert 1 <= out["meta_info"]["completion_tokens"] <= 8
    assert isinstance(out["text"], str)
    assert out["meta_info"]["dp_rank"] in (0, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_routed_dp_rank_reaches_that_rank(dp2_server, rank):
    for prompt in ("import os\n", "class Foo:"):
        out = dp2_server.generate(prompt, max_new_tokens=4, routed_dp_rank=rank)
        assert out["meta_info"]["dp_rank"] == rank, out["meta_info"]


def test_routed_dp_rank_out_of_range_is_rejected(dp2_server):
    r = dp2_server.post(
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 2},
        timeout=60,
    )
    assert r.status_code == 400, (r.status_code, r.text[:500])


def answer_bounded_json(server, rank: int) -> dict:
    """A BOUNDED_SCHEMA request routed to DP rank ``rank``; asserts the answer finished, came from that
    rank and is JSON of the schema (shared by every launch path's test)."""
    out = server.generate(
        "Answer in JSON:",
        max_new_tokens=64,
        routed_dp_rank=rank,
        sampling_params={"json_schema": json.dumps(BOUNDED_SCHEMA)},
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]["finish_reason"]
    assert out["meta_info"]["dp_rank"] == rank, out["meta_info"]
    value = json.loads(out["text"])
    assert set(value) == {"ok", "color", "size"}
    assert isinstance(value["ok"], bool)
    assert value["color"] in ("red", "green", "blue")
    assert value["size"] in (1, 2, 3)
    return value


@pytest.mark.parametrize("rank", [0, 1])
def test_json_schema_constrained_output_parses_and_matches(dp2_server, rank):
    answer_bounded_json(dp2_server, rank)


def test_server_metrics_carry_dp_rank(dp2_server):
    text = dp2_server.metrics_text()
    assert "sglang:" in text
    assert 'dp_rank="0"' in text and 'dp_rank="1"' in text


# --- refusal: a deliberately broken patch must stop the real server -----------------------------

_TARGET = "sglang.srt.sampling.sampling_params:SamplingParams.verify"
_MISSING = "sglang.srt.sampling.sampling_params:SamplingParams.dspark_testfeature_no_such_method"

BREAKS = {
    # mode: strings the refusal message must contain
    "drift": [_TARGET, "expected fingerprint 0000000000000000", "found 269829a259903b0a"],
    "missing": [_MISSING, "does not exist"],
    "replaced": [_TARGET, "replaced by another plugin"],
}


@pytest.mark.parametrize("mode", sorted(BREAKS))
def test_server_refuses_to_start_with_broken_patch(mode):
    config = ServerConfig(
        arch="qwen3",
        name=f"broken-{mode}",
        env=(("DSPARK_TESTFEATURE", "1"), ("DSPARK_TESTFEATURE_BREAK", mode)),
    )
    rc, log = start_expect_failure(config, timeout=600)
    assert rc != 0, log[-5000:]
    assert "dspark-harden refuses to start (main process" in log, log[-5000:]
    for needle in BREAKS[mode]:
        assert needle in log, f"refusal log lacks {needle!r}:\n{log[-5000:]}"
    assert "is ready" not in log and "fired up and ready" not in log
