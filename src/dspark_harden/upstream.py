"""Behaviour stock SGLang 0.5.23 already has, verified by probing the live code (never assumed).

Each probe inspects the real object; if an SGLang bump removes the behaviour, the feature turns
``failed`` and startup stops, because other hardenings rely on it.
"""

from __future__ import annotations

import importlib

from .core.feature import Feature
from .core.hookspecs import hookimpl
from .core.patch import Role


def _probe_callable(target: str):
    def probe():
        module, _, qual = target.partition(":")
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return False, f"{target} does not exist"
        return callable(obj), f"{target} exists"

    return probe


ADVANCE_GRAMMAR_FSM = (
    "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor.advance_grammar_fsm"
)


def _probe_advance_grammar_fsm_idempotent():
    """Call stock ``SchedulerBatchResultProcessor.advance_grammar_fsm`` twice on one real
    ``GenerationBatchResult`` of a spec-v2 decode step whose request has a real ``XGrammarGrammar``
    (xgrammar matcher for the regex ``abc`` over a 6-token vocabulary) and a verified run
    ``a b c <eos> x``; the behaviour the DSpark mask path relies on:

    - the first call advances the FSM over the run and stops at the terminating token (``x``, past
      ``<eos>``, is dropped: the retained run is ``a b c <eos>``) and marks the result advanced;
    - the second call changes nothing (a non-idempotent advance would feed ``a`` to a terminated
      matcher, or re-accept the run and abort the request).

    The request and batch are namespaces with the attributes the method reads (``grammar``,
    ``is_retracted``, ``finished()``, ``rid``, ``to_finish``; ``has_grammar``, ``forward_mode``,
    ``reqs``); the processor is the stock class (only its ``_accept_grammar_tokens`` is used)."""
    import types

    import torch
    import xgrammar as xgr
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    vocab = ["<eos>", "a", "b", "c", "x", "y"]
    eos, a, b, c, x = 0, 1, 2, 3, 4
    info = xgr.TokenizerInfo(vocab, vocab_size=len(vocab), stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_regex("abc")
    grammar = XGrammarGrammar(xgr.GrammarMatcher(compiled), len(vocab), compiled, None, key_string="probe")
    req = types.SimpleNamespace(
        rid="dspark-harden-probe", grammar=grammar, is_retracted=False, to_finish=None, finished=lambda: False
    )
    batch = types.SimpleNamespace(has_grammar=True, forward_mode=ForwardMode.DECODE, reqs=[req])
    run = [a, b, c, eos, x]
    result = GenerationBatchResult(
        next_token_ids=torch.tensor(run), accept_lens=torch.tensor([len(run)]), speculative_num_draft_tokens=len(run)
    )
    proc = object.__new__(brp.SchedulerBatchResultProcessor)
    cls = brp.SchedulerBatchResultProcessor
    cls.advance_grammar_fsm(proc, result, batch)
    first = (
        list(grammar.accepted_tokens),
        result.grammar_advanced,
        result.grammar_retained_tokens,
        grammar.is_terminated(),
        req.to_finish,
    )
    if first != ([a, b, c, eos], True, [[a, b, c, eos]], True, None):
        return False, (
            f"{ADVANCE_GRAMMAR_FSM}: one call over a b c <eos> x gave accepted={first[0]}, "
            f"grammar_advanced={first[1]}, retained={first[2]}, terminated={first[3]}, "
            f"to_finish={first[4]} (expected the FSM advanced once, truncated after <eos>)"
        )
    cls.advance_grammar_fsm(proc, result, batch)
    second = (
        list(grammar.accepted_tokens),
        result.grammar_advanced,
        result.grammar_retained_tokens,
        grammar.is_terminated(),
        req.to_finish,
    )
    if second != first:
        return False, (
            f"{ADVANCE_GRAMMAR_FSM} is not idempotent: a second call on the same result changed "
            f"(accepted, advanced, retained, terminated, to_finish) from {first} to {second}"
        )
    return True, f"{ADVANCE_GRAMMAR_FSM}: advances once, truncates after the terminating token, idempotent (called)"


REQS_FINISHING_INFLIGHT = "sglang.srt.managers.scheduler:Scheduler._reqs_finishing_inflight"


def _probe_one_token_excluded_from_decode_merge():
    """Call stock ``Scheduler.update_running_batch`` (which asks ``_reqs_finishing_inflight``) in the
    overlap loop's state right after a prefill: the prefill batch's result is still queued
    (``result_queue`` holds it, ``enable_skip_finishing_decode`` on) and the merged running batch
    holds real ``Req`` objects: two one-token requests (``max_new_tokens=1``, one with
    ``return_logprob``) and one with ``max_new_tokens=4``. The behaviour DSpark relies on: both
    one-token requests are excluded from the premature decode (the queued prefill result commits
    their only token; a DSpark verify step over them would draft/verify past their end), the other
    stays; with the queue empty (non-overlap) nothing is excluded.

    The scheduler is a namespace with the attributes the two methods read; the batch records
    ``filter_batch(reqs_to_exclude=)`` and reports empty/non-empty as a ``ScheduleBatch`` would;
    reaching ``check_decode_mem`` (stock decoding the kept requests) ends the call there."""
    import collections
    import types

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams

    def req(rid, n, logprob):
        return Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=n), return_logprob=logprob)

    one, one_lp, four = req("one", 1, False), req("one-logprob", 1, True), req("four", 4, False)

    class _Batch:
        def __init__(self, reqs):
            self.reqs, self.excluded, self.batch_is_full = list(reqs), None, True

        def batch_size(self):
            return len(self.reqs)

        def filter_batch(self, reqs_to_exclude=None, **_):
            self.excluded = list(reqs_to_exclude or [])
            self.reqs = [r for r in self.reqs if r not in self.excluded]

        def is_empty(self):
            return not self.reqs

        def check_decode_mem(self, *a, **k):  # stock went on to decode the kept requests: stop here
            raise _Decoded

    class _Decoded(Exception):
        pass

    def run(queued, reqs):
        prefill = types.SimpleNamespace(reqs=list(reqs))
        sched = types.SimpleNamespace(
            enable_skip_finishing_decode=True, result_queue=collections.deque([(prefill, None)] if queued else [])
        )
        sched._reqs_finishing_inflight = types.MethodType(Scheduler._reqs_finishing_inflight, sched)
        batch = _Batch(reqs)
        try:
            Scheduler.update_running_batch(sched, batch)
        except _Decoded:
            pass
        return [r.rid for r in batch.excluded or []]

    try:
        got = run(True, [one, one_lp])
        want = ["one", "one-logprob"]
        if got != want:
            return False, (
                f"{REQS_FINISHING_INFLIGHT}: one-token requests (with/without return_logprob) queued "
                f"from a prefill: excluded {got} from the decode merge, expected {want}"
            )
        got = _Batch([one, one_lp, four])
        excluded = Scheduler._reqs_finishing_inflight(
            types.SimpleNamespace(
                enable_skip_finishing_decode=True,
                result_queue=collections.deque([(types.SimpleNamespace(reqs=got.reqs), None)]),
            ),
            got,
        )
        if [r.rid for r in excluded] != want:
            return False, (
                f"{REQS_FINISHING_INFLIGHT}: with a max_new_tokens=4 request beside them it excluded "
                f"{[r.rid for r in excluded]}, expected {want}"
            )
        got = run(False, [one, one_lp])
        if got:
            return False, f"{REQS_FINISHING_INFLIGHT}: with no queued result it excluded {got}, expected none"
    except Exception as e:  # a bump that changes the methods' shape
        return False, f"{REQS_FINISHING_INFLIGHT}: probe call raised {type(e).__name__}: {e}"
    return True, f"{REQS_FINISHING_INFLIGHT}: one-token requests queued from a prefill skip the decode merge (called)"


