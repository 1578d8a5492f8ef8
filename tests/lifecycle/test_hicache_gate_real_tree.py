"""The HiCache eviction gate on a REAL ``UnifiedRadixCache`` with a real HiCache stack, CPU tensors
(issue 14 item 4).

Does ``--enable-hierarchical-cache`` run on this CPU harness? No, for three stock reasons, each seen
here: (1) the host pool is sized against ``HICACHE_HOST_MEMORY_RESERVE_BYTES`` (10 GiB kept free), which
this shared 24 GiB machine often does not have (``Not enough host memory available``); (2) the stock
assembler always builds ``MHATokenToKVPoolHost`` with its default ``pin_memory=True``, and pinning is
``cudaHostRegister``: ``RuntimeError: Found no NVIDIA driver on your system``; (3) the device<->host copy
ops (``transfer_kv_direct`` and the other ``sgl_kernel.kvcacheio`` ops) are imported only on
CUDA/HIP/XPU, so on CPU the first backup dies with ``NameError: name 'transfer_kv_direct' is not
defined`` (and ``sgl_kernel``'s ops library does not load without CUDA). So no end-to-end server test;
instead everything below the HTTP layer is the real stock code:

* real: ``ServerArgs(enable_hierarchical_cache=True, hicache_io_backend="direct",
  hicache_mem_layout="layer_first")`` published in the runtime context; device ``MHATokenToKVPool``,
  ``TokenToKVPoolAllocator``, ``ReqToTokenPool`` on ``device="cpu"``; ``UnifiedRadixCache`` (its default
  Rust tree core) from ``CacheInitParams``; stock ``init_hicache`` -> stock hybrid pool assembler ->
  ``HostPoolGroup`` with a real ``MHATokenToKVPoolHost`` and a real ``HybridCacheController`` (the
  ``HiCacheController`` subclass stock builds) whose ``L2TransferEngine`` runs on ``torch.cpu`` streams
  and events (torch's device-agnostic stubs: ``query()`` is True; the CPU copies are synchronous, so
  that is exact); stock ``insert``, ``evict``, ``match_prefix``, ``load_back``, ``check_hicache_events``;
  the gate through the real ``SchedulerInternalStateController.set_internal_state`` with our wrap, as
  in test_teardown_gate_vmm.py (its ``_ask`` / ``_Scheduler`` scaffolding: the scheduler is a stand-in
  holding the real tree and answering ``is_fully_idle``).
* substituted, in a forked child only (``@pytest.mark.forked``): (a) ``MHATokenToKVPoolHost.__init__``
  is called with ``pin_memory=False`` (constructor-only: pinning needs a CUDA driver, reason 2);
  (b) ``sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct``, the one kernel op the ``direct`` /
  ``layer_first`` path calls (missing on CPU, reason 3), is bound to a torch index copy with the op's
  contract (per layer ``dst[dst_indices] = src[src_indices]``; page size 1 here). Everything around it
  (index preparation, host layout, the controller's queues and acks, the tree's backup/demote) is
  stock. (c) No patch: the host-memory budget is given with stock's own ``host_memory_budget_scope``
  (64 MiB for a 129-token pool), so the machine's free RAM versus the 10 GiB reserve (reason 1) does not
  decide the test.

Differential: with ``hicache_write_policy=write_through_selective`` a prefix inserted once is a
device-only leaf (hit count 1 < threshold 2). Stock ``evict`` drops it (no host copy: gone); the gate
forces ``write_back`` for its one eviction, so the same leaves are backed up, their KV comes back from
host bit-identical (load back after the freed device slots were overwritten), and the policy is
restored.
"""

from __future__ import annotations

from array import array

import pytest

from dspark_harden.lifecycle import hicache_gate as G
from tests.lifecycle.test_teardown_gate_vmm import _ask, _Scheduler

LAYERS, HEADS, DIM, DEVICE_TOKENS = 2, 2, 4, 64
# disjoint prefixes, each inserted once (device-only under write_through_selective); A is the LRU leaf,
# each >= the tree's load_back_threshold (10) so it can be loaded back for the content check
SEQS = {"A": list(range(1, 17)), "B": list(range(100, 112)), "C": list(range(200, 212))}


