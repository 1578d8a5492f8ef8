"""Host-pool teardown isolation, the HiCache gate and strict VMM against the real SGLang classes.

* teardown: a real ``HostPoolGroup`` of real ``LogicalHostPool`` entries (CPU); the first pool's
  ``destroy`` raises (a subclass: the stand-in for a pool whose teardown fails, which cannot be
  provoked in a real pinned pool without CUDA). Stock skips the others; ours destroys them all and
  names the failed pool.
* gate: ``--enable-hierarchical-cache`` does not run on this CPU harness (see docs/lifecycle.md:
  the host reserve, pinned host pools, CUDA-only copy ops). The gate's real effects are tested on a
  real ``UnifiedRadixCache`` + HiCache stack with CPU tensors in test_hicache_gate_real_tree.py;
  here it runs through the real ``SchedulerInternalStateController.set_internal_state`` with our
  wrap on a stand-in tree that records the ``UnifiedRadixCache`` API surface the gate uses
  (``cache_controller`` with ``write_policy``, ``writing_check``, ``evictable_size``,
  ``evict(EvictParams)``, ``is_write_back``), for the exact call order and the cases the real tree
  does not cover (unarmed, bad values, key not alone, nothing evicted).
* strict VMM: ``CudaVmmMemoryPool.__init__`` calls the CUDA driver first thing; without CUDA the
  wrap's decision is tested with a stand-in for the stock initializer, and the patch binds against
  the real class (test_lifecycle_units.py).
"""

from __future__ import annotations

import pytest

from dspark_harden.lifecycle import hicache_gate as G
from dspark_harden.lifecycle import hostpool, vmm

# -- host-pool teardown -------------------------------------------------------------------------


def _group(calls: list):
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    class FailingPool(LogicalHostPool):
        def destroy(self):
            calls.append("kv")
            raise RuntimeError("cudaHostUnregister failed: invalid argument")

    class Recorded(LogicalHostPool):
        def __init__(self, name, *a, **kw):
            super().__init__(*a, **kw)
            self._name = name

        def destroy(self):
            calls.append(self._name)
            return super().destroy()

    entries = [
        PoolEntry(
            name=PoolName.KV,
            host_pool=FailingPool(64, 16),
            device_pool=None,
            layer_mapper=lambda i: i,
            is_primary_index_anchor=True,
        ),
        PoolEntry(name=PoolName.SWA, host_pool=Recorded("swa", 64, 16), device_pool=None, layer_mapper=lambda i: i),
        PoolEntry(
            name=PoolName.INDEXER, host_pool=Recorded("indexer", 64, 16), device_pool=None, layer_mapper=lambda i: i
        ),
    ]
    return HostPoolGroup(entries)


def test_stock_destroy_skips_the_pools_after_a_failure():
    calls: list = []
    group = _group(calls)
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        group.destroy()  # stock
    assert calls == ["kv"], "stock 0.5.23 changed: it no longer stops at the first failing pool"


def test_isolated_destroy_runs_every_pool_and_names_the_failure():
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup

    calls: list = []
    group = _group(calls)
    destroy = hostpool.build_destroy(HostPoolGroup.destroy)
    with pytest.raises(hostpool.HostPoolTeardownError) as info:
        destroy(group)
    assert calls == ["kv", "swa", "indexer"]
    assert info.value.failures[0][0] == "kv"
    assert "pool 'kv': RuntimeError: cudaHostUnregister failed" in str(info.value)
    assert "1 of 3 host pool(s)" in str(info.value)


def test_isolated_destroy_is_silent_when_all_succeed():
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    group = HostPoolGroup(
        [PoolEntry(name=PoolName.KV, host_pool=LogicalHostPool(32, 16), device_pool=None, layer_mapper=lambda i: i)]
    )
    hostpool.build_destroy(HostPoolGroup.destroy)(group)


# -- HiCache gate -------------------------------------------------------------------------------


class _Controller:
    def __init__(self, policy="write_through", inflight=False):
        self.write_policy = policy
        self._inflight = inflight

    def has_inflight_device_transfers(self):
        return self._inflight


class _Tree:
    """Records the UnifiedRadixCache calls the gate makes (stand-in; the real tree: test_hicache_gate_real_tree.py)."""

    def __init__(self, controller, evictable=100, evicts=None):
        self.cache_controller = controller
        self.is_write_back = controller is not None and controller.write_policy == "write_back"
        self._evictable = evictable
        self._evicts = evicts
        self.calls = []

    def writing_check(self, write_back=False):
        self.calls.append(("writing_check", write_back))

    def evictable_size(self):
        return self._evictable

    def evict(self, params):
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        self.calls.append(("evict", params.num_tokens, self.cache_controller.write_policy, self.is_write_back))
        n = min(params.num_tokens, self._evictable) if self._evicts is None else self._evicts
        return EvictResult(num_tokens_evicted=n)


class _Scheduler:
    def __init__(self, tree, idle=True):
        self.tree_cache = tree
        self._idle = idle

    def is_fully_idle(self):
        return self._idle


def _controller_for(scheduler):
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    ctl = SchedulerInternalStateController.__new__(SchedulerInternalStateController)
    ctl.scheduler = scheduler
    return ctl


