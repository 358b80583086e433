"""Layer-skip drafts: a skipped layer passes the residual stream through, greedy speculation with a skipping draft
equals AR of the verify mode (solo and batched by the engine), and calibration chooses a set from measured
agreement and costs, saved where `--recipe layerskip` finds it."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import served_tokens, tiny_model
from selfspec.engine.engine import Engine
from selfspec.engine.llm import build, load
from selfspec.errors import SelfspecError
from selfspec.model import Transformer
from selfspec.quant.modes import MODES
from selfspec.speculative.layer_skip import (Costs, TeacherForced, accepted_per_round, calibrate, calibration_path,
                                             choose_skip, save_calibration, score)
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GROUP = 32
LAYERS = 4
N_NEW = 20


def skip_recipe(*layers: int):
    return replace(resolve_recipe("layerskip"), skip_layers=layers)


def tiny_llm(recipe, seed=1):
    cfg, sd, _ = tiny_model("llama", seed=seed, num_hidden_layers=LAYERS)
    return build(cfg, sd, None, recipe, group_size=GROUP)


def random_prompts(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def greedy(n=N_NEW):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_a_skipped_layer_passes_the_residual_stream_through():
    """Skipping the top layers equals the model without them, bitwise; skipping none equals the base mode."""
    cfg, sd, _ = tiny_model("llama", seed=2, num_hidden_layers=LAYERS)
    whole = Transformer(cfg, {k: v.clone() for k, v in sd.items()})
    top_cut = {k: v for k, v in sd.items() if not any(k.startswith(f"model.layers.{i}.") for i in (2, 3))}
    cut = Transformer(replace(cfg, n_layers=2), top_cut)
    tokens, pos = torch.randint(0, 256, (2, 9)), torch.arange(9)
    fp32 = MODES["fp32"]
    with torch.inference_mode():
        skipped = whole(tokens, pos, whole.new_cache(9, 2), replace(fp32, skip_layers=frozenset({2, 3})))
        assert torch.equal(skipped, cut(tokens, pos, cut.new_cache(9, 2), fp32))
        base = whole(tokens, pos, whole.new_cache(9, 2), fp32)
        assert torch.equal(whole(tokens, pos, whole.new_cache(9, 2), replace(fp32, skip_layers=frozenset())), base)
        assert not torch.equal(skipped, base)


def test_skip_modes_are_distinct_hashable_keys():
    """Graphs are keyed by the mode: a skipping draft must not replay the unskipped draft's graph."""
    upper = MODES["upper"]
    keys = {upper, replace(upper, skip_layers=frozenset({1})), replace(upper, skip_layers=frozenset({1, 2}))}
    assert len(keys) == 3 and replace(upper, skip_layers=frozenset()) in keys


@pytest.fixture(scope="module")
def skip_setup():
    llm = tiny_llm(skip_recipe(1, 2))
    prompts = random_prompts(8)
    refs = [llm.generate(p, greedy(), gamma=0).token_ids for p in prompts]
    return llm, prompts, refs


def test_skipping_changes_the_draft(skip_setup):
    llm, prompts, _ = skip_setup
    assert llm.draft_mode.skip_layers == {1, 2}
    plain = tiny_llm(resolve_recipe("planes"))
    skip_draft = tiny_llm(replace(resolve_recipe("ar", None, "upper"), storage="planes", skip_layers=(1, 2)))
    assert skip_draft.verify_mode.skip_layers == frozenset()  # an AR recipe's verify mode never skips
    with torch.inference_mode():
        m, ids = llm.model, torch.tensor([prompts[0] + prompts[1]])
        pos, cache = torch.arange(ids.shape[1]), m.new_cache(ids.shape[1])
        assert not torch.equal(m(ids, pos, cache, llm.draft_mode), m(ids, pos, cache, plain.draft_mode))


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_with_skipped_layers_equals_ar(skip_setup, gamma):
    llm, prompts, refs = skip_setup
    proposed = accepted = 0
    for p, ref in zip(prompts, refs):
        out = llm.generate(p, greedy(), gamma=gamma)
        assert out.token_ids == ref, (p, gamma)
        proposed, accepted = proposed + out.stats.draft_proposed, accepted + out.stats.draft_accepted
    assert 0 < accepted < proposed  # drafts both accepted and rejected


def test_engine_batched_equals_solo_with_skipped_layers(skip_setup):
    llm, prompts, refs = skip_setup
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, prefill_chunk=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(), gamma=[None, 2, 4][i % 3])
    out = served_tokens(engine)
    assert [out[str(i)] for i in range(len(prompts))] == refs
    assert 0 < engine.stats().num_accepted_tokens < engine.stats().num_draft_tokens


def test_accepted_per_round():
    assert accepted_per_round([True, True, False, True, True, True, True], 2) == [2, 2, 1]
    assert accepted_per_round([False, False], 4) == [0, 0]
    assert accepted_per_round([True] * 5, 8) == [5]


def test_score_weighs_acceptance_against_cost():
    costs = Costs(verify=[1.0, 1.0, 1.0], draft=0.5, fixed=0.1, n_layers=4)
    agree = [[True, True, False] * 4]
    c = score([], agree, costs)
    # gamma 2: every round accepts 2 drafts, 3 tokens per 2 * 0.5 + 1 s; gamma 1: rounds accept 1, 0, 1, 0, ...:
    # 1.5 tokens per 1.5 s
    assert (c.gamma, c.mean_accepted, c.expected_speedup) == (2, 2.0, pytest.approx(3 / 2))
    assert c.agreement == pytest.approx(2 / 3)
    half = score([0, 1], agree, costs)  # the same agreement at 0.1 + 0.4 * 2/4 = 0.3 s a draft step
    assert half.expected_speedup == pytest.approx(3 / 1.6)


