"""Crafted DP2 pairs through the real objects: one per forward-time check, the padding rule, the
breakable backend's decoding peer and DSpark's worker capture mode.

Each pair runs (in a subprocess, ``_world_driver --crafted``) through
``dspark_harden.prefill_graph.world.World``: real ScheduleBatches, stock
``prepare_mlp_sync_batch_raw`` on both ranks, stock ``ForwardBatch.init_new`` /
``prepare_mlp_sync_batch``, and whether a rank replays is stock ``_forward_raw``'s condition (see
that module's docstring for the stand-ins). The randomized differential test and the mutation
checks are in test_real_forward_batch.py.

What could make these fail: stock no longer splitting on a pair (its forward-time check moved into
its vote: then the check belongs to CONSISTENT), the harden side splitting, raising, or naming a
different check than the one the pair exercises, or the shared bucket changing.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.harness import warm

pytestmark = pytest.mark.timeout(900)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def crafted():
    proc = warm.run(  # forked from the warm interpreter: SGLang already imported (tests/harness/warm.py)
        [sys.executable, "-m", "tests.prefill_graph._world_driver", "--crafted"], cwd=ROOT, timeout=850
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["crafted"]


def _names(prefix):
    from tests.prefill_graph._world_driver import crafted_pairs

    return sorted(n for n in crafted_pairs() if n.startswith(prefix))


@pytest.mark.parametrize("name", _names("split/"))
def test_crafted_pair_stock_splits_harden_agrees(crafted, name):
    rec = crafted[name]
    check = name.split("/")[1]
    stock, harden = rec["stock"], rec["harden"]
    assert stock["verdict"] == [True, True], stock  # stock's min-reduced vote said graph ...
    assert stock["replays"][0] != stock["replays"][1], (
        f"stock no longer splits on {name}: {stock}"
    )  # ... one rank ran eager
    assert harden["replays"] == [False, False] and harden["raised"] == [None, None], harden
    if check in ("max_context", "backend_hook"):
        # only the idle rank's dummy extend (seq_len = bucket 3072 > 3000) fails: decided after the exchange
        assert harden["decision"][0] == harden["decision"][1] == [False, None, "idle_participant"], harden
    else:
        assert check in harden["reasons"], harden  # the rank whose check fails names it (metrics reason)
        assert harden["decision"][0] == harden["decision"][1] == [False, None, "peer_vote"], harden


@pytest.mark.parametrize("name", _names("consistent/"))
def test_crafted_pair_checks_the_stock_vote_already_covers(crafted, name):
    rec = crafted[name]
    check = name.split("/")[1]
    assert rec["stock"]["replays"] == [False, False], rec["stock"]
    assert rec["harden"]["replays"] == [False, False] and rec["harden"]["raised"] == [None, None], rec["harden"]
    assert check in rec["harden"]["reasons"], rec["harden"]


def test_padding_is_judged_on_the_shared_bucket(crafted):
    # 1 token per rank: bucket 4 is > 2 x 1, stock's local bound refuses; 4 <= 4 x 1 on the global max
    one = crafted["padding/one_token_each"]
    assert one["stock"]["replays"] == [False, False] and one["harden"]["replays"] == [True, True]
    assert one["harden"]["executed"] == [4, 4]
    # a tiny rank next to a large one replays the large one's bucket on both ranks
    tiny = crafted["padding/tiny_next_to_large"]
    assert tiny["harden"]["replays"] == [True, True] and tiny["harden"]["executed"] == [5120, 5120]
    # sparse buckets and f=2: 4096 > 2 x 1000 -> eager on both ranks, reason "padding" on both
    sparse = crafted["padding/sparse_buckets_f2"]
    assert sparse["harden"]["replays"] == [False, False]
    assert sparse["harden"]["decision"][0] == sparse["harden"]["decision"][1] == [False, None, "padding"]


def test_breakable_decoding_peer_is_converted_and_replays(crafted):
    rec = crafted["breakable/decoding_peer"]
    assert rec["stock"]["replays"] == [True, True] and rec["harden"]["replays"] == [True, True]
    assert rec["harden"]["executed"] == [640, 640]  # the decode rows' 3 tokens ride the extend's bucket
    # a hidden-state request on the prefilling rank: stock replays the converted decode rank alone
    hid = crafted["breakable/decoding_peer_hidden"]
    assert hid["stock"]["replays"] == [True, False]
    assert hid["harden"]["replays"] == [False, False] and "capture_hidden_mode" in hid["harden"]["reasons"]


@pytest.mark.parametrize("name", _names("dspark/"))
def test_dspark_worker_capture_mode_admits_hidden_and_pool_requests(crafted, name):
    """DSpark's worker passes FULL to init_new and its target runner captures FULL; under
    speculative decoding no request is prefill-only (no token_indices_to_pool): both replay."""
    rec = crafted[name]
    assert rec["stock"]["replays"] == [True, True] and rec["harden"]["replays"] == [True, True]
