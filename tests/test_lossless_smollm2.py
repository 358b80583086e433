"""Invariant 1 on the real default model: greedy speculative == greedy AR of the verify mode, token for token,
for qspec and planes on 20 varied prompts; each prompt runs one gamma, cycling 1..6, to fit CI's CPU budget."""
import pytest

pytestmark = pytest.mark.slow  # ~4-6 min per recipe on a 2-core CPU: run with `pytest -m slow`
import torch

import selfspec
from selfspec.bench.prompts import PROMPTS
from selfspec.spec.sampling import SamplingParams

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qspec", "planes"])
def llm(request):
    return selfspec.load(None, request.param)


def test_greedy_speculative_equals_ar(llm):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    mismatches, accepted, proposed = [], 0, 0
    for prompt in PROMPTS:
        ids = llm.encode(prompt, chat=True)
        ar = llm.generate(ids, params, gamma=0).token_ids
        assert len(ar) == NEW_TOKENS
        gamma = 1 + PROMPTS.index(prompt) % 6
        out = llm.generate(ids, params, gamma=gamma)
        accepted += out.stats.draft_accepted
        proposed += out.stats.draft_proposed
        if out.token_ids != ar:
            mismatches.append((prompt, gamma, ar, out.token_ids))
    # fp32 CPU matmuls of k+1 rows vs 1 row may round differently; a flipped near-tie would show here
    # and must be investigated, not tolerated.
    assert not mismatches, f"{len(mismatches)} speculative runs differ from AR: {mismatches[:3]}"
    assert 0 < accepted < proposed  # drafts were both accepted and rejected: the check exercised both paths