def _cpu_transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Stand-in for sgl_kernel's ``transfer_kv_direct`` (not built for CPU): per layer,
    ``dst[dst_indices] = src[src_indices]``."""
    assert len(src_layers) == len(dst_layers) and len(src_indices) == len(dst_indices)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)]


def _key(tokens):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def _build(policy: str, hicache: bool = True):
    """A real UnifiedRadixCache + HiCache stack on CPU; returns (tree, device kv pool, allocator)."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.pool_host import mha
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_ratio=2.0,
    )
    get_context().set_server_args(server_args)
    kv = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=1,
        dtype=torch.float32,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(DEVICE_TOKENS, torch.float32, "cpu", kv, need_sort=False)
    params = CacheInitParams(
        disable=False,
        page_size=1,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False),
        tree_components=(ComponentType.FULL,),
    )
    tree = UnifiedRadixCache(params)
    if hicache:
        # substitutes (a) and (b), see the module docstring; this process is a forked child
        assert getattr(mha, "transfer_kv_direct", None) in (None, _cpu_transfer_kv_direct), (
            "this build now has the kernel op on CPU: drop the substitute"
        )
        mha.transfer_kv_direct = _cpu_transfer_kv_direct
        stock_init = mha.MHATokenToKVPoolHost.__init__
        if not getattr(stock_init, "_unpinned", False):

            def init(self, *args, **kwargs):
                kwargs["pin_memory"] = False
                stock_init(self, *args, **kwargs)

            init._unpinned = True
            mha.MHATokenToKVPoolHost.__init__ = init
        with host_memory_budget_scope(64 << 20):
            tree.init_hicache(server_args, params)
        cc = tree.cache_controller
        assert type(cc).__name__ == "HybridCacheController" and cc.write_policy == policy
        assert type(cc.mem_pool_host.anchor_entry.host_pool) is mha.MHATokenToKVPoolHost
        assert tree.is_write_back is (policy == "write_back")
    return tree, kv, allocator


