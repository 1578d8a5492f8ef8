"""The one DP prefill-graph decision: named checks, schedule-time views, shared finalisation.

Shared by the feature's patches (:mod:`.admission`) and the bench (:mod:`.bench`); it imports
neither. Nothing here needs CUDA: every check is the stock ``PrefillCudaGraphRunner`` code
(``can_replay_locally``, ``_has_inactive_dp_rank``, the backend's ``can_run_prefill_cuda_graph``
hook, ``model_runner._prefill_cuda_graph_allows_context_parallel``) applied to a batch geometry.

Stock 0.5.23 evaluates part of these checks at schedule time (``_local_prefill_cuda_graph_vote``,
min-reduced through ``MLPSyncBatchInfo`` column ``can_run_prefill_cuda_graph``) and the rest only
at forward time (``can_run_graph`` + two conditions in ``ModelRunner._forward_raw``), where a
failing rank silently runs eager while its peer replays the graph. Here every forward-time check
is evaluated at schedule time on the geometry the rank will present at forward time
(:class:`PredictedForwardBatch`), folded into the same 0/1 vote column (so the stock gloo
all-gather and the native DP2 exchange carry it unchanged, bit-identical), and the token bucket,
the padding bound and the idle-participant validity are derived after the exchange from gathered
values only — the same answer on every rank by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# -- names (metric label values, error messages, docs) -----------------------------------------

#: every forward-time condition, in the order stock evaluates them
FORWARD_CHECKS = (
    "dp_verdict",  # can_run_graph: the DP group verdict says eager
    "inactive_dp_rank",  # can_run_graph: _has_inactive_dp_rank
    "cp_inactive",  # can_run_graph: CP breakable capture but CP inactive for this batch
    "request_slots",  # can_replay_locally: batch size > request slots / captured metadata bs
    "mm_inputs",  # can_replay_locally: multimodal inputs on a path that cannot replay them
    "lora",  # can_replay_locally: LoRA batch not eligible for the captured LoRA metadata
    "mixed",  # can_replay_locally: MIXED batch on a backend that prefers eager mixed prefill
    "input_embeds",  # can_replay_locally
    "replace_embeds",  # can_replay_locally
    "prefix",  # can_replay_locally: uncapturable prefix (MHA companion / chunked-prefix variants)
    "target_verify",  # can_replay_locally
    "capture_hidden_mode",  # can_replay_locally: batch needs more hidden states than captured
    "logprob_tail",  # can_replay_locally: logprobs without an eager logits tail
    "max_context",  # can_replay_locally: max_context_size / max_seq_len
    "num_tokens",  # can_replay_locally: tokens > largest bucket or local padding bound
    "replay_locally",  # can_replay_locally rejects although no single input does (interaction)
    "cp_bucket",  # can_run_graph: no CP replay bucket
    "backend_hook",  # can_run_graph: attention backend's can_run_prefill_cuda_graph
    "token_indices_to_pool",  # _forward_raw: multi-position pooling readout
    "context_parallel",  # _forward_raw: _prefill_cuda_graph_allows_context_parallel
    "can_run_graph",  # stock can_run_graph rejects although every named check passes
    "tbo_split",  # TBO prefill graphs: an admitted batch carries no TBO split (tbo_split_seq_index None)
)

#: outcomes decided after the exchange (identical on every rank)
SHARED_REASONS = (
    "admitted",  # graph
    "peer_vote",  # another rank voted eager
    "no_tokens",
    "too_many_tokens",  # global max above the largest captured bucket
    "bucket_not_captured",  # stock's padding bucket is not a captured size
    "padding",  # bucket > factor x global max
    "idle_participant",  # an idle rank's materialised dummy extend cannot replay this bucket
    "forward_mode",  # this rank runs no extend (decode, ...): its stock vote is eager
    "stock_vote",  # this rank's stock vote said eager for a reason no named check reproduces
    "tbo_unsynchronized",  # TBO prefill graphs: not every rank runs TBO this step (gathered TBO columns)
)

REASONS = tuple(dict.fromkeys(SHARED_REASONS + FORWARD_CHECKS))

DEFAULT_PADDING_FACTOR = 4.0
MAX_PADDING_FACTOR = 8.0
STOCK_PADDING_FACTOR = 2  # prefill_cuda_graph_runner._MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR in 0.5.23


class PrefillGraphDivergence(RuntimeError):
    """A rank's own forward-time checks reject a prefill graph the DP group agreed to replay.

    Raised instead of running eager alone (which mismatches the peer's collectives: a hang or
    wrong tokens). ``check`` names the first failing check (one of :data:`FORWARD_CHECKS`).
    """

    def __init__(self, *, check: str, failed: Sequence[str], dp_rank: Any, geometry: dict):
        self.check = check
        self.failed = tuple(failed)
        self.dp_rank = dp_rank
        self.geometry = geometry
        geo = ", ".join(f"{k}={v}" for k, v in geometry.items())
        super().__init__(
            f"prefill CUDA graph admission diverged on dp_rank {dp_rank}: the DP group agreed to replay "
            f"the prefill graph but this rank's check {check!r} rejects it (all failing checks: "
            f"{', '.join(self.failed)}); batch geometry: {geo}. Running eager here would mismatch the "
            f"peer's collectives, so the step fails instead. See docs/prefill_graph.md#troubleshooting."
        )


# -- the geometry a rank presents at forward time ----------------------------------------------


@dataclass
class PredictedForwardBatch:
    """The fields of a ``ForwardBatch`` that the prefill-graph checks read.

    Built at schedule time from a ``ScheduleBatch`` (:func:`schedule_view`) or for an idle rank's
    materialised dummy extend (:func:`dummy_extend_view`): the decision's prediction of the real
    ForwardBatch, compared field for field with it in tests/prefill_graph/test_real_forward_batch.py.
    ``input_ids`` is only ever measured (``len``); ``None`` at schedule time.
    """

    forward_mode: Any
    batch_size: int
    extend_seq_lens_cpu: list
    extend_prefix_lens_cpu: Optional[list]
    seq_lens_cpu: Any  # 1-D int64 CPU tensor
    capture_hidden_mode: Any
    return_logprob: bool = False
    extend_logprob_start_lens_cpu: Optional[list] = None
    input_embeds: Any = None
    replace_embeds: Any = None
    spec_info: Any = None
    token_indices_to_pool: Any = None
    mm_inputs: bool = False
    input_ids: Any = None
    global_num_tokens_cpu: Optional[list] = None
    can_run_dp_prefill_cuda_graph: bool = False
    global_forward_mode: Any = None
    _original_forward_mode: Any = None
    extend_num_tokens: Optional[int] = None
    seq_lens: Any = None
    dp_prefill_cuda_graph_max_prefix_len: int = 0
    extra: dict = field(default_factory=dict)

    def contains_mm_inputs(self) -> bool:
        return bool(self.mm_inputs)


class UnmodelledWorker(RuntimeError):
    """A speculative worker whose ``capture_hidden_mode`` override the decision does not model."""


#: speculative algorithm -> the capture mode its worker passes to ``ForwardBatch.init_new`` for the
#: target's prefill and idle-rank forwards (``DSparkWorkerV2.forward_batch_generation`` /
#: ``_forward_prefill``: FULL for both; fingerprinted in feature.MIRRORED)
WORKER_CAPTURE = {"NONE": None, "DSPARK": "FULL"}


def worker_capture_mode(spec_algorithm: Any) -> Any:
    """The capture mode this rank's worker passes to ``init_new`` (``None``: init_new derives it);
    :class:`UnmodelledWorker` for a speculative algorithm not in :data:`WORKER_CAPTURE`."""
    _, CaptureHiddenMode = _modes()
    name = "NONE" if spec_algorithm is None else getattr(spec_algorithm, "name", str(spec_algorithm))
    if name not in WORKER_CAPTURE:
        raise UnmodelledWorker(
            f"speculative algorithm {name}: its worker's capture_hidden_mode override for target prefill and "
            f"idle-rank forwards is not modelled by the prefill-graph decision (modelled: "
            f"{', '.join(WORKER_CAPTURE)})"
        )
    mode = WORKER_CAPTURE[name]
    return None if mode is None else CaptureHiddenMode[mode]


def _modes():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    return ForwardMode, CaptureHiddenMode


def _cpu_lens(values) -> Any:
    import torch

    return torch.tensor([int(v) for v in values], dtype=torch.int64)


def required_capture_hidden_mode(
    batch: Any, server_mode: Any, worker_mode: Any = None, *, is_draft_worker: bool = False
) -> Any:
    """The capture mode ``ForwardBatch.init_new`` gives ``batch``: the mode the rank's worker passes
    (``worker_mode``, e.g. DSpark's FULL for target prefill and idle ranks), else its own
    derivation: NULL on a draft runner, else max(batch request mode, server mode), raised to the
    batch's speculative input's mode (stock ``get_required_capture_hidden_mode``)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, get_required_capture_hidden_mode

    if worker_mode is not None:
        return worker_mode
    request = (
        CaptureHiddenMode.NULL
        if is_draft_worker
        else max(getattr(batch, "return_hidden_states_mode", None) or CaptureHiddenMode.NULL, server_mode)
    )
    return get_required_capture_hidden_mode(request, getattr(batch, "spec_info", None))


def schedule_view(
    batch: Any, *, server_mode: Any, decode_as_extend: bool = False, worker_mode: Any = None
) -> Optional[PredictedForwardBatch]:
    """What ``batch`` (a ``ScheduleBatch``) becomes at forward time, before DP padding.

    EXTEND / MIXED: ``ForwardBatch.init_new`` of the batch itself. DECODE with
    ``decode_as_extend`` (the breakable backend's ``convert_decode_to_extend`` after a shared graph
    verdict): one 1-token extend per row over its context, logprob start 0. Anything else:
    ``None`` (stock's vote already says eager for it). ``worker_mode``: the capture mode the rank's
    worker passes to ``init_new`` (``None``: init_new derives it)."""
    ForwardMode, CaptureHiddenMode = _modes()
    mode = batch.forward_mode
    reqs = list(getattr(batch, "reqs", None) or ())
    # ForwardBatch._maybe_init_non_generation_fields: set only for prefill-only batches in which
    # every request carries it (the scheduler keeps readout batches homogeneous)
    pool = (
        [list(r.token_indices_to_pool) for r in reqs]
        if reqs
        and getattr(batch, "is_prefill_only", False)
        and all(getattr(r, "token_indices_to_pool", None) is not None for r in reqs)
        else None
    )
    capture = required_capture_hidden_mode(batch, server_mode, worker_mode)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        seq = batch.seq_lens_cpu
        if seq is None:
            seq = _cpu_lens(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens))
        return PredictedForwardBatch(
            forward_mode=mode,
            batch_size=batch.batch_size(),
            extend_seq_lens_cpu=[int(n) for n in batch.extend_lens],
            extend_prefix_lens_cpu=[int(n) for n in batch.prefix_lens],
            seq_lens_cpu=seq,
            capture_hidden_mode=capture,
            return_logprob=bool(batch.return_logprob),
            extend_logprob_start_lens_cpu=list(getattr(batch, "extend_logprob_start_lens", None) or []),
            input_embeds=batch.input_embeds,
            replace_embeds=getattr(batch, "replace_embeds", None),
            spec_info=getattr(batch, "spec_info", None),
            token_indices_to_pool=pool,
            mm_inputs=any(
                m is not None and m.contains_mm_input() for m in (getattr(batch, "multimodal_inputs", None) or ())
            ),
            extend_num_tokens=getattr(batch, "extend_num_tokens", None),
        )
    if mode.is_decode() and decode_as_extend:
        seq = [int(s) for s in batch.seq_lens_cpu.tolist()]
        return PredictedForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(seq),
            extend_seq_lens_cpu=[1] * len(seq),
            extend_prefix_lens_cpu=[s - 1 for s in seq],
            seq_lens_cpu=_cpu_lens(seq),
            capture_hidden_mode=capture,
            extend_logprob_start_lens_cpu=[0] * len(seq),
            spec_info=getattr(batch, "spec_info", None),
            token_indices_to_pool=None,  # convert_decode_to_extend clears is_prefill_only
            extend_num_tokens=len(seq),
        )
    return None


