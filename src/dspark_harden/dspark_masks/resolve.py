"""SGLang grammar objects -> traversal jobs (which matcher, from which chain position).

Mirrors what stock ``spec_utils.traverse_tree`` does with each ``req.grammar`` on a linear chain
(SGLang 0.5.23; the sources this logic is equivalent to are pinned by fingerprint in
:mod:`.integration`):

* ``XGrammarGrammar``: its ``matcher``, root 0.
* ``ReasonerGrammarObject`` (reasoning wrapper) without the strict-thinking token filter:
  - inner grammar ``None``: nothing to constrain (stock fills nothing: all-ones rows);
  - ``reasoning_in_grammar`` or generation phase: the inner ``XGrammarGrammar``'s matcher, root 0;
  - thinking phase: the think-end token sequence is matched over the draft (from the wrapper's
    current partial match, exactly like ``transfer_state``); the node that completes it is the
    root (its row is the first one filled). No completion inside the chain: thinking only.
  - neither phase (reasoning never initialised): nothing to constrain.
* Anything else (other backends, the strict-thinking token filter, subclasses) is unsupported:
  :class:`UnsupportedGrammarError` naming the request (fail closed).

Draft tokens ``>= vocab_size`` end a chain (stock rejects them without asking the grammar);
a negative draft token after column 0 is an error.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .traversal import Job, TraversalError


class UnsupportedGrammarError(TraversalError):
    """A request's grammar object is not one the native DSpark traversal reproduces exactly."""


_CLASSES: tuple = ()


def _classes() -> tuple:
    global _CLASSES
    if not _CLASSES:
        from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

        _CLASSES = (XGrammarGrammar, ReasonerGrammarObject)
    return _CLASSES


def _rid(req: Any) -> str:
    return str(getattr(req, "rid", "?"))


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def resolve_jobs(
    reqs: Sequence[Any], draft: torch.Tensor, vocab_size: int, *, clip_end: bool = True
) -> tuple[list[Job], int]:
    """Return the traversal jobs for this step and the number of requests that carry a grammar
    object at all (stock builds a mask whenever that number is non-zero).

    ``clip_end=False`` (the native engine, which finds out-of-vocab and negative draft tokens
    itself) leaves every job's ``end`` at the chain length and skips that scan here."""
    XGrammarGrammar, ReasonerGrammarObject = _classes()
    bs, chain = draft.shape
    if len(reqs) != bs:
        raise TraversalError(f"{len(reqs)} requests for a draft batch of {bs} rows")
    toks = draft.numpy()
    if clip_end:
        body = toks[:, 1:]
        bad = body >= vocab_size
        first_bad = np.where(bad.any(axis=1), bad.argmax(axis=1) + 1, chain)
        negative = body < 0
        any_negative = bool(negative.any())
    else:
        first_bad, any_negative = None, False
    jobs: list[Job] = []
    with_grammar = 0
    for row, req in enumerate(reqs):
        g = req.grammar
        if g is None:
            continue
        with_grammar += 1
        t = type(g)
        if t is XGrammarGrammar:
            matcher, root = g.matcher, 0
        elif t is ReasonerGrammarObject:
            if g.enable_token_filter:
                raise UnsupportedGrammarError(
                    f"request {_rid(req)}: the strict-thinking token filter (--enable-strict-thinking with excluded "
                    f"tokens or SGLANG_MAX_THINK_TOKENS) is not supported by the native DSpark grammar traversal"
                )
            inner = g.grammar
            if inner is None:
                continue
            if type(inner) is not XGrammarGrammar:
                raise UnsupportedGrammarError(
                    f"request {_rid(req)}: reasoning wrapper around {_describe(inner)} is not supported by the "
                    f"native DSpark grammar traversal (xgrammar only)"
                )
            matcher = inner.matcher
            if g.reasoning_in_grammar or g._is_generation():
                root = 0
            elif g._is_thinking():
                root = _think_end_root(g, toks[row], vocab_size, _rid(req))
                if root is None:
                    continue
            else:
                continue
        else:
            raise UnsupportedGrammarError(
                f"request {_rid(req)}: grammar object {_describe(g)} is not supported by the native DSpark "
                f"grammar traversal (XGrammarGrammar or ReasonerGrammarObject wrapping it)"
            )
        end = int(first_bad[row]) if clip_end else chain
        if any_negative and negative[row, root : end - 1].any():
            col = int(np.argmax(negative[row, root : end - 1])) + root + 1
            raise TraversalError(
                f"request {_rid(req)}: negative draft token {int(toks[row, col])} at chain position {col}"
            )
        jobs.append(Job(row=row, matcher=matcher, root=root, end=end, rid=_rid(req)))
    return jobs, with_grammar


def _think_end_root(g: Any, tokens: np.ndarray, vocab_size: int, rid: str):
    """Chain position whose token completes the think-end sequence, starting from the wrapper's
    current partial match; None when the chain ends (or hits a stock-rejected token) first."""
    matcher = g._think_end_matcher
    full = len(matcher)
    matched = g._matched_think_end_tokens
    for i in range(1, len(tokens)):
        tok = int(tokens[i])
        if tok < 0:
            raise TraversalError(f"request {rid}: negative draft token {tok} at chain position {i}")
        if tok >= vocab_size:
            return None
        matched = matcher.advance(matched, tok)
        if matched == full:
            return i
    return None
