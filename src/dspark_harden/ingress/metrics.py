"""The atomic-routed-batch feature's metric families (DP controller and schedulers), exported
through :func:`dspark_harden.ingress.feature.dspark_metrics`."""

from __future__ import annotations

from ..core.metrics import DP_RANK, Family, MetricGroup
from .settings import ATOMIC as FEATURE

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

GROUP = MetricGroup(
    "Ingress (feature `atomic-routed-batch`)",
    (
        Family(
            "dspark_harden_atomic_batches_total",
            "counter",
            "Uniformly routed batches the DP controller sent to one DP rank as ONE ZMQ message.",
            labels=("dp_rank",),
            feature=FEATURE,
            roles=("controller",),
            aggregation="`sum by (dp_rank) (rate(...))`; one controller per server, so no double counting.",
        ),
        Family(
            "dspark_harden_atomic_batch_requests",
            "histogram",
            "Number of requests in each atomic routed batch the DP controller sent.",
            labels=("dp_rank",),
            buckets=BATCH_SIZE_BUCKETS,
            feature=FEATURE,
            roles=("controller",),
            aggregation="`histogram_quantile(0.5, sum by (le, dp_rank) (rate(..._bucket[5m])))`; `_sum` / `_count` = mean size.",
        ),
        Family(
            "dspark_harden_route_rejections_total",
            "counter",
            "Requests the DP controller answered with HTTP 400 because their routed_dp_rank cannot be "
            "sent to (reason: out_of_range, inactive, no_socket); stock would crash the server.",
            labels=("reason",),
            feature=FEATURE,
            roles=("controller",),
            precreate=(("out_of_range",), ("inactive",), ("no_socket",)),
            aggregation="`sum by (reason) (increase(...))`; any increase deserves a look at the router's rank map.",
        ),
        Family(
            "dspark_harden_scheduler_batch_messages_total",
            "counter",
            "Batch request messages (BatchTokenizedGenerateReqInput) a DP scheduler received; each is "
            "one scheduling opportunity for all its requests.",
            labels=("dp_rank",),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum by (dp_rank) (rate(...))`; compare with `dspark_harden_atomic_batches_total` (equal when every batch message came through the controller).",
        ),
        Family(
            "dspark_harden_scheduler_batch_message_requests",
            "histogram",
            "Number of requests in each batch message a DP scheduler received.",
            labels=("dp_rank",),
            buckets=BATCH_SIZE_BUCKETS,
            feature=FEATURE,
            roles=("scheduler",),
            aggregation="Quantiles as above; keep `dp_rank` in `by`.",
        ),
    ),
    intro="Controller families come from the DP controller process, scheduler families from each DP "
    "scheduler (first attention-TP rank of its DP group). Ranks outside `[0, dp_size)` are already "
    "refused by the tokenizer with 400 and never reach the controller. See [ingress.md](ingress.md).",
)