def dummy_extend_view(bucket: int, *, server_mode: Any, worker_mode: Any = None) -> PredictedForwardBatch:
    """An idle rank at forward time under MAX_LEN padding: stock's
    ``ForwardBatch.prepare_mlp_sync_batch`` materialises one dummy request covering the bucket
    (seq_lens = extend = [bucket], prefix 0, mode EXTEND relabelled from IDLE); its capture mode is
    what ``init_new`` gave the idle batch (the worker's, else the server's)."""
    ForwardMode, CaptureHiddenMode = _modes()

    return PredictedForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        _original_forward_mode=ForwardMode.IDLE,
        batch_size=1,
        extend_seq_lens_cpu=[int(bucket)],
        extend_prefix_lens_cpu=[0],
        seq_lens_cpu=_cpu_lens([bucket]),
        capture_hidden_mode=required_capture_hidden_mode(None, server_mode, worker_mode),
        extend_logprob_start_lens_cpu=[0],
        input_ids=range(int(bucket)),
        extend_num_tokens=int(bucket),
    )


def at_bucket(view: PredictedForwardBatch, bucket: int, n_ranks: int = 2) -> PredictedForwardBatch:
    """A busy rank's view as MAX_LEN padding presents it to the guard: input ids padded to the
    shared bucket, the gathered table all ``bucket``, the shared graph verdict (stock
    ``prepare_mlp_sync_batch`` changes nothing else on an EXTEND / MIXED batch)."""
    out = PredictedForwardBatch(**{**view.__dict__, "extra": dict(view.extra)})
    out.input_ids = range(int(bucket))
    out.global_num_tokens_cpu = [int(bucket)] * n_ranks
    out.can_run_dp_prefill_cuda_graph = True
    out.extend_num_tokens = int(bucket)
    return out


