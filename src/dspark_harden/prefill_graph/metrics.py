"""Metric families of the DP prefill-graph decision (``dspark_metrics`` hook of
:mod:`dspark_harden.prefill_graph.feature`) and the per-process recorder."""

from __future__ import annotations

from typing import Any

from ..core.metrics import DP_RANK, Family, MetricGroup
from .decision import FORWARD_CHECKS, REASONS
from .settings import FEATURE
from .validate import OUTCOMES as VALIDATION_OUTCOMES

OUTCOMES = ("graph", "eager", "eager_uniform")
#: checks that can fail identically on every rank after an admission (decision.uniform_failures)
UNIFORM_CHECKS = ("inactive_dp_rank", "num_tokens", "context_parallel")
TOKEN_KINDS = ("useful", "executed")
#: reasons that are a forward-time check folded into the vote, or the idle-participant rule:
#: an eager verdict for one of these is a split stock could have produced
PREVENTED = tuple(c for c in FORWARD_CHECKS if c not in ("dp_verdict", "can_run_graph")) + ("idle_participant",)
#: request-slot counts the seed labelled individually (bounded buckets: the full backend captures at most 256)
SLOT_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
BUCKET_EDGES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

GROUP = MetricGroup(
    "Prefill CUDA graphs (feature `prefill-graph-dp`)",
    (
        Family(
            "dspark_harden_prefill_graph_decisions_total",
            "counter",
            "Shared DP prefill-graph decisions of steps with an extend on any rank, by outcome and reason: "
            "`graph` / `admitted` (counted once the forward-time guard passed); `eager` with a shared reason "
            "(`peer_vote`, `padding`, `too_many_tokens`, `bucket_not_captured`, `idle_participant`, `no_tokens`), "
            "`stock_vote`, or the forward-time check that sent this rank's vote eager; `eager_uniform` with the "
            "forward-time check that failed identically on every rank after an admission (gathered or uniform "
            "inputs: every rank ran the step eager, as stock; see docs/prefill_graph.md).",
            labels=("dp_rank", "outcome", "reason"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK, "graph", "admitted"),)
            + tuple((DP_RANK, "eager", r) for r in REASONS if r != "admitted")
            + tuple((DP_RANK, "eager_uniform", c) for c in UNIFORM_CHECKS),
            aggregation="Per rank: both ranks count every step, and their `outcome` series are identical by "
            "construction; `reason` differs (the rank that vetoed names the check, its peer says "
            '`peer_vote`). Graph share: `sum(rate(x{outcome="graph"})) / sum(rate(x))` on one rank.',
        ),
        Family(
            "dspark_harden_prefill_graph_tokens_total",
            "counter",
            "Tokens of steps admitted to the prefill graph on this rank: `useful` (the rank's real extend "
            "tokens; 0 for an idle participant) and `executed` (the shared bucket it replayed).",
            labels=("dp_rank", "kind"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, k) for k in TOKEN_KINDS),
            aggregation='Padding overhead: `sum(rate(x{kind="executed"})) / sum(rate(x{kind="useful"})) - 1` '
            "(sum over ranks: an idle participant executes a whole bucket of padding).",
        ),
        Family(
            "dspark_harden_prefill_graph_bucket_tokens",
            "histogram",
            "The shared token bucket chosen for admitted steps (identical on both ranks).",
            labels=("dp_rank",),
            buckets=BUCKET_EDGES,
            feature=FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="Read one rank (the value is shared); `histogram_quantile(0.5, rate(x_bucket[5m]))`.",
        ),
        Family(
            "dspark_harden_prefill_graph_request_slots",
            "histogram",
            "Request slots each prefill-graph replay used on this rank: the requests of the replayed batch "
            "(its ForwardBatch.batch_size when the forward-time guard let it replay; the captured graph holds "
            "min(request slots, bucket tokens) of them, the rest are zero-length).",
            labels=("dp_rank",),
            buckets=SLOT_EDGES,
            feature=FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="Per rank (the ranks' batches differ): `histogram_quantile(0.99, sum by (le, dp_rank) "
            "(rate(x_bucket[5m])))` against the captured slots (docs/prefill_graph.md) shows how close replays come "
            "to the `request_slots` limit.",
        ),
        Family(
            "dspark_harden_prefill_graph_splits_prevented_total",
            "counter",
            "Steps sent eager on every rank because of a check stock evaluates only at forward time (or an "
            "idle participant's dummy extend that cannot replay the bucket): stock would have let this rank "
            "go eager alone while its peer replayed the graph.",
            labels=("dp_rank", "check"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, c) for c in PREVENTED),
            aggregation="`sum by (check) (increase(x[1h]))`; the rank whose own check fired counts it.",
        ),
        Family(
            "dspark_harden_prefill_graph_divergence_total",
            "counter",
            "Forward-time guard failures: a rank's own check rejected a graph the DP group agreed to replay "
            "(the step raised PrefillGraphDivergence instead of running eager alone). Should stay 0.",
            labels=("dp_rank", "check"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, c) for c in FORWARD_CHECKS),
            aggregation="`sum(increase(x[1h]))` over ranks: anything above 0 is a bug to report (docs/prefill_graph.md).",
        ),
        Family(
            "dspark_harden_prefill_graph_validations_total",
            "counter",
            "Prefill-graph replays validated against stock's eager forward of the same batch "
            "(DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE=N), by outcome: `match` or `mismatch` (outputs or touched "
            "KV / request-state rows differ beyond DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_TOLERANCE).",
            labels=("dp_rank", "outcome"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, o) for o in VALIDATION_OUTCOMES),
            aggregation='`sum(increase(x{outcome="mismatch"}[1h]))`: anything above 0 means a captured prefill '
            "differs from eager on this traffic (the log names bucket and geometry).",
        ),
    ),
    intro="From the two DP scheduler processes (`dp_rank` 0 / 1). Every step with an extend on any rank "
    "records one decision per rank; the outcome is the same on both ranks by construction. See "
    "[prefill_graph.md](prefill_graph.md).",
)