VALIDATE_DFLASH = "sglang.srt.managers.scheduler:validate_dflash_request"


def _probe_validate_dflash_applies_to_dspark():
    """The scheduler gates ``validate_dflash_request`` on ``spec_algorithm.is_dflash_family()``: the
    probe asks the real ``SpeculativeAlgorithm`` parsed from ``DSPARK`` (it must be in the family)
    and calls the validator the scheduler module resolves with a real ``Req`` asking
    ``return_hidden_states`` under overlap (must be refused with a message), without overlap and
    without hidden states (must pass)."""
    from sglang.srt.managers import scheduler as S
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        algo = SpeculativeAlgorithm.from_string("DSPARK")
        if not algo.is_dflash_family():
            return False, f"{VALIDATE_DFLASH}: SpeculativeAlgorithm DSPARK is not in is_dflash_family() (not validated)"

        def req(hidden):
            return Req("probe", "", [1, 2], SamplingParams(max_new_tokens=2), return_hidden_states=hidden)

        refused = S.validate_dflash_request(req(True), True)
        passed = (S.validate_dflash_request(req(True), False), S.validate_dflash_request(req(False), True))
    except Exception as e:
        return False, f"{VALIDATE_DFLASH}: probe call raised {type(e).__name__}: {e}"
    if not isinstance(refused, str) or not refused:
        return False, f"{VALIDATE_DFLASH}: return_hidden_states under overlap gave {refused!r}, expected a refusal"
    if passed != (None, None):
        return False, f"{VALIDATE_DFLASH}: plain requests gave {passed!r}, expected (None, None)"
    return True, f"{VALIDATE_DFLASH}: applies to DSPARK (is_dflash_family) and refuses return_hidden_states (called)"


