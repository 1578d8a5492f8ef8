"""Names and settings of the DSpark grammar-mask feature: the one place the feature, the traversal
engines, the bench and the CLI read them (no torch / xgrammar import)."""

from __future__ import annotations

from ..core.settings import Setting, choice, flag01, int_range

FEATURE = "dspark-masks"
SWITCH = "DSPARK_HARDEN_DSPARK_MASKS"
ENGINE = "DSPARK_HARDEN_GRAMMAR_TRAVERSAL"
THREADS = "DSPARK_HARDEN_GRAMMAR_TRAVERSAL_THREADS"
ENGINES = ("auto", "native", "scalar", "threads", "level", "batch")
DRAFT_FEATURE = "dspark-draft-masks"
DRAFT_SWITCH = "DSPARK_HARDEN_DSPARK_DRAFT_MASKS"

SETTINGS = [
    Setting(
        SWITCH,
        flag01,
        False,
        "1: DSpark verify steps build their grammar masks with one batched native traversal and a "
        "double-buffered copy-stream upload (scheduler processes). 0: stock Python DFS.",
        feature=FEATURE,
    ),
    Setting(
        ENGINE,
        choice(*ENGINES),
        "auto",
        "Traversal engine: auto (xgrammar's batch_traverse_draft_tree when installed, else 'native' "
        "when its module binds; neither: start-up is refused, naming why), native, scalar (the slower "
        "Python engine: only when named), threads, level, batch. See docs/dspark_masks.md.",
        feature=FEATURE,
    ),
    Setting(
        THREADS,
        int_range(1, 64),
        2,
        "Threads per scheduler process for the traversal: native threads of the 'native' engine "
        "(the calling thread included), the Python pool of 'threads', xgrammar's "
        "BatchGrammarMatcher pool for 'level'/'batch'.",
        feature=FEATURE,
    ),
    Setting(
        DRAFT_SWITCH,
        flag01,
        False,
        "1: each DSpark draft step of a request with a grammar draws only from the tokens its grammar allows "
        "after the block's earlier draft tokens (the verify mask of that chain row); requests without a grammar "
        "are untouched. Needs --speculative-algorithm DSPARK and the eager proposal "
        "(SGLANG_DSPARK_FOLDED_PROPOSAL=0 or --disable-cuda-graph on CUDA); refused at start-up otherwise. "
        "0: stock (only the verify is masked).",
        feature=DRAFT_FEATURE,
    ),
]
