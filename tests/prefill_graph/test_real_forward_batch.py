"""The prefill-graph decision against the REAL forward batch (issue 22 items 1 and 3).

Everything below runs through :class:`dspark_harden.prefill_graph.world.World` in a subprocess
(``_world_driver``): real ``Req`` / ``ScheduleBatch`` (stock ``prepare_for_extend`` /
``prepare_for_decode`` / ``mix_with_running`` / ``prepare_for_idle``) over real pools and a real
``RadixCache``; per rank stock ``prepare_mlp_sync_batch_raw`` (vote, ``MLPSyncBatchInfo``, stock
``all_gather`` over an in-process two-party exchange, ``_update_gather_batch``), stock
``maybe_convert_decode_to_extend``, stock ``ForwardBatch.init_new`` with the worker's capture mode,
stock ``ModelRunner._prepare_eager_forward_batch`` -> ``prepare_mlp_sync_batch``, and stock
``_forward_raw``'s prefill-graph condition compiled from its source. Stand-ins (named in the
world module's docstring): the model runner's attributes, the cross-rank transport, a decode row's
next token, and the prefill-graph runner's capture state (real class, no GPU).

Configurations: the full backend (DeepSeek-V4 hooks) without speculative decoding, the breakable
backend (decoding peers converted to extends), DSpark (its worker passes FULL), and a server with
``--return-hidden-states-mode last``.

What could make these fail: a view field that differs from the real ForwardBatch after
``init_new`` or after ``prepare_mlp_sync_batch`` (the probe forces a graph verdict on every step so
every view is compared), a forward-time check the view predicts differently, a guard raise or a
split on the harden side, stock no longer splitting on its own path, or a mutation below no longer
being detected.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.harness import warm

pytestmark = pytest.mark.timeout(1800)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ("full", "breakable", "dspark", "server_hidden_last")


@pytest.fixture(scope="module")
def report():
    from tests.prefill_graph import _world_driver as drv

    proc = warm.run(  # forked from the warm interpreter: SGLang already imported (tests/harness/warm.py)
        [sys.executable, "-m", "tests.prefill_graph._world_driver", "--steps", "120", "--mutation-steps", "40"],
        cwd=ROOT,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(rep["configs"]) == set(CONFIGS) and set(rep["mutations"]) == set(drv.MUTATIONS)
    return rep


@pytest.mark.parametrize("config", CONFIGS)
def test_views_match_the_real_forward_batch(report, config):
    """Field for field after init_new and after prepare_mlp_sync_batch, the chunked-prefix variant,
    and the named forward-time checks, for every rank of every step (graph verdict forced)."""
    probe = report["configs"][config]["probe"]
    assert probe["steps_with_differences"] == 0, json.dumps(probe["examples"], indent=1)[:6000]


@pytest.mark.parametrize("config", CONFIGS)
def test_the_comparison_is_not_vacuous(report, config):
    feat = report["configs"][config]["probe"]["features"]
    for key in (
        "forward_batches",
        "mode_extend",
        "mode_idle",
        "idle_dummy_extend",
        "input_embeds",
        "replace_embeds",
        "mm_inputs",
        "return_logprob",
        "cached_prefix",
        "decode_converted_to_extend",
    ):
        assert feat.get(key, 0) > 0, (key, feat)
    if config == "dspark":
        assert feat["capture_full"] == feat["forward_batches"]  # the worker's FULL on every prefill and idle rank
        assert feat.get("token_indices_to_pool", 0) == 0  # speculative: no request is prefill-only
        assert feat.get("mode_mixed", 0) == 0  # speculative_hook disables mixed chunks
    else:
        assert feat.get("capture_full", 0) > 0 and feat.get("token_indices_to_pool", 0) > 0
        assert feat.get("mode_mixed", 0) > 0
    if config == "server_hidden_last":
        assert feat.get("capture_last", 0) > 0
    # the view reads batch.spec_info (stock get_required_capture_hidden_mode); no modelled worker
    # hands a prefill batch a speculative input, so this input is unreachable in every configuration
    assert feat.get("spec_info", 0) == 0


@pytest.mark.parametrize("config", CONFIGS)
def test_harden_never_splits_on_real_forward_batches(report, config):
    harden = report["configs"][config]["harden"]
    assert harden["raised"] == {} and harden["splits"] == 0, json.dumps(harden["examples"], indent=1)[:6000]
    assert harden["graph_steps"] > report["configs"][config]["steps"] // 5  # most steps can replay


@pytest.mark.parametrize("config", ("full", "breakable", "server_hidden_last"))
def test_stock_splits_on_its_own_path(report, config):
    """Documents the bug on stock's own code: the min-reduced vote says graph, one rank's
    forward-time check (capture mode, pooling readout, ...) sends it eager alone."""
    assert report["configs"][config]["stock"]["splits"] > 0


def test_stock_does_not_split_under_dspark(report):
    """DSpark's worker passes FULL and its target runner captures FULL, and no DSpark request is
    prefill-only: the two splitting checks cannot fire (a count that shows the config differs)."""
    assert report["configs"]["dspark"]["stock"]["splits"] == 0


@pytest.mark.parametrize("name", sorted(__import__("tests.prefill_graph._world_driver", fromlist=["x"]).MUTATIONS))
def test_mutation_of_the_view_is_caught(report, name):
    """Each mutation ignores one input the view (or the vote's check list) reads; the probe's field
    comparison or the harden side's split / guard counts must see it (docs/prefill_graph.md lists
    which one caught each)."""
    rep = report["mutations"][name]
    caught = {
        cfg: r
        for cfg, r in rep["configs"].items()
        if r["probe_steps_with_differences"] or r["harden_splits"] or r["harden_raised"]
    }
    assert caught, rep
