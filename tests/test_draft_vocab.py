"""The draft vocabulary: a draft mode's head reads the rows of the most frequent tokens only, every other token's
logit -inf; the verify pass keeps the whole vocabulary, so greedy speculative output equals AR of the verify mode."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from conftest import served_tokens, tiny_model
from selfspec.bench.traces import Round, Trace, from_json, trace_path
from selfspec.engine.engine import Engine
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.model import Transformer
from selfspec.quant.modes import MODES
from selfspec.speculative.draft_vocab import DraftVocabulary, ranked_vocabulary
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GROUP = 32
N_NEW = 20


def test_draft_vocabulary_ranks_always_then_counts_then_ids():
    counts = Counter({7: 5, 3: 9, 200: 1, 9: 5})
    assert ranked_vocabulary(counts, 256, 6, always=[255]).ids() == [255, 3, 7, 9, 200, 0]
    assert ranked_vocabulary(counts, 256, 2, always=[3, 999]).ids() == [3, 7]  # an id past the vocabulary is no token
    for size in (0, 257):
        with pytest.raises(SelfspecError, match="draft vocabulary of"):
            ranked_vocabulary(counts, 256, size)


def test_a_prompts_tokens_join_the_always_ones_in_place_of_the_least_counted():
    v = DraftVocabulary(ranking=[9, 3, 7, 1, 0, 2, 4, 5, 6, 8], always=1, size=5, sources=["x"])
    assert v.ids() == [9, 3, 7, 1, 0]
    assert v.ids([5, 7, 5, 42]) == [9, 5, 7, 3, 1]  # 42 is past the vocabulary
    assert v.ids(range(10)) == [9, 0, 1, 2, 3]


def test_draft_logits_are_the_heads_rows_of_the_vocabulary_and_minus_inf_elsewhere():
    cfg, sd, _ = tiny_model("llama", seed=3, tie_word_embeddings=True)
    model = Transformer(cfg, sd)
    model.quantize("planes", GROUP)
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:40].tolist()
    model.set_draft_vocab(ids)
    tokens, pos = torch.randint(0, cfg.vocab_size, (2, 7)), torch.arange(7)
    upper = MODES["upper"]
    with torch.inference_mode():
        whole = model(tokens, pos, model.new_cache(7, 2), upper)
        part = model(tokens, pos, model.new_cache(7, 2), replace(upper, draft_vocab=True))
    inside = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    inside[ids] = True
    torch.testing.assert_close(part[..., inside], whole[..., inside], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(part[..., ~inside]).all()
    assert inside[part.argmax(-1)].all()
    assert model.draft_head.weight.data_ptr() != model.embed.data_ptr()  # a copy of the rows, the tied table intact
    rows, where = model.draft_head.weight.data_ptr(), model.draft_ids.data_ptr()
    model.set_draft_vocab(list(range(40)))  # as many ids: rewritten in place (a captured graph reads the new ones)
    assert (model.draft_head.weight.data_ptr(), model.draft_ids.data_ptr()) == (rows, where)
    assert torch.equal(model.draft_head.weight, model.lm_head.weight[:40])


def test_draft_vocabulary_errors():
    cfg, sd, _ = tiny_model("llama", seed=3)
    model = Transformer(cfg, sd)
    with pytest.raises(SelfspecError, match="not given"):
        with torch.inference_mode():
            model(torch.zeros(1, 1, dtype=torch.long), torch.arange(1), model.new_cache(1),
                  replace(MODES["fp32"], draft_vocab=True))
    for ids in ([], [1, 1], [cfg.vocab_size]):
        with pytest.raises(SelfspecError, match="distinct token ids"):
            model.set_draft_vocab(ids)


@pytest.fixture(scope="module")
def vocab_setup():
    """A tiny planes model whose `upper` draft reads 64 of its 256 tokens (the lowest ids, as the drafts of an
    untrained model are spread over all of them), prompts and their AR references."""
    cfg, sd, _ = tiny_model("llama", seed=1)
    llm = build(cfg, sd, None, resolve_recipe("planes"), group_size=GROUP)
    llm.model.set_draft_vocab(list(range(64)))
    llm.draft_mode = replace(llm.draft_mode, draft_vocab=True)
    llm.drafter = replace(llm.drafter, mode=llm.draft_mode)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    return llm, prompts, refs, params


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_with_a_draft_vocabulary_equals_ar(vocab_setup, gamma):
    llm, prompts, refs, params = vocab_setup
    proposed = accepted = 0
    for p, ref in zip(prompts, refs):
        out = llm.generate(p, params, gamma=gamma)
        assert out.token_ids == ref, (p, gamma)
        proposed, accepted = proposed + out.stats.draft_proposed, accepted + out.stats.draft_accepted
    assert 0 < accepted < proposed
    assert any(t >= 64 for ref in refs for t in ref)  # the output holds tokens the draft could not propose


def test_engine_batched_equals_solo_with_a_draft_vocabulary(vocab_setup):
    llm, prompts, refs, params = vocab_setup
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, prefill_chunk=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, gamma=[None, 2, 4][i % 3])
    out = served_tokens(engine)
    assert [out[str(i)] for i in range(len(prompts))] == refs


def test_smollm2_with_a_draft_vocabulary_equals_ar(smollm2_resolved):
    """The recipe's draft_vocab on the real model: counted on the data packages' text, end-of-sequence included,
    reported with its memory; greedy output equals AR."""
    cfg, sd, tok, desc = smollm2_resolved
    recipe = replace(resolve_recipe("planes"), draft_vocab=4096)
    llm = build(cfg, {k: t.clone() for k, t in sd.items()}, tok, recipe, description=desc)
    assert llm.draft_mode.draft_vocab and llm.model.draft_ids.numel() == 4096
    assert set(llm.eos_ids) <= set(llm.model.draft_ids.tolist())
    assert "draft head: 4096 tokens counted on gsm8k, humaneval" in llm.description and "(+9.0 MiB)" in llm.description
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = llm.encode("List three prime numbers and say why each one is prime.", chat=True)
    out = llm.generate(prompt, params, gamma=4)
    assert out.token_ids == llm.generate(prompt, params, gamma=0).token_ids
    assert out.stats.draft_accepted > 0
    assert set(prompt) <= set(llm.model.draft_ids.tolist())  # solo decoding: the prompt's tokens join them


def test_a_draft_vocabulary_needs_draft_steps(smollm2_resolved):
    cfg, sd, tok, desc = smollm2_resolved
    with pytest.raises(SelfspecError, match="drop --draft-vocab"):
        build(cfg, dict(sd), tok, replace(resolve_recipe("ngram"), draft_vocab=4096), description=desc)


def test_traces_keep_their_draft_vocabulary(tmp_path):
    t = Trace("m", "planes", "upper", "full", 4, tasks={"gsm8k": [Round("draft", 4, 4, 1, 5, 2)]}, draft_vocab=4096)
    back = from_json(t.to_json())
    assert back.draft_vocab == 4096 and "over 4096 tokens" in back.label("gsm8k")
    assert "draft_vocab" not in replace(t, draft_vocab=0).to_json()
    assert trace_path(tmp_path, "m", "planes", "upper", 0.0, 5, "upper", None, 4096).name == "m.planes.v4096.json"