# -- the checks ---------------------------------------------------------------------------------

_NEUTRAL = dict(
    batch_size=1,
    num_tokens=None,
    input_embeds=None,
    replace_embeds=None,
    prefix_lens=None,
    is_target_verify=False,
    capture_hidden_mode=None,
    return_logprob=False,
    lora_ineligible=False,
    is_mixed=False,
    batch_max_context_len=0,
    contains_mm_inputs=False,
)
# can_replay_locally argument -> the check it decides
_ARG_CHECK = (
    ("batch_size", "request_slots"),
    ("contains_mm_inputs", "mm_inputs"),
    ("lora_ineligible", "lora"),
    ("is_mixed", "mixed"),
    ("input_embeds", "input_embeds"),
    ("replace_embeds", "replace_embeds"),
    ("prefix_lens", "prefix"),
    ("is_target_verify", "target_verify"),
    ("capture_hidden_mode", "capture_hidden_mode"),
    ("return_logprob", "logprob_tail"),
    ("batch_max_context_len", "max_context"),
    ("num_tokens", "num_tokens"),
)


def replay_args(runner: Any, fb: Any, *, num_tokens: Optional[int], schedule_time: bool) -> dict:
    """The arguments stock ``can_run_graph`` passes to ``can_replay_locally`` (0.5.23, verbatim).

    At schedule time LoRA eligibility is stock's vote rule (``enable_lora``: under DP attention
    ``LoRAManager.can_use_prefill_cuda_graph`` is always False, so LoRA prefill is eager on
    every rank)."""
    ForwardMode, _ = _modes()
    batch_max_context_len = (
        runner._batch_max_context_len(fb)
        if runner.max_context_size is not None or runner.max_seq_len is not None
        else None
    )
    if schedule_time:
        lora_ineligible = bool(runner.enable_lora)
    else:
        lora_ineligible = runner.enable_lora and not (
            runner._capture_lora and runner.model_runner.lora_manager.can_use_prefill_cuda_graph(fb)
        )
    return dict(
        batch_size=fb.batch_size,
        num_tokens=num_tokens,
        input_embeds=fb.input_embeds,
        replace_embeds=fb.replace_embeds,
        prefix_lens=fb.extend_prefix_lens_cpu,
        is_target_verify=fb.forward_mode.is_target_verify(),
        capture_hidden_mode=fb.capture_hidden_mode,
        return_logprob=fb.return_logprob,
        contains_mm_inputs=fb.contains_mm_inputs(),
        lora_ineligible=lora_ineligible,
        is_mixed=any(
            getattr(fb, name, None) == ForwardMode.MIXED
            for name in ("forward_mode", "global_forward_mode", "_original_forward_mode")
        ),
        batch_max_context_len=batch_max_context_len,
    )