SLICE_OUTPUT_ROWS = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:_slice_output_rows"


def _probe_slice_output_rows_nested():
    """Call stock ``_slice_output_rows`` on a padded (8-row) output shaped as an auxiliary-hidden-state
    target returns it (a DSpark target: ``(hidden, [aux0, (aux1,)])``) and trim to 5 rows: every
    tensor leaf must come back with 5 rows, tuples as tuples, lists as lists, values unchanged."""
    import torch
    from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as pg

    rows = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    out = (rows, [rows + 1, (rows + 2,)])
    try:
        got = pg._slice_output_rows(out, 5)
    except Exception as e:
        return False, f"{SLICE_OUTPUT_ROWS}: probe call raised {type(e).__name__}: {e}"

    def shape(o):
        if torch.is_tensor(o):
            return ("T", tuple(o.shape))
        return (type(o).__name__, [shape(i) for i in o])

    want = ("tuple", [("T", (5, 3)), ("list", [("T", (5, 3)), ("tuple", [("T", (5, 3))])])])
    if shape(got) != want:
        return (
            False,
            f"{SLICE_OUTPUT_ROWS}: trimming (hidden, [aux0, (aux1,)]) to 5 rows gave {shape(got)}, expected {want}",
        )
    if not (
        torch.equal(got[0], rows[:5])
        and torch.equal(got[1][0], rows[:5] + 1)
        and torch.equal(got[1][1][0], rows[:5] + 2)
    ):
        return False, f"{SLICE_OUTPUT_ROWS}: trimmed rows differ from the first 5 rows of each leaf"
    if pg._slice_output_rows(None, 5) is not None:
        return False, f"{SLICE_OUTPUT_ROWS}: None output not passed through"
    return True, f"{SLICE_OUTPUT_ROWS}: keeps nested tuples and lists, trims every tensor leaf (called)"


LOAD_BUDGET = "sglang.srt.managers.data_parallel_controller:DataParallelController.refresh_load_budget"


def _probe_load_budget_throttle():
    """Call stock ``DataParallelController.refresh_load_budget`` on a namespace controller: two calls
    back to back read the scheduler snapshot once (the second is within 20 ms), a call 30 ms after
    the last refresh reads it again."""
    import types

    from sglang.srt.managers.data_parallel_controller import DataParallelController

    updates = []
    ctl = types.SimpleNamespace(
        _last_refresh_time=0.0,
        dp_budget=types.SimpleNamespace(update_budget=updates.append),
        load_snapshot_reader=types.SimpleNamespace(read_all=lambda: "snapshot"),
    )
    try:
        DataParallelController.refresh_load_budget(ctl)
        DataParallelController.refresh_load_budget(ctl)
        burst = len(updates)
        ctl._last_refresh_time -= 0.03
        DataParallelController.refresh_load_budget(ctl)
    except Exception as e:
        return False, f"{LOAD_BUDGET}: probe call raised {type(e).__name__}: {e}"
    if burst != 1:
        return False, f"{LOAD_BUDGET}: two back-to-back calls refreshed {burst} times, expected 1 (no 20 ms throttle)"
    if len(updates) != 2:
        return False, f"{LOAD_BUDGET}: a call 30 ms after the last refresh did not refresh ({len(updates)} refreshes)"
    return True, f"{LOAD_BUDGET}: refreshes at most every 20 ms (called)"


