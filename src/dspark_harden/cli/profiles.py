"""Deployment profiles for ``dspark-harden check --profile NAME``: the set of features a deployment needs,
each with the status it must reach in one process role; the check fails naming every one that does not.

A profile spans features, so it lives in the CLI core and names features by their (stable) names; the
features themselves are not imported. ``dsv4-dspark-dp2`` is the deployment of
docs/deploy-dsv4-dspark-dp2.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..core import feature as F


@dataclass(frozen=True)
class Need:
    feature: str
    status: str  # F.BOUND or F.UPSTREAM
    switch: Optional[str] = None  # what enables it (None: an upstream probe); the profile needs it exported as 1
    cuda: bool = False  # binds only on a CUDA host
    why: str = ""
    #: non-empty: the operator's choice, not a requirement. What the deployment loses without the feature and
    #: gains (printed as an ``OPTIONAL:`` line when it is not chosen). Chosen = the launch arguments given to
    #: ``check -- ...`` let it bind, or, without them, its switch is exported as 1; chosen, it is judged like
    #: any other need (bound, switch exported as 1)
    choice: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    role: str
    doc: str
    needs: tuple
    #: what this stock release does not do for the deployment, whatever the features say (``check --profile``
    #: prints each as a ``NOTE:`` line; tests/plugin/test_check_profile.py re-checks each on the live code)
    notes: tuple = ()

    def env(self) -> dict:
        """The switches the profile needs exported, each as ``1`` (default-on ones too: only an explicit 1
        makes startup refuse when the server's arguments leave the feature unavailable); an operator's choice
        (``Need.choice``) is exported only by the operator who chooses it."""
        return {n.switch: "1" for n in self.needs if n.switch and not n.choice}


DSV4_DSPARK_DP2 = Profile(
    name="dsv4-dspark-dp2",
    role="scheduler",
    doc="docs/deploy-dsv4-dspark-dp2.md",
    needs=(
        # opt-in: the deployment must switch these on
        Need(
            "dp2-native-exchange",
            F.BOUND,
            "SGLANG_DSPARK_DP2_SHM_MLP_SYNC",
            why="the per-step MLP-sync and DSpark verify-tier exchange between the two DP ranks",
        ),
        Need(
            "dspark-masks",
            F.BOUND,
            "DSPARK_HARDEN_DSPARK_MASKS",
            why="DSpark grammar draft masks from one batched native traversal per step",
        ),
        Need(
            "dspark-result-materializer",
            F.BOUND,
            "DSPARK_HARDEN_DSPARK_RESULTS",
            why="DSpark verify results materialized off the scheduler thread",
        ),
        Need(
            "dsv4-sparse-prefill-pool",
            F.BOUND,
            "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL",
            cuda=True,
            why="DSV4 sparse-prefill outputs from a pool reserved before capture",
        ),
        Need(
            "dsv4-inplace-q-norm-rope",
            F.BOUND,
            "DSPARK_HARDEN_DSV4_INPLACE_Q_NORM_ROPE",
            cuda=True,
            why="DSV4 Q norm + RoPE in place",
        ),
        Need(
            "dsv4-planner-guards",
            F.BOUND,
            "DSPARK_HARDEN_DSV4_PLANNER_GUARDS",
            cuda=True,
            why="bounds checks of the DSV4 compress planner",
        ),
        # the operator's choice: stock 0.5.23 turns the breakable prefill graph off for DSV4 by default (the c4
        # indexer scratch pinned in the capture pool OOMs, arg_groups/cuda_graph_hook.py); chosen with
        # --cuda-graph-backend-prefill breakable, and then exported as 1 like the rest
        Need(
            "prefill-graph-dp",
            F.BOUND,
            "DSPARK_HARDEN_PREFILL_GRAPH",
            why="one DP decision for prefill CUDA graphs, no rank-local eager fallback",
            choice="lost: prefill CUDA graphs and their one DP decision (prefill runs eager on both ranks, stock's "
            "DSV4 default; the replay gain for DSV4 is not measured); gained: no c4-indexer scratch pinned in the "
            "capture pool and a sparse-prefill reservation of the chunk instead of max(chunk, largest prefill bucket) "
            "(docs/deploy-dsv4-dspark-dp2.md, 'Prefill CUDA graphs: a choice'). To choose it: export "
            "DSPARK_HARDEN_PREFILL_GRAPH=1 and launch with --cuda-graph-backend-prefill breakable",
        ),
        # on by default; exported as 1 all the same (fail closed at startup)
        Need(
            "dspark-draft-graph-memory",
            F.BOUND,
            "DSPARK_HARDEN_DRAFT_GRAPH_MEMORY",
            why="one DSpark draft CUDA-graph capture decision for both ranks (stock decides per rank: a hang)",
        ),
        Need(
            "grammar-service",
            F.BOUND,
            "DSPARK_HARDEN_GRAMMAR",
            why="canonical keys, bounded LRU, one compile per key, persistent cache",
        ),
        Need(
            "atomic-routed-batch",
            F.BOUND,
            "DSPARK_HARDEN_ATOMIC_ROUTED_BATCH",
            why="a uniformly routed batch reaches its scheduler as one message",
        ),
        Need(
            "scheduler-phase-metrics",
            F.BOUND,
            "DSPARK_HARDEN_SCHEDULER_PHASE_METRICS",
            why="per-rank scheduler phase timings (the metrics that prove it)",
        ),
        Need("observability", F.BOUND, "DSPARK_HARDEN_METRICS", why="the per-rank metric registry"),
        Need("lifecycle-shutdown", F.BOUND, "DSPARK_HARDEN_LIFECYCLE", why="ordered, draining shutdown of both ranks"),
        Need("gc-freeze", F.BOUND, "DSPARK_HARDEN_GC_FREEZE", why="the warmed scheduler object graph frozen out of GC"),
        Need(
            "hostpool-teardown",
            F.BOUND,
            "DSPARK_HARDEN_HOSTPOOL_TEARDOWN",
            why="host-pool teardown that one failing pool cannot interrupt",
        ),
        # stock behaviour the others rely on (probed on the live code)
        Need("tbo-idle-rank-vote", F.UPSTREAM, why="an idle DP rank does not veto TBO"),
        Need("tbo-decode-graph-capture", F.UPSTREAM, why="decode-graph TBO capture off only when TBO is off"),
        Need("grammar-fsm-advance", F.UPSTREAM, why="the idempotent FSM advance the DSpark mask path relies on"),
        Need("dflash-request-validation", F.UPSTREAM, why="DSpark requests validated as the DFlash family"),
        Need("dsv4-indexer-metadata-in-place", F.UPSTREAM, why="captured DSV4 indexer tensors refreshed in place"),
    ),
    notes=(
        "TBO prefill graphs do not apply to DeepSeek V4 on sglang 0.5.23: DSPARK_HARDEN_PREFILL_GRAPH_TBO=1 "
        "covers only the full prefill backend, and stock DSV4 cannot capture or replay a full prefill graph "
        "(DeepseekV4AttnBackend.init_forward_metadata_out_graph raises NotImplementedError for EXTEND); this "
        "profile's breakable backend stays refused with --enable-two-batch-overlap: keep TBO off",
    ),
)

PROFILES = {p.name: p for p in (DSV4_DSPARK_DP2,)}


def evaluate(profile: Profile, report: Optional[dict], skip_cuda: bool = False, environ=None) -> dict:
    """Judge one role's raw check report (``_check_child``'s) against ``profile`` and the environment the
    check ran with: a problem per need not met, naming the feature, what it is and what to do."""
    environ = os.environ if environ is None else environ
    problems, met, skipped, optional = [], [], [], []
    feats = {f["name"]: f for f in (report or {}).get("features", [])}
    launched = bool((report or {}).get("launch"))  # `check -- <launch arguments>`: judged against them
    if report is None or not report.get("plugin_loaded"):
        errors = "; ".join((report or {}).get("errors", [])) or "no report"
        problems.append(f"the {profile.role} role did not load the plugin ({errors}): no feature of the profile bound")
        return {
            "name": profile.name,
            "role": profile.role,
            "ok": False,
            "problems": problems,
            "met": met,
            "skipped": skipped,
            "optional": optional,
            "notes": list(profile.notes),
        }
    for need in profile.needs:
        if need.cuda and skip_cuda:
            skipped.append(need.feature)
            continue
        feat = feats.get(need.feature)
        if feat is None:
            problems.append(
                f"{need.feature}: not evaluated in the {profile.role} role (is this dspark-harden "
                f"release the one the profile was written for?)"
            )
            continue
        status, detail = feat["status"], feat.get("detail") or ""
        what = f"{need.feature} ({need.why})"
        if need.choice:
            unchosen = _not_chosen(need, status, detail, launched, environ)
            if unchosen:
                optional.append(f"{need.feature} not chosen ({unchosen}): {need.choice}")
                continue
        if status == need.status:
            if need.switch and environ.get(need.switch) != "1":
                problems.append(
                    f"{what} binds by default, but {need.switch} is not exported as 1: only an explicit 1 makes "
                    f"startup refuse when the server's arguments leave the feature unavailable (unset, it is "
                    f"skipped as unavailable): export {need.switch}=1"
                )
                continue
            met.append(need.feature)
            continue
        if status == F.DISABLED:
            problems.append(f"{what} is disabled ({detail}): export {need.switch or feat.get('switch')}=1")
        elif status == F.UNAVAILABLE:
            problems.append(f"{what} is unavailable here: {detail}")
        else:
            bad = [f"{t['target']}: {t['detail']}" for t in feat.get("targets", []) if not t.get("bound")]
            problems.append(
                f"{what} is {status}, the profile needs it {need.status}: "
                + ("; ".join(bad) if bad else detail)
                + (
                    f" (it is the operator's choice in this profile: leave {need.switch} unset to go without it)"
                    if need.choice
                    else ""
                )
            )
    return {
        "name": profile.name,
        "role": profile.role,
        "ok": not problems,
        "problems": problems,
        "met": met,
        "skipped": skipped,
        "optional": optional,
        "notes": list(profile.notes),
    }


def _not_chosen(need: Need, status: str, detail: str, launched: bool, environ) -> Optional[str]:
    """Why the operator has not chosen ``need`` (``None``: chosen, judged like any need). Against launch
    arguments the feature's own verdict decides: ``unavailable`` (the arguments do not enable it) or switched
    off is not chosen, while ``bound`` (they enable it) or ``failed`` (its switch is 1 and they do not) is.
    Without them the check child binds every feature, so the switch decides: exported as 1 or not."""
    if status == F.UNAVAILABLE:
        return f"{'the launch arguments leave it unavailable' if launched else 'unavailable'}: {detail}"
    if status == F.DISABLED:
        return f"{need.switch}=0"
    if status == F.BOUND and not launched and environ.get(need.switch) != "1":
        return f"{need.switch} is not exported as 1 and no launch arguments were given (check ... -- ARGS)"
    return None
