"""Invariant 1 on the real default model (SmolLM2-135M): greedy speculative == greedy AR of the verify mode,
token for token, for qspec and planes on the first 10 built-in prompts, every gamma 1..6, each on the prompts
whose two gammas (as tests/gpu/test_lossless_gpu.py deals them: 1 + i % 6 and 1 + (i + 3) % 6) include it.

Sized for CI's 2-core CPU: the model is read once per session (conftest: smollm2), on one torch thread (two
spin-wait for each other when another job shares the CPU), the AR reference is generated once per prompt and reused
by the six gammas, prompts are raw text (short prefills; the chat template would add ~25 tokens to each of the 70
prefills per recipe), and NEW_TOKENS = 6 gives every gamma at least one full round of gamma drafts verified in one
pass (the first token comes from the prefill), most prompts several rounds, with accepts and rejects. Ten prompts,
not all 20, and two gammas a prompt, not six: every prompt at every gamma took 4.6 of CI's 17 minutes (the 20 took
11 minutes on the shared CI-sized CPU); each gamma still sees its drafts accepted, and gammas 4 and 6 rejected too
(`planes` accepts 23 of 24 drafts of its prompts at gammas 1 and 2 since the formats' scales and offsets are bf16,
quant/formats.fma_grid; its acceptance over 20 prompts x 24 tokens at gamma 4 is 70%, 64% before; qspec rejects
at every gamma).
"""
import pytest

from selfspec.bench.prompts import PROMPTS as BUILT_IN
from selfspec.speculative.sampling import SamplingParams

PROMPTS = BUILT_IN[:10]
NEW_TOKENS = 6
GAMMAS = (1, 2, 4, 6)  # 3 and 5: the tree and lookup tests run them (CI time)

pytestmark = pytest.mark.usefixtures("one_thread")


def params() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["qspec", "planes"])
def llm_and_refs(request, smollm2):
    llm = smollm2(request.param)
    refs = [llm.generate(p, params(), gamma=0).token_ids for p in PROMPTS]  # AR in the verify mode, once
    assert all(len(r) == NEW_TOKENS for r in refs)
    return llm, refs


def prompts_at(gamma: int) -> list[int]:
    """The prompts checked at `gamma`: each prompt i at 1 + i % 6 and 1 + (i + 3) % 6."""
    return [i for i in range(len(PROMPTS)) if gamma in (1 + i % 6, 1 + (i + 3) % 6)]


@pytest.mark.parametrize("gamma", GAMMAS)
def test_greedy_speculative_equals_ar(llm_and_refs, gamma):
    llm, refs = llm_and_refs
    mismatches, accepted, proposed = [], 0, 0
    for prompt, ref in ((PROMPTS[i], refs[i]) for i in prompts_at(gamma)):
        out = llm.generate(prompt, params(), gamma=gamma)
        assert out.stats.draft_proposed >= gamma  # at least one full round of gamma drafts was verified
        accepted += out.stats.draft_accepted
        proposed += out.stats.draft_proposed
        if out.token_ids != ref:
            mismatches.append((prompt, ref, out.token_ids))
    # fp32 CPU matmuls of k+1 rows vs 1 row may round differently; a flipped near-tie would show here
    # and must be investigated, not tolerated.
    assert not mismatches, f"{len(mismatches)} speculative runs differ from AR at gamma {gamma}: {mismatches[:3]}"
    assert 0 < accepted  # drafts accepted; and rejected (the rollback path) in rounds of 4 and 6 drafts
    assert gamma < 4 or accepted < proposed  # (at gammas 1 and 2 `planes` accepts every draft of these prompts)


# Recipe ngram: lookup drafts verified by `full`. A prompt that repeats itself (code) makes the lookup match and
# propose whole runs; the built-in prompt mostly does not (rows without a proposal are plain steps).
NGRAM_PROMPTS = [PROMPTS[0],
                 "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"]
NGRAM_NEW_TOKENS = 16


@pytest.mark.parametrize("gamma", [2, 5])
def test_greedy_ngram_equals_ar_of_full(smollm2, gamma):
    llm = smollm2("ngram")
    p = SamplingParams(max_new_tokens=NGRAM_NEW_TOKENS, ignore_eos=True)
    accepted = proposed = 0
    for prompt in NGRAM_PROMPTS:
        ref = llm.generate(prompt, p, gamma=0).token_ids
        out = llm.generate(prompt, p, gamma=gamma)
        assert out.token_ids == ref, (prompt, gamma)
        accepted, proposed = accepted + out.stats.draft_accepted, proposed + out.stats.draft_proposed
    assert 0 < accepted < proposed


# Recipe quasar: lookup drafts verified by SmoothQuant-ed w8a8. Its AR reference is the same smoothed weights at
# gamma 0; a prompt that repeats itself makes the lookup propose drafts that w8a8 both accepts and rejects.
QUASAR_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, NGRAM_PROMPTS[1]]


def test_greedy_quasar_equals_ar_of_smoothed_w8a8(smollm2, smollm2_resolved):
    llm = smollm2("quasar")
    original_norm = smollm2_resolved[1]["model.layers.0.input_layernorm.weight"]
    assert not llm.model.layers[0].attention_norm.weight.equal(original_norm)  # the stored weights are smoothed
    p = SamplingParams(max_new_tokens=NGRAM_NEW_TOKENS, ignore_eos=True)
    accepted = proposed = 0
    for prompt in QUASAR_PROMPTS:
        ref = llm.generate(prompt, p, gamma=0).token_ids
        for gamma in (2, 5):
            out = llm.generate(prompt, p, gamma=gamma)
            assert out.token_ids == ref, (prompt, gamma)
            accepted, proposed = accepted + out.stats.draft_accepted, proposed + out.stats.draft_proposed
    assert 0 < accepted < proposed