DSV4_INDEXER_COPY = "sglang.srt.layers.attention.dsv4.metadata:PagedIndexerMetadata.copy_"


def _probe_dsv4_indexer_metadata_copy_in_place():
    """Call stock ``PagedIndexerMetadata.copy_`` (what ``DSV4Metadata.copy_`` runs, through
    ``maybe_copy_inplace``, on each indexer metadata when a captured graph's metadata is refreshed for
    replay) from a fresh metadata into a "captured" one, both built on CPU tensors: the captured
    tensors (``page_table``, ``compressed_seq_lens``, ``deep_gemm_metadata``, ``topk_metadata``) must
    be the same objects afterwards (a graph replays their addresses) holding the fresh values, and
    the per-forward plan fields rebound from the source. Only this indexer piece runs on CPU:
    ``DSV4AttnMetadata``'s own ``copy_`` needs the FlashMLA/DeepGEMM metadata of a CUDA host."""
    import dataclasses

    import torch
    from sglang.srt.layers.attention.dsv4 import metadata as M

    def mk(v):
        m = object.__new__(M.PagedIndexerMetadata)
        for f in dataclasses.fields(M.PagedIndexerMetadata):
            setattr(m, f.name, None if f.default is dataclasses.MISSING else f.default)
        m.page_size, m.compressed_page_size, m.use_topk_v2 = 64, 16, True
        m.page_table = torch.full((2, 4), v, dtype=torch.int32)
        m.compressed_seq_lens = torch.full((2,), v, dtype=torch.int32)
        m.deep_gemm_metadata = torch.full((3,), v, dtype=torch.int32)
        m.topk_metadata = torch.full((5,), v, dtype=torch.int32)
        m.rows_per_chunk = v
        return m

    names = ("page_table", "compressed_seq_lens", "deep_gemm_metadata", "topk_metadata")
    dst, src = mk(0), mk(7)
    before = {n: getattr(dst, n) for n in names}
    try:
        dst.copy_(src)
    except Exception as e:
        return False, f"{DSV4_INDEXER_COPY}: probe call raised {type(e).__name__}: {e}"
    rebound = [n for n in names if getattr(dst, n) is not before[n]]
    if rebound:
        return False, f"{DSV4_INDEXER_COPY}: captured tensors {rebound} were rebound, not refreshed in place"
    stale = [n for n in names if not bool((getattr(dst, n) == 7).all())]
    if stale:
        return False, f"{DSV4_INDEXER_COPY}: captured tensors {stale} do not hold the fresh values"
    if dst.rows_per_chunk != 7:
        return False, f"{DSV4_INDEXER_COPY}: per-forward field rows_per_chunk not taken from the source"
    return True, f"{DSV4_INDEXER_COPY}: captured indexer tensors refreshed in place (called)"


WAIT_AND_WARMUP = "sglang.srt.entrypoints.http_server:_wait_and_warmup"


def _rebind(func, **overrides):
    """``func``'s own code object run with its module globals plus ``overrides`` (what it calls or reads):
    the stock function executes, nothing in the live modules is patched."""
    import types

    glb = dict(func.__globals__)
    glb.update(overrides)
    out = types.FunctionType(func.__code__, glb, func.__name__, func.__defaults__, func.__closure__)
    out.__kwdefaults__ = func.__kwdefaults__
    return out