def local_failures(runner: Any, fb: Any, *, num_tokens: Optional[int], schedule_time: bool) -> list:
    """Every failing rank-local forward-time check for ``fb`` on ``runner`` (empty: replays).

    ``num_tokens`` is what the rank presents at forward time (``len(input_ids)``: the padded
    bucket under MAX_LEN); ``None`` at schedule time, where the shared finalisation decides
    tokens. Fast path: one full ``can_replay_locally`` call; only a rejection is decomposed
    (one call per input, all others neutral) to name the check."""
    from sglang.srt.model_executor import model_runner as mr_mod

    fails: list = []
    cp_bcg = bool(getattr(runner, "enable_cp_bcg_capture", False))
    if cp_bcg:
        if schedule_time:
            fails.append("cp_inactive")  # not decidable before the exchange: vote eager
        else:
            from sglang.srt.layers.cp.utils import is_cp_active

            if not is_cp_active(fb):
                fails.append("cp_inactive")
    args = replay_args(runner, fb, num_tokens=num_tokens, schedule_time=schedule_time)
    if not runner.can_replay_locally(**args):
        named = [check for arg, check in _ARG_CHECK if not runner.can_replay_locally(**{**_NEUTRAL, arg: args[arg]})]
        fails.extend(named or ["replay_locally"])
    if cp_bcg and not schedule_time and not fails:
        from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as pcg

        if (
            runner.prefill_cp_bcg_input.select_replay_bucket_for_batch(
                num_tokens=len(fb.input_ids),
                extend_seq_lens=fb.extend_seq_lens_cpu,
                capture_num_tokens=runner.capture_num_tokens,
                max_padding_factor=pcg._MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR,
            )
            is None
        ):
            fails.append("cp_bucket")
    hook = runner._backend_can_run_prefill_cuda_graph
    if hook is not None:
        try:
            ok = bool(hook(fb))
        except Exception:  # noqa: BLE001 - a hook reading a field the view lacks: cannot prove it, vote eager
            if not schedule_time:
                raise
            ok = False
        if not ok:
            fails.append("backend_hook")
    if fb.token_indices_to_pool is not None:
        fails.append("token_indices_to_pool")
    if schedule_time:
        from sglang.srt.layers.cp.utils import get_cp_strategy

        if get_cp_strategy() is not None and "cp_inactive" not in fails:
            fails.append("context_parallel")
    elif not mr_mod._prefill_cuda_graph_allows_context_parallel(runner, fb):
        fails.append("context_parallel")
    return fails


