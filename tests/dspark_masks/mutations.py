"""Mutation runs of grammar-aware DSpark drafting (issue 43): each mutation breaks one rule of
src/dspark_harden/dspark_masks/draft.py, the named test runs (it must fail), the file is restored.
Not collected by pytest. Usage: python tests/dspark_masks/mutations.py [D1 D2 ...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests._mutations import REPO, run  # noqa: E402

ROOT = os.path.join(REPO, "src", "dspark_harden", "dspark_masks") + os.sep
T = "tests/dspark_masks/test_draft_masks.py"
GREEDY = T + "::test_greedy_draft_step_k_is_masked_with_the_verify_row_k"
SAMPLED = T + "::test_sampled_draft_keeps_the_masked_distribution_and_draws_from_it"
MUTS = [
    (
        "D1 an unadvanced matcher (step 0's mask reused for every step)",
        "draft.py",
        "                g.accept_token(int(tok))\n                self.accepted[row] += 1\n",
        "                pass\n",
        GREEDY,
    ),
    (
        "D2 no rollback (the block leaves the grammars advanced)",
        "draft.py",
        "            block.rollback()\n",
        "            pass\n",
        GREEDY,
    ),
    (
        "D3 columns past the vocab left unmasked",
        "draft.py",
        "    n = min(width, vocab_size, allowed.shape[1])",
        "    n = min(width, allowed.shape[1])\n    keep[:, vocab_size:] = True",
        SAMPLED,
    ),
    (
        "D4 the mask lands one step late (step k masked with row k-1)",
        "draft.py",
        "        _fill(self.grammars, self.alive, self.bitmask)\n",
        "        if step == 0:\n            _fill(self.grammars, self.alive, self.bitmask)\n",
        GREEDY,
    ),
    (
        "D5 a row masked with its neighbour's mask",
        "draft.py",
        "        _apply(logits, self.bitmask, self.alive, self.vocab_size)",
        "        _apply(logits, self.bitmask.roll(1, 0), self.alive, self.vocab_size)",
        GREEDY,
    ),
    (
        "D6 the batched fill writes the first rows instead of the listed ones",
        "draft.py",
        "bitmask, indices=batch)",
        "bitmask, indices=None)",
        GREEDY,
    ),
    (
        "D7 the folded proposal in the draft CUDA graph not refused",
        "draft.py",
        '    if spec == "DSPARK" and folded and not getattr(args, "disable_cuda_graph", False):',
        "    if False:",
        T + "::test_switch_on_a_server_it_cannot_mask_is_refused_at_startup_and_binds_where_it_can",
    ),
    (
        "D8 the draft not masked on the real server (the step wrap skips the block)",
        "draft.py",
        "        if block is not None:\n            block.step(",
        "        if block is not None and False:\n            block.step(",
        "tests/dspark_masks/test_dspark_server.py::test_draft_masks_make_the_grammar_forced_positions_of_a_random_draft_accepted",
    ),
]

if __name__ == "__main__":
    sys.exit(run(ROOT, MUTS, timeout=600, summary=True))