@pytest.fixture(scope="module")
def calibration_setup():
    llm = tiny_llm(resolve_recipe("planes"), seed=3)
    prompts = random_prompts(6, seed=4)
    conts = [llm.generate(p, greedy(16), gamma=0).token_ids for p in prompts]
    return llm, prompts, conts


def test_resumed_passes_equal_whole_passes(calibration_setup):
    """A candidate's pass resumes at the layer it adds: the agreement is that of a whole pass in its mode."""
    llm, prompts, conts = calibration_setup
    tf = TeacherForced(llm.model, prompts, conts, llm.verify_mode, llm.draft_mode)
    agree, inputs = tf.agreement(frozenset({2}))
    tf.accept(frozenset({2}), inputs)
    resumed, _ = tf.agreement(frozenset({0, 2}))
    whole = TeacherForced(llm.model, prompts, conts, llm.verify_mode,
                          replace(llm.draft_mode, skip_layers=frozenset({0, 2})))
    assert resumed == whole.base
    assert agree == TeacherForced(llm.model, prompts, conts, llm.verify_mode,
                                  replace(llm.draft_mode, skip_layers=frozenset({2}))).base


def test_choose_skip_takes_the_best_set_on_its_greedy_path(calibration_setup):
    llm, prompts, conts = calibration_setup
    # A draft step costs three AR steps, nearly all of it in the layers: skipping pays when it keeps some agreement.
    costs = Costs(verify=[1.0] * 5, draft=3.0, fixed=0.01, n_layers=LAYERS)
    tf = TeacherForced(llm.model, prompts, conts, llm.verify_mode, llm.draft_mode)
    best, path = choose_skip(tf, costs, log=lambda line: None)
    assert path[0].skip_layers == [] and best.skip_layers
    assert best == max(path, key=lambda c: c.expected_speedup)
    assert all(set(a.skip_layers) < set(b.skip_layers) and len(b.skip_layers) == len(a.skip_layers) + 1
               for a, b in zip(path, path[1:]))
    assert len(path) == LAYERS or path[-3] == best  # it went on two steps past the best
    for layer in range(LAYERS):  # the first step took the best single layer
        fresh = TeacherForced(llm.model, prompts, conts, llm.verify_mode,
                              replace(llm.draft_mode, skip_layers=frozenset({layer})))
        assert score([layer], fresh.base, costs).expected_speedup <= path[1].expected_speedup + 1e-12


def test_calibration_round_trips_to_the_layerskip_recipe(tmp_path, monkeypatch, calibration_setup):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    _, prompts, _ = calibration_setup
    cfg, sd, hf = tiny_model("llama", seed=3, num_hidden_layers=LAYERS)
    model_dir = tmp_path / "tiny"
    hf.save_pretrained(model_dir)
    recipe = resolve_recipe("layerskip")
    with pytest.raises(SelfspecError, match="selfspec calibrate-skip --model .*tiny"):
        load(str(model_dir), "layerskip", group_size=GROUP)
    llm = build(cfg, sd, None, recipe, group_size=GROUP)
    record = calibrate(llm, str(model_dir), prompts, 12, max_gamma=3, reps=1, log=lambda line: None)
    assert record["n_layers"] == LAYERS and record["chosen"]["skip_layers"] == record["skip_layers"]
    path = calibration_path(str(model_dir), recipe, GROUP, "cpu")
    save_calibration(record, path)
    loaded = load(str(model_dir), "layerskip", group_size=GROUP)
    assert loaded.draft_mode.skip_layers == frozenset(record["skip_layers"])
    assert loaded.recipe.skip_layers == tuple(json.loads(path.read_text())["skip_layers"])
    path.write_text(json.dumps({**record, "skip_layers": [LAYERS]}))
    with pytest.raises(SelfspecError, match="calibrate again"):
        load(str(model_dir), "layerskip", group_size=GROUP)


def test_layerskip_shares_the_planes_reference_in_eval():
    """`selfspec eval`'s reference for layerskip is its verify mode run alone: no draft, so no layer to skip."""
    from selfspec.eval.runner import plan_configs

    configs = plan_configs([], ["planes", "layerskip"])
    assert [c.label for c in configs] == ["full", "planes", "layerskip"]
    assert configs[2].reference == "full"


def test_smollm2_greedy_with_skipped_layers_equals_ar(smollm2_resolved):
    cfg, sd, tok, desc = smollm2_resolved
    llm = build(cfg, {k: v.clone() for k, v in sd.items()}, tok, skip_recipe(4, 11, 17, 25), description=desc)
    for prompt in ("What is the capital of France?", "def fibonacci(n):"):
        ref = llm.generate(prompt, greedy(12), gamma=0).token_ids
        out = llm.generate(prompt, greedy(12), gamma=4)
        assert out.token_ids == ref
        assert out.stats.draft_accepted > 0


def test_layerskip_refuses_a_lookup_draft():
    with pytest.raises(SelfspecError, match="lookup draft runs no layers"):
        resolve_recipe("layerskip", "ngram")
    assert resolve_recipe("layerskip", "w4a16").draft == "w4a16"  # another draft mode is fine
