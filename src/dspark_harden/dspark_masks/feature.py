"""Feature ``dspark-masks``: settings, the two DSpark-only patches, start-up checks, bench CLI.

Opt-in (``DSPARK_HARDEN_DSPARK_MASKS=1``). Patches (scheduler role, fingerprinted against sglang
0.5.23, ``propagate=False`` so only the DSpark worker module sees them):

* ``dspark_worker_v2:GrammarTree`` -> a subclass whose ``from_linear_chain`` begins a pipeline step;
* ``dspark_worker_v2:build_grammar_vocab_mask`` -> barrier (upstream), one native batched traversal,
  double-buffered upload on a copy stream.

EAGLE (``eagle_worker_common``), NGRAM (``ngram_worker``) and DFlash (``dflash_worker_v2``) keep
their own references to the stock objects.
"""

from __future__ import annotations

import logging
from typing import Any

from ..core.feature import Feature, bound_status
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from .settings import (  # noqa: F401 - re-exported
    DRAFT_FEATURE,
    DRAFT_SWITCH,
    ENGINE,
    ENGINES,
    FEATURE,
    SETTINGS,
    SWITCH,
    THREADS,
)

logger = logging.getLogger("dspark_harden.dspark_masks")


@hookimpl
def dspark_metrics():
    from .metrics import DRAFT_GROUP, GROUP

    return [GROUP, DRAFT_GROUP]


@hookimpl
def dspark_features():
    return [
        Feature(
            name=FEATURE,
            area="dspark-masks",
            description="DSpark grammar masks: one batched native draft-chain traversal per verify step, "
            "double-buffered pinned slots uploaded on a copy stream (stock-identical masks)",
            switch=SWITCH,
            default_on=False,
            available=_available,
            roles=frozenset({Role.SCHEDULER}),
        ),
        Feature(
            name=DRAFT_FEATURE,
            area="dspark-masks",
            description="grammar-aware DSpark drafting: each draft step of a constrained request draws only "
            "from the tokens its grammar allows after the block's earlier draft tokens",
            switch=DRAFT_SWITCH,
            default_on=False,
            roles=frozenset({Role.SCHEDULER}),
        ),
    ]


def _available(settings: Any):
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"xgrammar is not importable: {exc}"
    if settings[ENGINE] == "auto":
        from .traversal import auto_unavailable_reason

        reason = auto_unavailable_reason()
        if reason:
            return reason
    if settings[ENGINE] == "native":
        from .traversal import native_unavailable_reason

        reason = native_unavailable_reason()
        if reason:
            return f"{ENGINE}=native: {reason}"
    if settings[ENGINE] == "batch":
        from .traversal import batch_traverse_available

        if not batch_traverse_available():
            return (
                f"{ENGINE}=batch needs xgrammar.BatchGrammarMatcher.batch_traverse_draft_tree, which the "
                f"installed xgrammar does not have"
            )
    return None


@hookimpl
def dspark_settings():
    return list(SETTINGS)


def patches(role: Role, settings: Any) -> list:
    if role is not Role.SCHEDULER:
        return []
    return _verify_patches(settings) + _draft_patches(settings)


def _draft_patches(settings: Any) -> list:
    if not settings[DRAFT_SWITCH]:
        return []
    from . import draft as D

    D.configure(settings[THREADS])
    why = "stock DSpark drafts freely and masks only the verify: on a constrained request every draft token the "
    why += "grammar forbids is a certain rejection (this wrap: {})"
    return [
        Patch(
            target=target,
            kind=Kind.WRAP,
            build=build,
            fingerprint=fingerprint,
            why=why.format(what),
            retire_when="SGLang's DSpark path masks its draft steps with the request's grammar",
            feature=DRAFT_FEATURE,
            roles={Role.SCHEDULER},
            propagate=False,
        )
        for target, build, fingerprint, what in (
            (
                D.FORWARD_TARGET,
                D.wrap_forward_decode,
                D.FORWARD_FINGERPRINT,
                "the grammar barrier before the draft, the batch's grammars for it, accept lengths by request kind",
            ),
            (
                D.BLOCK_TARGET,
                D.wrap_markov_block,
                D.BLOCK_FINGERPRINT,
                "one block's grammar rows, rolled back at its end",
            ),
            (D.STEP_TARGET, D.wrap_draft_step, D.STEP_FINGERPRINT, "each step's base logits masked"),
        )
    ]


def _verify_patches(settings: Any) -> list:
    if not settings[SWITCH]:
        return []
    from . import integration as I

    I.configure(settings[ENGINE], settings[THREADS])
    allow = tuple(settings["DSPARK_HARDEN_ALLOW_DRIFT"])
    tree_ref: dict = {}

    def build_tree(stock):
        I.check_semantic_pins(allow)
        cls = I.build_tree_class(stock)
        tree_ref["cls"] = cls
        return cls

    def build_mask(stock):
        I.check_semantic_pins(allow)
        return I.build_vocab_mask_function(stock, tree_ref)

    common = dict(feature=FEATURE, roles={Role.SCHEDULER}, propagate=False)
    return [
        Patch(
            target=I.TREE_TARGET,
            kind=Kind.REPLACE,
            build=build_tree,
            fingerprint=I.TREE_FINGERPRINT,
            why="stock DSpark copies the draft chain with a fresh pageable D2H on the compute stream; the "
            "pipeline copies it into a pinned slot on a persistent copy stream (DSpark module only)",
            retire_when="SGLang's DSpark worker ships a native batched grammar traversal with pinned, "
            "double-buffered mask slots",
            **common,
        ),
        Patch(
            target=I.BUILD_TARGET,
            kind=Kind.REPLACE,
            build=build_mask,
            fingerprint=I.BUILD_FINGERPRINT,
            why="stock walks every request's draft chain with a Python DFS on the scheduler thread "
            "(~67 ms for 64x8 at 32k vocab) while the GPU waits",
            retire_when="xgrammar's batch_traverse_draft_tree is released and SGLang's DSpark path uses it",
            **common,
        ),
    ]