def _insert(tree, kv, allocator, seed=0):
    """Write random KV into fresh device slots for each sequence and insert it; returns the values."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    gen = torch.Generator().manual_seed(seed)
    written = {}
    for name, tokens in SEQS.items():
        idx = allocator.alloc(len(tokens))
        k = [torch.randn(len(tokens), HEADS, DIM, generator=gen) for _ in range(LAYERS)]
        v = [torch.randn(len(tokens), HEADS, DIM, generator=gen) for _ in range(LAYERS)]
        for layer in range(LAYERS):
            kv.k_buffer[layer][idx] = k[layer]
            kv.v_buffer[layer][idx] = v[layer]
        assert tree.insert(InsertParams(key=_key(tokens), value=idx)).prefix_len == 0
        written[name] = (k, v)
    return written


def _match(tree, name):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return tree.match_prefix(MatchPrefixParams(key=_key(SEQS[name])))


def _host_free(tree):
    return tree.cache_controller.mem_pool_host.available_size()


def _scribble_free_device_slots(tree, kv):
    """Overwrite every device slot the tree does not hold, so a load back cannot pass on stale KV."""
    import torch

    live = torch.cat([tree.path_device_indices(_match(tree, n).last_device_node) for n in SEQS]).tolist()
    dead = torch.tensor(sorted(set(range(kv.k_buffer[0].shape[0])) - set(live)), dtype=torch.int64)
    for layer in range(LAYERS):
        kv.k_buffer[layer][dead] = -7.0
        kv.v_buffer[layer][dead] = -7.0


def _load_back_and_read(tree, kv, name):
    """Stock load back (H->D) of a host-only prefix; returns the KV now on device for it."""
    m = _match(tree, name)
    assert m.device_prefix_len == 0 and m.host_hit_length == len(SEQS[name])
    assert tree.load_back(m.best_match_node)
    tree.ready_to_load_host_cache()
    tree.check_hicache_events()
    m = _match(tree, name)
    assert m.device_prefix_len == len(SEQS[name]) and m.host_hit_length == 0
    idx = tree.path_device_indices(m.last_device_node)
    return [kv.k_buffer[layer][idx] for layer in range(LAYERS)], [kv.v_buffer[layer][idx] for layer in range(LAYERS)]


@pytest.mark.forked
def test_gate_backs_up_device_only_leaves_that_stock_eviction_drops():
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    # stock (no gate): write_through_selective, each prefix seen once -> device-only leaves
    stock_tree, stock_kv, stock_alloc = _build("write_through_selective")
    _insert(stock_tree, stock_kv, stock_alloc)
    stock_tree.check_hicache_events()  # the scheduler's poll: nothing was queued
    assert not stock_tree.cache_controller.has_inflight_device_transfers()
    host_before = _host_free(stock_tree)
    assert stock_tree.evictable_size() == 40
    assert stock_tree.evict(EvictParams(num_tokens=20)).num_tokens_evicted == 28  # LRU: A (16) + B (12)
    assert _host_free(stock_tree) == host_before, "stock evict backed something up to host"
    for name in "AB":
        m = _match(stock_tree, name)
        assert (m.device_prefix_len, m.host_hit_length) == (0, 0), f"{name}: stock kept a copy"
    assert _match(stock_tree, "C").device_prefix_len == 12

    # the gate on the same stack and the same inserts
    tree, kv, alloc = _build("write_through_selective")
    written = _insert(tree, kv, alloc)
    tree.check_hicache_events()
    host_before = _host_free(tree)
    for name in SEQS:  # device-only before the gate
        m = _match(tree, name)
        assert (m.device_prefix_len, m.host_hit_length) == (len(SEQS[name]), 0)
    gate = G.Gate(armed=True)
    old = G.GATE
    try:
        assert _ask(_Scheduler(tree), 20, gate) is True, gate.last_reason
        assert gate.last_outcome == "evicted"
        assert gate.last_evictable_tokens == 40 and gate.last_requested_tokens == 20
        assert gate.last_evicted_tokens == 28
        assert tree.evictable_size() == 12
        assert _host_free(tree) == host_before - 28  # A and B now hold host slots
        assert tree.cache_controller.write_policy == "write_through_selective" and tree.is_write_back is False
        assert not tree.cache_controller.has_inflight_device_transfers() and not tree.ongoing_write_through
        assert _match(tree, "C").device_prefix_len == 12
        # the host copies are the device KV written before: load back into overwritten slots and compare
        _scribble_free_device_slots(tree, kv)
        for name in "AB":
            k, v = _load_back_and_read(tree, kv, name)
            for layer in range(LAYERS):
                assert torch.equal(k[layer], written[name][0][layer]), (name, layer, "K")
                assert torch.equal(v[layer], written[name][1][layer]), (name, layer, "V")

        # one shot: the second request is refused and the tree is untouched
        evictable, host_free = tree.evictable_size(), _host_free(tree)
        assert _ask(_Scheduler(tree), 20, gate) is False
        assert gate.last_outcome == "already_used" and "one shot" in gate.last_reason
        assert (tree.evictable_size(), _host_free(tree)) == (evictable, host_free)
    finally:
        G.GATE = old


@pytest.mark.forked
def test_gate_refusals_on_the_real_tree_leave_it_untouched():
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    # hierarchical cache off: a real UnifiedRadixCache without init_hicache has cache_controller None
    plain, _, _ = _build("write_through_selective", hicache=False)
    assert plain.cache_controller is None
    gate = G.Gate(armed=True)
    old = G.GATE
    try:
        assert _ask(_Scheduler(plain), 10, gate) is False and gate.last_outcome == "hicache_off" and gate.armed

        tree, kv, alloc = _build("write_through_selective")
        _insert(tree, kv, alloc)
        # a prefix seen a second time reaches the write-through threshold: stock queues a real D->H backup
        again = alloc.alloc(len(SEQS["C"]))
        tree.insert(InsertParams(key=_key(SEQS["C"]), value=again))
        assert tree.cache_controller.has_inflight_device_transfers() and tree.ongoing_write_through
        evictable, host_free = tree.evictable_size(), _host_free(tree)

        assert _ask(_Scheduler(tree, idle=False), 10, gate) is False
        assert gate.last_outcome == "busy" and "requests are running or waiting" in gate.last_reason
        assert _ask(_Scheduler(tree), 10, gate) is False
        assert gate.last_outcome == "busy" and "HiCache transfers are in flight" in gate.last_reason
        assert gate.armed and not gate.used
        assert (tree.evictable_size(), _host_free(tree)) == (evictable, host_free)

        tree.check_hicache_events()  # the idle scheduler's poll settles the backup
        assert not tree.cache_controller.has_inflight_device_transfers()
        m = _match(tree, "C")
        assert m.device_prefix_len == 12  # C is now backed (device + host); A, B still device-only
        assert _ask(_Scheduler(tree), 40, gate) is True, gate.last_reason
        assert gate.last_evicted_tokens == 40 and tree.evictable_size() == 0
        for name in SEQS:
            m = _match(tree, name)
            assert (m.device_prefix_len, m.host_hit_length) == (0, len(SEQS[name])), name
        assert tree.cache_controller.write_policy == "write_through_selective" and tree.is_write_back is False
    finally:
        G.GATE = old


@pytest.mark.forked
def test_gate_under_the_default_write_through_policy_keeps_everything():
    """SGLang's default ``write_through`` backs each insert up at once; the gate then only evicts
    (demotes) already-backed leaves: nothing lost, policy restored."""
    from sglang.srt.server_args import ServerArgs

    assert ServerArgs(model_path="dummy", device="cpu").hicache_write_policy == "write_through"
    tree, kv, alloc = _build("write_through")
    _insert(tree, kv, alloc)
    assert tree.cache_controller.has_inflight_device_transfers()  # backups queued by the inserts
    gate = G.Gate(armed=True)
    old = G.GATE
    try:
        assert _ask(_Scheduler(tree), 40, gate) is False and gate.last_outcome == "busy" and gate.armed
        tree.check_hicache_events()
        host_free = _host_free(tree)
        assert _ask(_Scheduler(tree), 40, gate) is True, gate.last_reason
        assert gate.last_evicted_tokens == 40 and tree.evictable_size() == 0
        assert _host_free(tree) == host_free  # already on host: nothing new written
        for name in SEQS:
            assert _match(tree, name).host_hit_length == len(SEQS[name]), name
        assert tree.cache_controller.write_policy == "write_through" and tree.is_write_back is False
    finally:
        G.GATE = old