def _drive(coro):
    """Run a coroutine that awaits nothing pending (the stock handlers below, on recording stand-ins)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the coroutine waited for something")


def _probe_gc_freeze_after_server_warmup():
    """Stock 0.5.23 freezes the GC of the tokenizer manager, every scheduler and the detokenizer once the
    HTTP server answered its warm-up request (PR #34999); the lifecycle docs and ``bench gc`` compare the
    plugin's ``gc-freeze`` against it. Each link of the chain runs as stock code (its own code object,
    with the config getters, ``requests``, ``gc`` and the peers it calls replaced by recording stand-ins):

    1. ``http_server._wait_and_warmup`` (the warm-up thread's target; its default warm-up is
       ``_execute_server_warmup``) calls ``_freeze_gc_after_server_warmup`` after a successful warm-up and
       before the launch callback, and also with ``skip_server_warmup``;
    2. ``_freeze_gc_after_server_warmup`` POSTs ``<url>/freeze_gc``;
    3. the app routes ``POST /freeze_gc`` to a handler that awaits ``tokenizer_manager.freeze_gc()``;
    4. ``TokenizerManager.freeze_gc`` dispatches a ``FreezeGCReq`` to the scheduler and runs stock
       ``utils.common.freeze_gc``, which calls ``gc.freeze()``;
    5. ``Scheduler.handle_freeze_gc`` runs ``freeze_gc`` (``gc.freeze()``) and forwards the request to the
       detokenizer (whose ``handle_freeze_gc_req`` is registered for ``FreezeGCReq``).

    The ``Engine`` path (offline ``sglang.Engine``) has no such freeze; that part is the plugin's."""
    import inspect
    import types

    import requests
    from sglang.srt.entrypoints import http_server as H
    from sglang.srt.managers import detokenizer_manager as D
    from sglang.srt.managers import io_struct
    from sglang.srt.managers import scheduler as S
    from sglang.srt.managers import tokenizer_manager as TM
    from sglang.srt.utils import common as C

    ns = types.SimpleNamespace
    where = "sglang.srt.entrypoints.http_server"

    # 1. the warm-up thread reaches the freeze
    if inspect.signature(H._wait_and_warmup).parameters["execute_warmup_func"].default is not H._execute_server_warmup:
        return False, f"{WAIT_AND_WARMUP}: its default warm-up is no longer _execute_server_warmup"
    for skip in (False, True):
        order: list = []
        wait_and_warmup = _rebind(
            H._wait_and_warmup,
            get_model=lambda: ns(checkpoint_engine_wait_weights_before_ready=False, delete_ckpt_after_loading=False),
            get_exec=lambda: ns(moe=ns(is_ep_scale_joiner=False, ep_join_mode=None)),
            get_serving=lambda skip=skip: ns(skip_server_warmup=skip),
            get_observability=lambda: ns(debug_tensor_dump_input_file=None),
            _global_state=ns(tokenizer_manager=ns(server_status=None)),
            _freeze_gc_after_server_warmup=lambda server_args, order=order: order.append("freeze"),
        )
        wait_and_warmup(
            ns(url=lambda: "http://probe"),
            launch_callback=lambda order=order: order.append("launch"),
            execute_warmup_func=lambda server_args, order=order: order.append("warmup") or True,
        )
        want = ["freeze", "launch"] if skip else ["warmup", "freeze", "launch"]
        if order != want:
            return False, (
                f"{WAIT_AND_WARMUP} (skip_server_warmup={skip}) ran {order}, expected {want}: "
                "stock no longer freezes the GC after server warm-up"
            )

    # 2. the freeze is a POST /freeze_gc to the server itself
    posts: list = []
    freeze_after = _rebind(
        H._freeze_gc_after_server_warmup,
        requests=ns(
            post=lambda url, **kw: posts.append(url) or ns(raise_for_status=lambda: None),
            exceptions=requests.exceptions,
        ),
        get_serving=lambda: ns(admin_api_key=None, api_key=None),
        ssl_verify_of=lambda server_args: True,
    )
    freeze_after(ns(url=lambda: "http://probe"))
    if posts != ["http://probe/freeze_gc"]:
        return False, f"{where}:_freeze_gc_after_server_warmup posted to {posts}, expected one POST /freeze_gc"

    # 3. POST /freeze_gc reaches TokenizerManager.freeze_gc
    routes = [r for r in H.app.routes if getattr(r, "path", None) == "/freeze_gc" and "POST" in (r.methods or ())]
    if len(routes) != 1:
        return False, f"{where}: {len(routes)} POST /freeze_gc routes on the app, expected 1"
    reached: list = []

    async def tm_freeze():
        reached.append("tokenizer_manager.freeze_gc")

    _drive(_rebind(routes[0].endpoint, _global_state=ns(tokenizer_manager=ns(freeze_gc=tm_freeze)))())
    if reached != ["tokenizer_manager.freeze_gc"]:
        return False, f"{where}: POST /freeze_gc handler did not call tokenizer_manager.freeze_gc ({reached})"

    # 4./5. the tokenizer manager and the scheduler call gc.freeze() through stock freeze_gc
    class _Gc:
        def __init__(self):
            self.froze = 0

        def freeze(self):
            self.froze += 1

        def set_threshold(self, *a):
            pass

        def __getattr__(self, name):
            import gc

            return getattr(gc, name)

    rec = _Gc()
    # its debug line's object counts (gc.get_objects of every generation, ~0.3 s in a server's main process)
    # are logging, not the behaviour probed: not walked at every start
    freeze_gc = _rebind(C.freeze_gc, gc=rec, gc_object_counts=lambda: (0, 0, 0))
    dispatched: list = []
    _drive(
        _rebind(TM.TokenizerManager.freeze_gc, freeze_gc=freeze_gc, get_device=lambda: ns(gc_threshold=None))(
            ns(_dispatch_to_scheduler=dispatched.append)
        )
    )
    if rec.froze != 1 or [type(d) for d in dispatched] != [io_struct.FreezeGCReq]:
        return False, (
            "TokenizerManager.freeze_gc: gc.freeze() ran "
            f"{rec.froze} times, dispatched {[type(d).__name__ for d in dispatched]} (expected 1 and FreezeGCReq)"
        )
    forwarded: list = []
    _rebind(S.Scheduler.handle_freeze_gc, freeze_gc=freeze_gc)(
        ns(ipc_channels=ns(send_to_detokenizer=ns(send_output=lambda *a: forwarded.append(a[0])))), dispatched[0]
    )
    if rec.froze != 2 or forwarded != [dispatched[0]]:
        return False, (
            f"Scheduler.handle_freeze_gc: gc.freeze() ran {rec.froze - 1} times, forwarded {len(forwarded)} "
            "requests to the detokenizer (expected 1 and 1)"
        )
    if not callable(getattr(D.DetokenizerManager, "handle_freeze_gc_req", None)):
        return False, "DetokenizerManager.handle_freeze_gc_req does not exist"
    return True, (
        f"{WAIT_AND_WARMUP} freezes the GC after server warm-up: POST /freeze_gc -> tokenizer manager, "
        "scheduler, detokenizer gc.freeze() (called)"
    )


