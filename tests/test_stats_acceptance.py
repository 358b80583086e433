"""GenerationStats counts the rounds that ended with a rejected draft, and per_token_acceptance is the chain model's
per-draft acceptance a (accepted / (accepted + rejected)), where acceptance_rate (accepted / proposed) counts the
unjudged drafts after a rejection: decoding with a forced acceptance pattern, chains and trees."""
from __future__ import annotations

import pytest

from conftest import tiny_model
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.speculative.decode import decode
from selfspec.speculative.drafters import TreeDrafter
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 4
PATTERN = [4, 2, 0, 4, 1, 3, 4, 0]  # drafts accepted in each round, of GAMMA


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=3)
    return build(cfg, sd, None, resolve_recipe("planes"), group_size=32)


class Forced:
    """A greedy acceptance that accepts PATTERN[i] drafts in round i (and the verify's token after them)."""

    def __init__(self, pattern: list[int]):
        self.pattern, self.i = pattern, 0

    def __call__(self, drafts: list[int], targets: list[int]) -> tuple[int, int]:
        n = min(self.pattern[self.i % len(self.pattern)], len(drafts))
        self.i += 1
        return n, targets[n]


def forced_rounds(llm, drafter, pattern: list[int], rounds: int) -> GenerationStats:
    stats = GenerationStats()
    chunks = decode(llm.model, list(range(5, 15)), llm.verify_mode, drafter, GAMMA,
                    SamplingParams(max_new_tokens=200, ignore_eos=True), stats, accept=Forced(pattern))
    for _ in range(rounds + 1):  # the prefill's token, then one chunk per round
        next(chunks)
    chunks.close()
    return stats


def test_chain_counts_rejected_rounds_and_per_token_acceptance(llm):
    stats = forced_rounds(llm, llm.draft_mode, PATTERN, 2 * len(PATTERN))
    accepted = 2 * sum(PATTERN)  # 36
    rejected = 2 * sum(n < GAMMA for n in PATTERN)  # 10: rounds accepting 2, 0, 1, 3, 0
    assert (stats.rounds, stats.draft_proposed) == (16, 16 * GAMMA)
    assert (stats.draft_accepted, stats.draft_rejected) == (accepted, rejected)
    assert stats.per_token_acceptance == pytest.approx(accepted / (accepted + rejected))  # 36 / 46 = 0.783
    assert stats.acceptance_rate == pytest.approx(accepted / (16 * GAMMA))  # 36 / 64 = 0.5625: lower
    d = stats.to_dict()
    assert d["draft_rejected"] == rejected and d["per_token_acceptance"] == stats.per_token_acceptance


def test_every_draft_accepted_or_none():
    assert GenerationStats().per_token_acceptance == 0.0
    assert GenerationStats(draft_proposed=8, draft_accepted=8).per_token_acceptance == 1.0
    assert GenerationStats(draft_proposed=8, draft_rejected=2).per_token_acceptance == 0.0


def test_real_greedy_rounds_are_judged_as_the_chain_model(llm):
    """Without forcing: each round judges its accepted drafts and at most one rejected one."""
    out = llm.generate(list(range(5, 15)), SamplingParams(max_new_tokens=40, ignore_eos=True), gamma=GAMMA)
    s = out.stats
    assert s.draft_rejected <= s.rounds and s.draft_accepted + s.draft_rejected <= s.draft_proposed
    assert s.per_token_acceptance >= s.acceptance_rate


class TwoBranches(TreeDrafter):
    """Two branches a round, of k and k - 1 tokens (the verify's forced acceptance decides what is kept)."""
    branches = 2

    def propose_tree(self, model, cache, row, k: int) -> list[list[int]]:
        return [[3] * k, [4] * (k - 1)]


def test_tree_round_is_rejected_below_its_deepest_branch(llm):
    # Per branch: the first branch judged accepts PATTERN's n, the second too; the longest accepted wins.
    pattern = [4, 3, 3, 3, 1, 0]  # rounds: (4 of 4, 3 of 3) -> 4 accepted; (3, 3) -> 3 < 4; (1, 0) -> 1 < 4
    stats = forced_rounds(llm, TwoBranches(), pattern, 3)
    assert stats.draft_accepted == 4 + 3 + 1
    assert stats.draft_rejected == 2  # the rounds that accepted fewer than the deepest branch's 4 drafts
    assert stats.per_token_acceptance == pytest.approx(8 / 10)


def test_total_sums_every_field_and_rates_follow_the_sums():
    a = GenerationStats(new_tokens=10, rounds=4, draft_proposed=12, draft_accepted=6, draft_rejected=3, verify_s=0.5)
    b = GenerationStats(new_tokens=7, rounds=2, draft_proposed=8, draft_accepted=8, draft_rejected=0, verify_s=0.25)
    t = GenerationStats.total([a, b])
    assert (t.new_tokens, t.rounds, t.draft_proposed, t.draft_accepted, t.draft_rejected, t.verify_s) == (
        17, 6, 20, 14, 3, 0.75)
    assert t.acceptance_rate == 14 / 20 and t.per_token_acceptance == 14 / 17
    assert GenerationStats.total([]) == GenerationStats()