def _ask(scheduler, value, gate, extra=None):
    from sglang.srt.managers.io_struct import SetInternalStateReq
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    G.GATE = gate
    set_state = G.build_set_internal_state(SchedulerInternalStateController.set_internal_state)
    req = SetInternalStateReq(server_args={G.GATE_KEY: value, **(extra or {})})
    return set_state(_controller_for(scheduler), req).updated


@pytest.fixture
def restore_gate():
    old = G.GATE
    yield
    G.GATE = old


def test_gate_evicts_once_with_write_back_then_refuses(restore_gate):
    tree = _Tree(_Controller("write_through"), evictable=100)
    gate = G.Gate(armed=True)
    assert _ask(_Scheduler(tree), 40, gate) is True
    assert tree.calls == [("writing_check", True), ("evict", 40, "write_back", True)]
    assert tree.cache_controller.write_policy == "write_through" and tree.is_write_back is False  # restored
    assert gate.state() == {
        "armed": False,
        "last_requested_tokens": 40,
        "last_evictable_tokens": 100,
        "last_evicted_tokens": 40,
        "last_outcome": "evicted",
        "last_reason": gate.last_reason,
    }
    assert _ask(_Scheduler(tree), 40, gate) is False  # second use
    assert gate.last_outcome == "already_used" and "one shot" in gate.last_reason
    assert len([c for c in tree.calls if c[0] == "evict"]) == 1


def test_gate_unarmed_refuses(restore_gate):
    tree = _Tree(_Controller())
    gate = G.Gate(armed=False)
    assert _ask(_Scheduler(tree), 10, gate) is False
    assert gate.last_outcome == "not_armed" and "SGLANG_HICACHE_GATE_CONTROL=armed" in gate.last_reason
    assert tree.calls == []


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "10"])
def test_gate_bad_values_refused_and_arm_kept(restore_gate, value):
    tree = _Tree(_Controller())
    gate = G.Gate(armed=True)
    assert _ask(_Scheduler(tree), value, gate) is False
    assert gate.last_outcome == "bad_value" and gate.armed is True and tree.calls == []


def test_gate_busy_scheduler_refused(restore_gate):
    gate = G.Gate(armed=True)
    assert _ask(_Scheduler(_Tree(_Controller()), idle=False), 10, gate) is False
    assert gate.last_outcome == "busy" and "requests are running" in gate.last_reason and gate.armed
    assert _ask(_Scheduler(_Tree(_Controller(inflight=True))), 10, gate) is False
    assert "HiCache transfers are in flight" in gate.last_reason and gate.armed


def test_gate_hicache_off_refused(restore_gate):
    """Without HiCache the tree's ``cache_controller`` is None (UnifiedRadixCache.__init__ sets it
    to None and assigns one only for hierarchical cache); a plain RadixCache has none at all."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    assert "cache_controller" not in RadixCache.__dict__
    gate = G.Gate(armed=True)
    assert _ask(_Scheduler(_Tree(None)), 10, gate) is False
    assert gate.last_outcome == "hicache_off" and gate.armed


def test_gate_nothing_evicted_consumes_the_arm(restore_gate):
    tree = _Tree(_Controller(), evictable=0, evicts=0)
    gate = G.Gate(armed=True)
    assert _ask(_Scheduler(tree), 10, gate) is False
    assert gate.last_outcome == "nothing_evicted" and gate.armed is False and gate.used


def test_gate_key_must_be_alone_and_other_keys_reach_stock(restore_gate):
    gate = G.Gate(armed=True)
    assert _ask(_Scheduler(_Tree(_Controller())), 10, gate, extra={"pp_max_micro_batch_size": 2}) is False
    assert gate.armed


# -- strict VMM ---------------------------------------------------------------------------------


def test_strict_vmm_refuses_the_posix_fallback_with_a_clear_message():
    seen = {}

    def stock_init(self, memory_size, recycle_interval, base_gpu_id, consumer_count, allow_posix_fallback=False):
        seen["allow"] = allow_posix_fallback
        if not allow_posix_fallback:  # what CudaVmmMemoryPool does when FABRIC is unavailable
            raise RuntimeError("CUDA VMM multimodal transport selected POSIX_FD, but this pool requires FABRIC")

    init = vmm.build_pool_init(stock_init)
    with pytest.raises(vmm.StrictVmmError, match="DSPARK_HARDEN_STRICT_VMM=1.*POSIX_FD"):
        init(object(), 1 << 20, 1.0, 0, 1, allow_posix_fallback=True)
    assert seen["allow"] is False


def test_strict_vmm_keeps_fabric_and_explicit_no_fallback_errors():
    def fabric_ok(self, *a, **kw):
        assert kw["allow_posix_fallback"] is False

    vmm.build_pool_init(fabric_ok)(object(), 1, 1.0, 0, 1, True)

    def fails(self, *a, **kw):
        raise RuntimeError("requires FABRIC")

    with pytest.raises(RuntimeError) as info:  # caller never asked for a fallback: stock error unchanged
        vmm.build_pool_init(fails)(object(), 1, 1.0, 0, 1, False)
    assert not isinstance(info.value, vmm.StrictVmmError)
