"""The serving engine on CUDA: paged Triton attention and CUDA graphs over batch buckets. 32 concurrent greedy
requests (speculative rounds and plain steps, requests joining and leaving so the buckets change) each give
exactly the tokens of a solo greedy AR run, for the planes and qspec recipes, on a tiny random model and on the
real SmolLM2 (SELFSPEC_GPU_MODEL: its .gguf path or HF directory); tree drafters (hybrid-tree, ngram-tree:4) and
the hybrid chain too, their branch rows replaying graphs of up to max_batch x branches rows."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import selfspec  # noqa: E402
from conftest import tiny_model  # noqa: E402
from selfspec.bench.prompts import PROMPTS  # noqa: E402
from selfspec.engine.engine import Engine  # noqa: E402
from selfspec.engine.graphs import PagedGraphedModel  # noqa: E402
from selfspec.engine.llm import build  # noqa: E402
from selfspec.speculative.drafters import SelfDraft  # noqa: E402
from selfspec.speculative.recipes import resolve_recipe  # noqa: E402
from selfspec.speculative.sampling import SamplingParams  # noqa: E402

GAMMAS = [None, 0, 2, 5]  # the policy's, plain decoding, fixed draft lengths


def serve_all(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> dict[str, list[int]]:
    """Submit every request at once (the engine runs max_batch at a time) and step until idle."""
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=True), gamma=GAMMAS[i % 4])
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def check_batched_equals_solo(llm, prompts: list[list[int]], lengths: list[int]) -> None:
    refs = [llm.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), gamma=0).token_ids
            for p, n in zip(prompts, lengths)]
    engine = Engine(llm, max_batch=32, block_size=16, num_blocks=32 * 16, max_gamma=8)
    assert isinstance(engine.runner, PagedGraphedModel)
    engine.warm_up()
    captured = len(engine.runner._graphs)
    draft_steps = isinstance(llm.drafter, SelfDraft)  # a lookup drafter runs no model step
    assert captured == 6 * (9 + draft_steps)  # buckets 1..32 x (AR/verify of 0..8 drafts[, draft step])
    tokens = serve_all(engine, prompts, lengths)
    assert len(engine.runner._graphs) == captured  # every decode pass replayed a warmed-up graph
    mismatches = [i for i, ref in enumerate(refs) if tokens[str(i)] != ref]
    assert not mismatches, f"{len(mismatches)} of {len(refs)} requests differ from solo greedy: {mismatches[:5]}"
    s = engine.stats()
    assert s.num_draft_tokens > 0 and s.kv_blocks_used == 0


@pytest.mark.parametrize("recipe", ["planes", "qspec"])
def test_tiny_model_batched_greedy_equals_solo(recipe):
    cfg, sd, _ = tiny_model("qwen2", seed=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    llm = build(cfg, sd, None, resolve_recipe(recipe), group_size=32, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (40,), generator=g)]
    check_batched_equals_solo(llm, prompts, [8 + i % 17 for i in range(40)])  # 40 > 32: requests join as others end


@pytest.mark.skipif(not os.environ.get("SELFSPEC_GPU_MODEL"), reason="set SELFSPEC_GPU_MODEL to SmolLM2's .gguf")
@pytest.mark.parametrize("recipe,vocab", [("planes", None), ("qspec", None), ("ngram", None), ("planes", 4096)])
def test_smollm2_batched_greedy_equals_solo(recipe, vocab):
    """With vocab: the draft's head over the 4096 most frequent tokens (a draft vocabulary)."""
    llm = selfspec.load(os.environ["SELFSPEC_GPU_MODEL"], recipe, device="cuda", draft_vocab=vocab)
    prompts = [llm.encode(PROMPTS[i % len(PROMPTS)], chat=True) for i in range(40)]
    check_batched_equals_solo(llm, prompts, [16 + 3 * i % 33 for i in range(40)])


@pytest.mark.parametrize("draft", ["hybrid-tree", "ngram-tree:4", "recycle-tree", "hybrid"])
def test_tiny_model_tree_drafters_batched_greedy_equals_solo(draft):
    """Every branch of every row in one verify pass over the paged cache (PagedTree; for a drafter that forks no rows,
    in rounds of up to SHARED_TREE_BATCH sequences, SharedTree), under CUDA graphs warmed up to max_batch x
    branches rows: each request's tokens are its solo AR ones, and no pass captures a new graph."""
    cfg, sd, _ = tiny_model("qwen2", seed=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    llm = build(cfg, sd, None, resolve_recipe("hybrid", draft=draft), group_size=32, device="cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 20, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (40,), generator=g)]
    lengths = [8 + i % 17 for i in range(40)]
    refs = [llm.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), gamma=0).token_ids
            for p, n in zip(prompts, lengths)]
    engine = Engine(llm, max_batch=32, block_size=16, num_blocks=32 * 24, max_gamma=8)
    engine.warm_up()
    captured = len(engine.runner._graphs)
    tokens = serve_all(engine, prompts, lengths)
    assert len(engine.runner._graphs) == captured
    mismatches = [i for i, ref in enumerate(refs) if tokens[str(i)] != ref]
    assert not mismatches, f"{len(mismatches)} of {len(refs)} requests differ from solo greedy: {mismatches[:5]}"
    s = engine.stats()
    assert s.num_draft_tokens > 0 and s.kv_blocks_used == 0
