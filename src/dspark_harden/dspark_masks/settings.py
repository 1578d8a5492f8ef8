"""Names and settings of the DSpark grammar-mask feature: the one place the feature, the traversal
engines, the bench and the CLI read them (no torch / xgrammar import)."""

from __future__ import annotations

from ..core.settings import Setting, choice, flag01, int_range

FEATURE = "dspark-masks"
SWITCH = "DSPARK_HARDEN_DSPARK_MASKS"
ENGINE = "DSPARK_HARDEN_GRAMMAR_TRAVERSAL"
THREADS = "DSPARK_HARDEN_GRAMMAR_TRAVERSAL_THREADS"
ENGINES = ("auto", "native", "scalar", "threads", "level", "batch")

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
]