UPSTREAM = [
    Feature(
        name="load-budget-throttle",
        area="ingress",
        description="DP controller refreshes its load budget at most every 20 ms",
        upstream_probe=_probe_load_budget_throttle,
        roles=frozenset({Role.CONTROLLER}),
    ),
    Feature(
        name="grammar-fsm-advance",
        area="dspark-masks",
        description="single idempotent spec-v2 grammar FSM advance (advance_grammar_fsm + barrier)",
        upstream_probe=_probe_advance_grammar_fsm_idempotent,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="skip-finishing-one-token",
        area="dspark-masks",
        description="one-token requests queued from a prefill are excluded from the overlap loop's decode merge",
        upstream_probe=_probe_one_token_excluded_from_decode_merge,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="dflash-request-validation",
        area="dspark-masks",
        description="validate_dflash_request applies to DSPARK (is_dflash_family) and refuses return_hidden_states",
        upstream_probe=_probe_validate_dflash_applies_to_dspark,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="prefill-graph-nested-trim",
        area="prefill-graph",
        description="prefill-graph output trimming (_slice_output_rows) keeps nested tuples and lists",
        upstream_probe=_probe_slice_output_rows_nested,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="dsv4-indexer-metadata-in-place",
        area="prefill-graph",
        description="DSV4 indexer capture metadata is refreshed in place (PagedIndexerMetadata.copy_)",
        upstream_probe=_probe_dsv4_indexer_metadata_copy_in_place,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="stock-gc-freeze-after-warmup",
        area="lifecycle",
        description="the HTTP server freezes the GC of tokenizer, schedulers and detokenizer after warm-up (PR #34999)",
        upstream_probe=_probe_gc_freeze_after_server_warmup,
        roles=frozenset({Role.MAIN}),
    ),
    Feature(
        name="logical-host-pool-destroy",
        area="lifecycle",
        description="LogicalHostPool.destroy() matches the host-pool-group teardown interface",
        upstream_probe=_probe_callable("sglang.srt.mem_cache.memory_pool_host:LogicalHostPool.destroy"),
        roles=frozenset({Role.SCHEDULER}),
    ),
]


@hookimpl
def dspark_features():
    return UPSTREAM
