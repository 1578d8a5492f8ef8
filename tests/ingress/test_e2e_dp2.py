"""End to end on a real SGLang server: tiny DeepseekV3, ``--dp-size 2 --tp-size 2
--enable-dp-attention``, plugin active (tests/harness). The run's shared DP2 server (``dp2_server``,
tests/harness/shared.py): it records /health_scheduler's answers while it starts, and this module's last
test shuts it down (observing /health_scheduler while it drains) after every other user of it ran
(``shared_order``).

The shared server runs stock /health in its liveness-only mode (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``:
stock /health answers without an inference request, the configuration in which stock cannot see a
stopped scheduler; with the 0.5.23 default (1) /health runs a one-token request that hangs behind the
stopped rank and after its timeout marks the whole server UnHealthy without naming a rank) and a
/health_scheduler staleness of ``DP2_SHARED_STALENESS_S``, which bounds the SIGSTOP test's wait.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.harness.shared import DP2_SHARED_STALENESS_S as STALENESS_S

pytestmark = pytest.mark.server


@pytest.fixture
def server(dp2_server):
    return dp2_server


def _health(server, timeout=10.0):
    r = requests.get(server.url + "/health_scheduler", timeout=timeout)
    return r.status_code, r.json()


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_health_scheduler_503_while_starting_then_200(server):
    answers = server.startup_answers
    assert (503, "starting") in answers, answers
    assert answers[-1][0] == 200
    code, body = _health(server)
    assert code == 200 and body["status"] == "ok"
    assert body["expected_dp_ranks"] == 2 and set(body["ranks"]) == {"0", "1"}


def test_plugin_bound_in_every_role_and_controller_loop_blocks(server):
    # (the main process binds before SGLang configures logging, so its INFO line is not printed;
    # /health_scheduler answering proves the main-role binding)
    roles = server.plugin_roles()
    assert {"controller", "scheduler", "detokenizer"} <= set(roles), roles
    assert roles.count("scheduler") == 2
    assert "DP controller event loop blocks on its socket" in server.log_text()


def test_routed_batch_of_64_reaches_scheduler_1_as_one_message(server, tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    prompts = [f"def f{i}(x):\n    return " + "x + " * (i % 7) + str(i) for i in range(64)]
    before = server.metrics_text()
    r = server.post(
        "/generate",
        {
            "text": prompts,
            "routed_dp_rank": 1,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text[:2000]
    outs = r.json()
    assert len(outs) == 64
    after = server.metrics_text()

    # observed where it arrives: scheduler DP1 got exactly ONE batch message holding 64 requests
    delta = lambda name, **lb: _metric(after, name, **lb) - _metric(before, name, **lb)  # noqa: E731
    assert delta("dspark_harden_scheduler_batch_messages_total", dp_rank="1") == 1
    assert delta("dspark_harden_scheduler_batch_message_requests_sum", dp_rank="1") == 64
    assert delta("dspark_harden_scheduler_batch_messages_total", dp_rank="0") == 0
    assert delta("dspark_harden_atomic_batches_total", dp_rank="1") == 1
    assert delta("dspark_harden_atomic_batch_requests_sum", dp_rank="1") == 64

    for prompt, out in zip(prompts, outs):
        meta = out["meta_info"]
        assert meta["dp_rank"] == 1
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 3
        # each answer belongs to its own prompt
        assert meta["prompt_tokens"] == len(tok(prompt)["input_ids"]), (prompt, meta)
        # per-request timing metadata survived the batch path
        for key in ("request_received_ts", "api_server_dispatch_finish_ts", "queue_time", "e2e_latency"):
            assert key in meta, (key, sorted(meta))
        assert meta["request_received_ts"] > 0 and meta["e2e_latency"] > 0 and meta["queue_time"] >= 0


def test_unrouted_batch_is_dispatched_per_request(server):
    before = server.metrics_text()
    r = server.post(
        "/generate",
        {
            "text": [f"# item {i}\n" for i in range(8)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text[:2000]
    outs = r.json()
    assert len(outs) == 8 and all(o["meta_info"]["completion_tokens"] == 2 for o in outs)
    after = server.metrics_text()
    for rank in ("0", "1"):
        assert _metric(after, "dspark_harden_scheduler_batch_messages_total", dp_rank=rank) == _metric(
            before, "dspark_harden_scheduler_batch_messages_total", dp_rank=rank
        )
    assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}  # load balanced, item by item


def test_batch_routed_to_rank_7_is_a_clear_error_and_server_keeps_serving(server):
    r = server.post(
        "/generate",
        {
            "text": ["a", "b", "c"],
            "routed_dp_rank": 7,
            "sampling_params": {"max_new_tokens": 2},
        },
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert "routed_dp_rank=7 out of range [0, 2)" in r.text
    out = server.generate("def ok():", max_new_tokens=2, routed_dp_rank=0)
    assert out["meta_info"]["dp_rank"] == 0
    assert _health(server)[0] == 200


def test_sigstopped_scheduler_turns_health_scheduler_503_naming_it(server):
    assert _health(server)[0] == 200
    pid = server.process_titled("sglang::scheduler_DP1_")
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # staleness threshold + one idle publish period (1 s) + slack for a loaded 2-core machine
        deadline = t0 + STALENESS_S + 1.0 + 20.0
        code, body = _health(server)
        while code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            code, body = _health(server)
        assert code == 503, body
        assert body["reason"] == "stale" and 1 in body["bad_ranks"], body
        assert "DP rank 1" in body["message"] or "DP ranks" in body["message"]
        # stock /health (no generation by default) still says 200 about the same server
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while _health(server)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _health(server)[0] == 200


@pytest.mark.shared_order(1)  # last user of the shared server: it shuts the server down
def test_zz_health_scheduler_503_while_shutting_down(server):
    os.kill(server.pid, signal.SIGTERM)
    answers = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            code, body = _health(server, timeout=5)
            answers.append((code, body.get("reason")))
            if code == 503 and body.get("reason") == "shutting_down":
                break
        except (requests.RequestException, ValueError):
            if server.proc.poll() is not None:
                break
        time.sleep(0.1)
    assert (503, "shutting_down") in answers, answers
    assert server.wait_exit(120) is not None
