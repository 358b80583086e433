"""Invariant 1 on the GPU path with real weights: greedy speculative == greedy AR of the verify mode, token for
token, for every speculative recipe on the 20 built-in prompts, through the Triton kernels and CUDA graphs.

The model is the embedded SmolLM2-135M (or SELFSPEC_GPU_MODEL: a .gguf path or HF directory)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import gpu_test_model  # noqa: E402
import selfspec  # noqa: E402
from selfspec.bench.prompts import PROMPTS  # noqa: E402
from selfspec.engine.graphs import GraphedModel  # noqa: E402
from selfspec.speculative.sampling import SamplingParams  # noqa: E402

NEW_TOKENS = 24


# (recipe, --draft, --draft-vocab): trees (hybrid-tree, ngram-tree, recycle-tree) verify their branches in one pass
# over forked cache rows, each node once (solo decoding); a draft vocabulary runs the draft's head over 4096 tokens;
# quasar verifies lookups in w8a8 (exact int32 sums over K).
@pytest.fixture(scope="module", params=[("planes", None, None), ("qspec", None, None), ("ngram", None, None),
                                        ("hybrid", None, None), ("hybrid", "hybrid-tree", None),
                                        ("ngram", "ngram-tree:4", None), ("ngram", "recycle-tree", None),
                                        ("planes", None, 4096), ("hybrid", None, 4096), ("quasar", None, None)],
                ids=str)
def llm(request):
    recipe, draft, vocab = request.param
    return selfspec.load(gpu_test_model(), recipe, draft, device="cuda", draft_vocab=vocab)


def test_greedy_speculative_equals_ar_on_gpu(llm):
    assert isinstance(llm.runner, GraphedModel) and llm.model.dtype == torch.bfloat16  # the fast path runs
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    accepted = proposed = 0
    mismatches = []
    for i, prompt in enumerate(PROMPTS):
        ids = llm.encode(prompt, chat=True)
        ar = llm.generate(ids, params, gamma=0).token_ids
        for gamma in (1 + i % 6, 1 + (i + 3) % 6):  # every gamma 1..6, each on several prompts
            out = llm.generate(ids, params, gamma=gamma)
            accepted += out.stats.draft_accepted
            proposed += out.stats.draft_proposed
            if out.token_ids != ar:
                mismatches.append((prompt, gamma))
    assert not mismatches, f"{len(mismatches)} speculative runs differ from AR: {mismatches[:3]}"
    assert 0 < accepted < proposed