def uniform_failures(runner: Any, fb: Any, fails: Sequence[str]) -> list:
    """The failing checks whose inputs are gathered or process-uniform, so every rank of the step
    fails them identically: ``inactive_dp_rank`` (the gathered token table), ``num_tokens`` when
    this rank's token count is the one every rank presents (MAX_LEN: the whole table equals it),
    ``context_parallel`` when it is decided by the CP configuration alone. A failure among these is
    not a divergence: every rank runs eager, as stock would."""
    n = None if getattr(fb, "input_ids", None) is None else len(fb.input_ids)
    table = getattr(fb, "global_num_tokens_cpu", None)
    same_tokens = n is not None and table is not None and len(table) > 0 and all(int(x) == n for x in table)
    out = []
    for check in fails:
        if check == "inactive_dp_rank":
            out.append(check)
        elif check == "num_tokens" and same_tokens:
            out.append(check)
        elif check == "context_parallel" and not getattr(runner, "enable_cp_bcg_capture", False):
            out.append(check)
    return out


def idle_relabels_to_target_verify(model_config: Any, spec_algorithm: Any) -> bool:
    """Whether stock ``prepare_mlp_sync_batch`` may turn an idle rank's batch into a TARGET_VERIFY
    batch (not the dummy extend): a hybrid-SSM model (``mambaish_config``) whose idle batch carries a
    speculative, non-draft input. No prefill graph replays TARGET_VERIFY, so such an idle rank
    cannot participate; the decision does not predict the idle batch's speculative input, so it
    keeps every idle rank of such a deployment out (both ranks eager: ``idle_participant``)."""
    if spec_algorithm is None or getattr(spec_algorithm, "is_none", lambda: True)() or model_config is None:
        return False
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(model_config) is not None