class Recorder:
    """Caches the label children of this process; called on the scheduler thread."""

    def __init__(self, dp_label: str):
        from ..core import metrics as M

        self._M = M
        self.dp = dp_label
        self._children: dict = {}

    def _c(self, name: str, *labels: Any):
        key = (name, labels)
        ch = self._children.get(key)
        if ch is None:
            ch = self._children[key] = self._M.child(name, self.dp, *labels)
        return ch

    def decision(self, dec, local_reason, useful_tokens: int) -> None:
        if dec.graph:
            self._c("dspark_harden_prefill_graph_decisions_total", "graph", "admitted").inc()
            self._c("dspark_harden_prefill_graph_tokens_total", "useful").inc(useful_tokens)
            self._c("dspark_harden_prefill_graph_tokens_total", "executed").inc(dec.bucket)
            self._c("dspark_harden_prefill_graph_bucket_tokens").observe(dec.bucket)
            return
        reason = dec.reason
        if reason == "peer_vote" and local_reason:
            reason = local_reason
        if reason not in REASONS:
            reason = "stock_vote"
        self._c("dspark_harden_prefill_graph_decisions_total", "eager", reason).inc()
        if reason in PREVENTED:
            self._c("dspark_harden_prefill_graph_splits_prevented_total", reason).inc()

    def uniform(self, check: str, pending) -> None:
        self._c("dspark_harden_prefill_graph_decisions_total", "eager_uniform", check).inc()

    def replay(self, request_slots: int) -> None:
        self._c("dspark_harden_prefill_graph_request_slots").observe(request_slots)

    def validation(self, outcome: str) -> None:
        self._c("dspark_harden_prefill_graph_validations_total", outcome).inc()

    def divergence(self, exc) -> None:
        self._c("dspark_harden_prefill_graph_divergence_total", exc.check).inc()


def attach(runtime: Any, *, dp_label: str) -> Recorder:
    rec = Recorder(dp_label)
    runtime.on_decision = rec.decision
    runtime.on_divergence = rec.divergence
    runtime.on_replay = rec.replay
    runtime.on_uniform = rec.uniform
    return rec
