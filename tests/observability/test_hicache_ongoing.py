"""HiCache transfers in flight and the ``check_hicache_events`` phase, exact values, on the REAL HiCache
stack with CPU tensors (the stack of tests/lifecycle/test_hicache_gate_real_tree.py: stock
``UnifiedRadixCache`` + ``init_hicache`` + ``HybridCacheController`` + ``MHATokenToKVPoolHost``; the one
kernel op and the pinning are substituted as described there), in a fresh interpreter: the real binder
binds the scheduler-phase patches on the real classes, the values go through the real prometheus_client
multiprocess files and are read back by a real ``MultiProcessCollector``.

Storage (L3) is not configurable on CPU here, so ``backup`` and ``prefetch`` are shown at their
pre-created 0 by the stack, and their counting is checked on a real tree whose ``ongoing_backup`` /
``ongoing_prefetch`` maps are given entries of stock's own ``_OngoingPrefetch`` type.
"""

from __future__ import annotations

from ..plugin._proc import run_py

_CHILD = """
import os
from types import SimpleNamespace
import pluggy
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families
from dspark_harden import entry
from dspark_harden.core import binder, hookspecs, roles
from dspark_harden.core.patch import Role
from dspark_harden.core.roles import ProcessContext
from dspark_harden.observability import feature as obs, phases
from dspark_harden.observability.hicache import SAMPLER
from tests.lifecycle import test_hicache_gate_real_tree as T

args = SimpleNamespace(enable_metrics=True, tp_size=2, dp_size=2, enable_dp_attention=True)
roles.CONTEXT = ProcessContext(role=Role.SCHEDULER, server_args=args, tp_rank=1, dp_rank=1)
pm = pluggy.PluginManager(hookspecs.PROJECT)
pm.add_hookspecs(hookspecs)
pm.register(obs)
report = binder.bind(Role.SCHEDULER, pm=pm, environ={"DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S": "3600"})
assert report.ok, report
binder.STATE.pm = pm
entry._notify_bound(Role.SCHEDULER, report)
rec = phases.recorder()
assert rec.dp_label == "1" and SAMPLER in rec.samplers

def scrape():
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if s.name.startswith(("dspark_harden_hicache_ongoing", "dspark_harden_scheduler_phase_calls")):
                key = s.labels.get("kind") or s.labels.get("phase")
                out[f"{s.name}|{s.labels['dp_rank']}|{key}"] = s.value
    return out

def snap(tag):
    rec.flush()
    got = scrape()
    steps[tag] = {k.split("|", 1)[0].rsplit("_", 1)[-1] + ":" + k.rsplit("|", 1)[1]: v
                  for k, v in got.items() if k.startswith("dspark_harden_hicache_ongoing") and k.split("|")[1] == "1"}
    steps[tag]["poll_calls"] = got.get("dspark_harden_scheduler_phase_calls_total|1|check_hicache_events")

steps = {}
snap("precreated")  # no tree polled yet: the pre-created zeros
tree, kv, alloc = T._build("write_through")
tree.check_hicache_events()  # the wrapped poll: this scheduler's tree is now watched
snap("empty")
T._insert(tree, kv, alloc)  # write_through: each insert queues a device->host backup (A 16, B 12, C 12)
snap("written")
tree.check_hicache_events()  # the poll acknowledges them (CPU copies are synchronous)
snap("settled")
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
assert tree.evict(EvictParams(num_tokens=40)).num_tokens_evicted == 40  # all host-only now
m = T._match(tree, "A")
assert tree.load_back(m.best_match_node)  # one host->device load of A's 16 tokens, queued
snap("loading")
tree.ready_to_load_host_cache()
snap("submitted")  # submitted, not yet acknowledged
tree.check_hicache_events()
snap("loaded")

# backup / prefetch counting on the real tree's own maps (storage does not run on CPU)
import torch
from sglang.srt.mem_cache.unified_radix_cache import _OngoingPrefetch
tree.ongoing_backup[7] = (1, None)
tree.ongoing_backup[8] = (2, None)
tree.ongoing_prefetch["r1"] = _OngoingPrefetch(1, None, torch.arange(24), None, None, {})
snap("storage")
emit(steps)
"""


def _z(**over):
    base = {
        "operations:write_through": 0,
        "operations:load_back": 0,
        "operations:backup": 0,
        "operations:prefetch": 0,
        "tokens:write_through": 0,
        "tokens:load_back": 0,
        "tokens:prefetch": 0,
    }
    base.update(over)
    return base


def test_in_flight_transfers_and_the_poll_phase_exact_on_the_real_stack(tmp_path):
    rc, steps, out = run_py(_CHILD, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert rc == 0 and steps, out[-4000:]
    calls = {tag: s.pop("poll_calls") for tag, s in steps.items()}
    assert calls == {
        "precreated": 0,
        "empty": 1,
        "written": 1,
        "settled": 2,
        "loading": 2,
        "submitted": 2,
        "loaded": 3,
        "storage": 3,
    }
    assert steps["precreated"] == _z()
    assert steps["empty"] == _z()
    assert steps["written"] == _z(**{"operations:write_through": 3, "tokens:write_through": 40})
    assert steps["settled"] == _z()
    assert steps["loading"] == _z(**{"operations:load_back": 1, "tokens:load_back": 16})
    assert steps["submitted"] == _z(**{"operations:load_back": 1, "tokens:load_back": 16})
    assert steps["loaded"] == _z()
    assert steps["storage"] == _z(**{"operations:backup": 2, "operations:prefetch": 1, "tokens:prefetch": 24})