# -- shared finalisation ------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedDecision:
    graph: bool
    bucket: Optional[int]  # the token bucket every rank pads to (None: eager)
    reason: str  # one of SHARED_REASONS
    max_tokens: int = 0
    detail: str = ""


_STOCK_PADDING: dict = {}
_STOCK_PADDING_LOCK = __import__("threading").Lock()


def _stock_padding_code() -> dict:
    """The MAX_LEN condition and the bucket expression of stock
    ``ForwardBatch.prepare_mlp_sync_batch`` (L1795-1810), compiled from the live source: the
    decision evaluates stock's own code, not a copy (its fingerprint is checked at bind time)."""
    if _STOCK_PADDING:
        return _STOCK_PADDING
    with _STOCK_PADDING_LOCK:
        return _compile_stock_padding()


def _compile_stock_padding() -> dict:
    if _STOCK_PADDING:
        return _STOCK_PADDING
    import ast
    import inspect
    import textwrap

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    tree = ast.parse(textwrap.dedent(inspect.getsource(ForwardBatch.prepare_mlp_sync_batch)))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "can_run_dp_prefill_cuda_graph" in ast.unparse(node.test):
            assigns = [
                st
                for st in node.body
                if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "bucket" for t in st.targets)
            ]
            if len(assigns) == 1:
                _STOCK_PADDING["max_len"] = compile(ast.Expression(node.test), "<stock prepare_mlp_sync_batch>", "eval")
                _STOCK_PADDING["bucket"] = compile(
                    ast.Expression(assigns[0].value), "<stock prepare_mlp_sync_batch>", "eval"
                )
                return _STOCK_PADDING
    raise RuntimeError("ForwardBatch.prepare_mlp_sync_batch no longer picks a shared prefill-graph bucket")


def stock_bucket(bs: Sequence[int], max_tokens: int) -> Optional[int]:
    """Stock's shared bucket: ``min(size for size in prefill_cg.bs if size >= max(global_num_tokens))``
    (evaluated from the stock source), or ``None`` when no size fits."""
    if not bs or max_tokens > max(bs):
        return None
    ns = {"prefill_cg": _Bs(list(bs)), "global_num_tokens": [int(max_tokens)], "min": min, "max": max}
    return eval(_stock_padding_code()["bucket"], ns)  # noqa: S307 - stock's own expression


