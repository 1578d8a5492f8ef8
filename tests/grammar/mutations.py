"""Mutation runs of the grammar service's helper-cost policy and budget (issue 40 item 2) and of the per-key
claim policy (item 4, C1-C3): each mutation
breaks one rule, the named test runs (it must fail), the file is restored. Not collected by pytest.
Usage: python tests/grammar/mutations.py [H1 H2 ...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests._mutations import REPO, run  # noqa: E402

ROOT = os.path.join(REPO, "src", "dspark_harden", "grammar") + os.sep
COST = "tests/grammar/test_helper_cost.py"
CLAIMS = "tests/grammar/test_claims.py"
MUTS = [
    (
        "H1 nothing deferred (every cheap one-use key is persisted)",
        "xgr.py",
        "        if compile_s >= self.persist_min_compile_s:\n            return False",
        "        if True:\n            return False",
        COST + "::test_one_use_key_is_not_persisted_and_its_second_use_publishes_it",
    ),
    (
        "H2 a reuse never publishes (the service's hit does not report it)",
        "service.py",
        "        if hit is not None:\n            self._reused(hit[2])",
        "        if hit is not None:\n            pass",
        COST + "::test_one_use_key_is_not_persisted_and_its_second_use_publishes_it",
    ),
    (
        "H3 set_cache drops the key's disk digest (the scheduler's re-insert after a miss)",
        "service.py",
        "            if key_hex is None:  # stock's set_cache after a miss re-inserts the grammar: keep its disk key\n"
        "                key_hex = old[2]",
        "            pass",
        COST + "::test_one_use_key_is_not_persisted_and_its_second_use_publishes_it",
    ),
    (
        "H4 a claimed key deferred like any other",
        "xgr.py",
        "        if mine is not None or not self._defer(key_hex, parts, compile_s):",
        "        if not self._defer(key_hex, parts, compile_s):",
        COST + "::test_expensive_or_claimed_keys_are_published_at_their_first_compile",
    ),
    (
        "H5 the CPU budget not checked",
        "persist.py",
        "            if self._cpu_budget_locked() <= 0.0:",
        "            if False:",
        COST + "::test_spent_cpu_budget_skips_publications_and_serves_the_request",
    ),
    (
        "H6 the helper's CPU never charged",
        "persist.py",
        "                self._charge_helper_cpu()\n",
        "",
        COST + "::test_spent_cpu_budget_skips_publications_and_serves_the_request",
    ),
    (
        "H7 deferred keys unbounded",
        "xgr.py",
        "while self._deferred and (len(self._deferred) > DEFERRED_KEPT or self._deferred_bytes > DEFERRED_MAX_BYTES):",
        "while False:",
        COST + "::test_deferred_keys_are_bounded_by_count_and_bytes",
    ),
    (
        "C1 every key claimed host-wide (no per-key handoff decision)",
        "xgr.py",
        "        return self.persister.handoff_estimate(mem) <= compile_s * self.policy.load_ratio",
        "        return True",
        CLAIMS + "::test_a_key_dearer_to_hand_off_than_to_compile_is_compiled_by_each_process",
    ),
    (
        "C2 no key claimed host-wide (the handoff never pays)",
        "xgr.py",
        "        return self.persister.handoff_estimate(mem) <= compile_s * self.policy.load_ratio",
        "        return False",
        CLAIMS + "::test_claimant_keeps_the_claim_of_a_key_whose_handoff_pays",
    ),
    (
        "C3 a released claim re-claimed by its waiter",
        "xgr.py",
        '                self._claim_outcome("released", dt)  # (or its compile failed): compile at once, claim nothing\n'
        "                return None, None, waited",
        '                self._claim_outcome("released", dt)\n                continue',
        CLAIMS + "::test_a_released_claim_is_compiled_at_once_without_claiming",
    ),
]

if __name__ == "__main__":
    sys.exit(1 if run(ROOT, MUTS, timeout=600, summary=True) else 0)
