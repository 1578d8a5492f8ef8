"""The DSpark grammar-mask feature's metric families (emitted per DSpark verify step that has a
grammar), exported through :func:`dspark_harden.dspark_masks.feature.dspark_metrics`."""

from __future__ import annotations

from ..core.metrics import DP_RANK, Family, MetricGroup
from .settings import DRAFT_FEATURE, DRAFT_SWITCH, FEATURE

DSPARK_MASK_PHASES = ("barrier", "buffer_wait", "draft_copy_wait", "resolution", "traversal", "mask_upload", "total")
DSPARK_MASK_OUTCOMES = ("masked", "thinking_only")
# engines a scheduler can run (``auto`` resolves to one of them at start-up)
DSPARK_MASK_ENGINES = ("batch", "native", "scalar", "threads", "level")

GROUP = MetricGroup(
    "DSpark grammar masks (feature `dspark-masks`)",
    (
        Family(
            "dspark_harden_dspark_mask_phase_seconds",
            "histogram",
            "Host seconds per DSpark grammar-mask step phase: barrier (upstream FSM advance), buffer_wait "
            "(slot's previous upload still reading the pinned buffer), draft_copy_wait (D2H of the draft chain), "
            "resolution (grammar objects -> matchers/roots), traversal (native batched traversal), mask_upload "
            "(H2D enqueue on the copy stream), total.",
            labels=("dp_rank", "phase"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, p) for p in DSPARK_MASK_PHASES),
            aggregation="`sum by (phase) (rate(..._sum[5m]))` for where time goes; keep `dp_rank` to compare ranks (a rank with more grammar requests traverses longer and delays the DP collective).",
        ),
        Family(
            "dspark_harden_dspark_mask_active_matchers",
            "gauge",
            "Grammar matchers traversed in the latest DSpark verify step (requests in thinking phase without "
            "a think-end inside the draft are not active).",
            labels=("dp_rank",),
            multiprocess_mode="mostrecent",
            feature=FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum` over `dp_rank` for the fleet; per rank as is.",
        ),
        Family(
            "dspark_harden_dspark_mask_steps_total",
            "counter",
            "DSpark verify steps with a grammar by outcome: masked (mask uploaded and applied) or thinking_only "
            "(no active matcher: no mask, logits untouched).",
            labels=("dp_rank", "outcome"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, o) for o in DSPARK_MASK_OUTCOMES),
            aggregation="`sum by (outcome) (rate(...))`.",
        ),
        Family(
            "dspark_harden_dspark_mask_engine",
            "gauge",
            "1 for the draft-tree traversal engine this scheduler opened at start-up (DSPARK_HARDEN_GRAMMAR_TRAVERSAL, "
            "`auto` resolved: batch or native, never scalar unless named), 0 for the others.",
            labels=("dp_rank", "engine"),
            multiprocess_mode="mostrecent",
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, e) for e in DSPARK_MASK_ENGINES),
            aggregation="`max by (engine) (...)` for the fleet; keep `dp_rank` to find a rank whose `scalar` series "
            "is 1 (the slower Python engine, named by the operator).",
        ),
    ),
    intro="Emitted by scheduler processes on every DSpark verify step whose batch has a grammar (the engine "
    "gauge once at start-up), only when `DSPARK_HARDEN_DSPARK_MASKS=1`. `dp_rank` is the scheduler's DP rank (`none` without DP). See "
    "[dspark_masks.md](dspark_masks.md).",
)


DRAFT_GROUP = MetricGroup(
    "DSpark grammar-aware drafting (feature `dspark-draft-masks`)",
    (
        Family(
            "dspark_harden_dspark_draft_masked_tokens_total",
            "counter",
            "DSpark draft positions drawn under a grammar mask (one per constrained row and draft step while the "
            "row's grammar is live).",
            labels=("dp_rank",),
            feature=DRAFT_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum(rate(...))` for the fleet; per `dp_rank` to compare ranks.",
        ),
        Family(
            "dspark_harden_dspark_draft_blocks_cut_total",
            "counter",
            "DSpark draft blocks in which a constrained row stopped being masked before the block's last step: "
            "its draft ended the grammar (or left it), so the target rejects the rest of that row's block.",
            labels=("dp_rank",),
            feature=DRAFT_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum(rate(...))`.",
        ),
        Family(
            "dspark_harden_dspark_accept_length",
            "histogram",
            "Tokens committed per DSpark verify row (accepted draft tokens + the bonus token), by request kind: "
            "constrained (a grammar) or free.",
            labels=("dp_rank", "kind"),
            buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16),
            feature=DRAFT_FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, k) for k in ("constrained", "free")),
            aggregation="`sum by (kind) (rate(..._sum[5m])) / sum by (kind) (rate(..._count[5m]))` is the mean "
            "accept length per kind.",
        ),
    ),
    intro=f"Emitted by scheduler processes on DSpark decode steps, only when `{DRAFT_SWITCH}=1`. See "
    "[dspark_masks.md](dspark_masks.md).",
)


def publish_engine(engine: str, dp_label: str) -> None:
    """Set the engine gauge of this scheduler: 1 for ``engine``, 0 for every other one."""
    from ..core import metrics

    gauge = metrics.get("dspark_harden_dspark_mask_engine")
    for e in DSPARK_MASK_ENGINES:
        gauge.labels(dp_label, e).set(1 if e == engine else 0)