def stock_forces_max_len(
    *,
    verdict: bool,
    is_extend_in_batch: bool,
    bs: Sequence[int],
    global_num_tokens: Sequence[int],
    tolerates_sum_len: bool = False,
) -> bool:
    """Stock's condition for MAX_LEN padding to one shared bucket (evaluated from the stock source)."""
    me = _Flags(can_run_dp_prefill_cuda_graph=verdict, is_extend_in_batch=is_extend_in_batch)
    ns = {
        "self": me,
        "prefill_cg": _Bs(list(bs)),
        "global_num_tokens": list(global_num_tokens),
        "max": max,
        "prefill_graph_tolerates_sum_len": lambda: tolerates_sum_len,
    }
    return bool(eval(_stock_padding_code()["max_len"], ns))  # noqa: S307 - stock's own expression


@dataclass(frozen=True)
class _Bs:
    bs: list


@dataclass(frozen=True)
class _Flags:
    can_run_dp_prefill_cuda_graph: bool
    is_extend_in_batch: bool


def finalize(
    global_num_tokens: Sequence[int],
    *,
    vote: bool,
    runner: Any,
    bs: Sequence[int],
    factor: float,
    server_mode: Any,
    attn_tp_size: int = 1,
    worker_mode: Any = None,
    idle_relabel: bool = False,
) -> SharedDecision:
    """The verdict and bucket, from gathered values and process-uniform configuration only.

    ``vote`` is the min-reduced column (every forward-time check of every busy rank);
    ``bs`` is ``cuda_graph_config.prefill.bs`` (the list stock pads to), ``runner`` supplies
    the captured sizes and the checks an idle participant's dummy extend must pass."""
    aligned = [-(-int(n) // attn_tp_size) * attn_tp_size for n in global_num_tokens]
    n_max = max(aligned, default=0)
    if not vote:
        return SharedDecision(False, None, "peer_vote", n_max)
    if n_max <= 0:
        return SharedDecision(False, None, "no_tokens", n_max)
    if not bs or n_max > max(bs) or n_max > runner.max_num_tokens:
        return SharedDecision(False, None, "too_many_tokens", n_max)
    bucket = stock_bucket(bs, n_max)
    if bucket not in runner.capture_num_tokens:
        return SharedDecision(False, None, "bucket_not_captured", n_max, f"bucket {bucket} not captured")
    if bucket > factor * n_max:
        return SharedDecision(False, None, "padding", n_max, f"bucket {bucket} > {factor} x {n_max}")
    if len(aligned) > 1 and any(int(n) == 0 for n in global_num_tokens):
        if idle_relabel:
            return SharedDecision(
                False,
                None,
                "idle_participant",
                n_max,
                "hybrid-SSM speculative: stock relabels the idle batch IDLE -> TARGET_VERIFY",
            )
        fails = local_failures(
            runner,
            dummy_extend_view(bucket, server_mode=server_mode, worker_mode=worker_mode),
            num_tokens=bucket,
            schedule_time=True,
        )
        if fails:
            return SharedDecision(False, None, "idle_participant", n_max, f"dummy extend fails {fails}")
    return SharedDecision(True, bucket, "admitted", n_max)


def geometry(fb: Any) -> dict:
    """Bounded description of a batch for error messages."""

    def short(xs, n=8):
        xs = list(xs or [])
        return xs if len(xs) <= n else xs[:n] + [f"...+{len(xs) - n}"]

    ids = getattr(fb, "input_ids", None)
    seq = getattr(fb, "seq_lens_cpu", None)
    return {
        "forward_mode": getattr(getattr(fb, "forward_mode", None), "name", None),
        "batch_size": getattr(fb, "batch_size", None),
        "num_tokens": None if ids is None else len(ids),
        "extend_lens": short(getattr(fb, "extend_seq_lens_cpu", None)),
        "prefix_lens": short(getattr(fb, "extend_prefix_lens_cpu", None)),
        "max_seq_len": None if seq is None or len(seq) == 0 else int(max(int(s) for s in seq)),
        "global_num_tokens": list(getattr(fb, "global_num_tokens_cpu", None) or []),
        "capture_hidden_mode": getattr(getattr(fb, "capture_hidden_mode", None), "name", None),
        "return_logprob": bool(getattr(fb, "return_logprob", False)),
    }