@hookimpl
def dspark_patches(role, settings):
    return patches(role, settings)


@hookimpl
def dspark_process_bound(role, settings, report):
    """Scheduler start-up: refuse server configurations the native path cannot reproduce exactly,
    check the mask pipeline's device requirements against the server's device, and open the
    traversal engine now (so a native engine that does not bind stops start-up, not the first
    grammar request); publish the engine (feature detail for ``check``, gauge). With the feature
    off, a DSpark server with a grammar backend logs one WARNING naming the stock Python path."""
    if role is not Role.SCHEDULER:
        return
    from ..core import roles

    ctx = roles.CONTEXT
    args = getattr(ctx, "server_args", None) if ctx is not None else None
    if settings[DRAFT_SWITCH] and args is not None:
        _refuse_draft_masks(args, report, role)
    if not settings[SWITCH]:
        if args is not None and _first_scheduler(ctx) and stock_python_path_in_use(args):
            logger.warning(STOCK_PATH_WARNING)
        return
    st = bound_status(report, FEATURE)
    if st is None:
        return

    if args is not None:
        problems = server_args_problems(args)
        if problems:
            _refuse(st, role, report, "; ".join(problems))
    from . import integration as I
    from .jobs import TraversalError

    device = server_device(args) if args is not None else None
    if device is not None:
        problem = I.pipeline_device_problem(device)
        if problem:
            _refuse(st, role, report, problem)
    try:
        rt = I.runtime(device_type=device)
    except TraversalError as exc:
        _refuse(st, role, report, str(exc))
    engine = rt.traverser.engine
    st.detail = (
        f"engine {engine} ({ENGINE}={rt.traverser.requested}, {rt.traverser.threads} thread(s)); mask pipeline: "
        + (I.pipeline_description(device) if device is not None else "device checked when the server starts")
    )
    from ..core import metrics as M
    from .metrics import publish_engine

    M.when_ready(lambda: publish_engine(engine, ctx.dp_label if ctx is not None else "none"))


def _refuse_draft_masks(args: Any, report: Any, role: Role) -> None:
    """``DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1`` on a server whose draft it cannot mask: refused here, in the
    scheduler's bind (before the weights load), naming the precondition and the switch."""
    from . import draft as D

    problems = D.server_args_problems(args, DRAFT_SWITCH)
    st = bound_status(report, DRAFT_FEATURE)
    if problems and st is not None:
        _refuse(st, role, report, "; ".join(problems))


def _refuse(st: Any, role: Role, report: Any, problem: str) -> None:
    """Mark the bound feature failed with ``problem`` and stop the process's start-up, naming its switch."""
    from ..core.binder import refuse

    refuse(report, role, st.name, f"{st.switch}=1: {problem}", st)


def server_device(args: Any) -> str:
    """The server's device type (SGLang resolves ``--device`` before it starts a scheduler; an
    unresolved one is resolved the way SGLang does)."""
    device = getattr(args, "device", None)
    if not device:
        from sglang.srt.utils.common import get_device

        device = get_device()
    return str(device).split(":")[0]


def stock_python_path_in_use(args: Any) -> bool:
    """A DSpark server that can serve grammar requests (any grammar backend but ``none``)."""
    spec = getattr(args, "speculative_algorithm", None)
    backend = getattr(args, "grammar_backend", None)
    return str(spec or "").upper() == "DSPARK" and backend != "none"


def _first_scheduler(ctx: Any) -> bool:
    # one WARNING per server, not one per scheduler process
    return getattr(ctx, "tp_rank", None) in (None, 0) and getattr(ctx, "dp_rank", None) in (None, 0)


STOCK_PATH_WARNING = (
    "dspark-harden: DSpark with a grammar backend builds its draft-tree grammar masks with stock SGLang's "
    "Python DFS per request (spec_utils.build_grammar_vocab_mask -> generate_token_bitmask -> traverse_tree) "
    f"on the scheduler thread. Set {SWITCH}=1 for the native batched traversal (docs/dspark_masks.md)."
)


def server_args_problems(args: Any) -> list[str]:
    out = []
    backend = getattr(args, "grammar_backend", None)
    if backend not in (None, "xgrammar", "none"):
        out.append(
            f"--grammar-backend {backend} is not supported by the native DSpark traversal (xgrammar only); "
            f"unset {SWITCH} or use xgrammar"
        )
    if getattr(args, "enable_strict_thinking", False):
        out.append(
            f"--enable-strict-thinking token filters are not reproduced by the native DSpark traversal; "
            f"unset {SWITCH} or drop --enable-strict-thinking"
        )
    return out


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    from . import bench

    bench.register(bench_subparsers)
