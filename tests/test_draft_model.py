"""Recipe draft-model: a separate model drafts from its own KV cache. Greedy output == AR of the verify mode (drafts
accepted and rejected), every proposal == the draft model's own greedy continuation of the committed context (its
cache caught up and rolled back exactly), the engine's batched rows == solo runs (preemption included), sampling
keeps the verify distribution, and a draft model with other tokens is refused."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import check_mixed_batch_equals_solo, tiny_model
from selfspec.engine.engine import Engine
from selfspec.engine.llm import build, build_draft_model
from selfspec.errors import SelfspecError
from selfspec.speculative.draft_model import DraftModel
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams
from test_speculative import SAMPLING, VOCAB, check_against_verify, draw, next_probs, tv

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 200, 17, 3, 5, 9], [40, 41, 42, 43] * 4, [7] * 6, [11, 250, 3, 99, 64]]


def first_layer(cfg, sd):
    """The model cut to its first layer: another shape (one layer), drafts often right, often wrong."""
    return dataclasses.replace(cfg, n_layers=1), {k: v.clone() for k, v in sd.items() if ".layers.1." not in k}


def make_llm(draft_mode: str = "w4a16", seed: int = 1, **overrides):
    cfg, sd, _ = tiny_model("llama", seed=seed, **overrides)
    rec = resolve_recipe("draft-model", draft=draft_mode, draft_model="first layer")
    drafter = build_draft_model(cfg, None, "tiny", (*first_layer(cfg, sd), None, "first layer"), rec, group_size=32)
    return build(cfg, sd, None, rec, group_size=32, drafter=drafter)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def greedy(n):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_draft_model_equals_ar(llm, gamma):
    proposed = accepted = 0
    for p in PROMPTS:
        ref = llm.generate(p, greedy(30), gamma=0).token_ids
        out = llm.generate(p, greedy(30), gamma=gamma)
        assert out.token_ids == ref, (p, gamma)
        proposed, accepted = proposed + out.stats.draft_proposed, accepted + out.stats.draft_accepted
    assert 0 < accepted < proposed  # both paths ran


@torch.inference_mode()
def draft_greedy(drafter: DraftModel, context: list[int], k: int) -> list[int]:
    """The draft model's greedy continuation of `context`, from an empty cache."""
    m = drafter.model
    cache = m.new_cache(len(context) + k)
    toks, out = torch.tensor([context]), []
    pos = torch.arange(len(context))
    for _ in range(k):
        nxt = int(m(toks, pos, cache, drafter.mode)[0, -1].argmax())
        out.append(nxt)
        toks, pos = torch.tensor([[nxt]]), pos[-1:] + 1
    return out


def recording(drafter: DraftModel, log: list):
    """Wrap propose: log each row's committed context + pending token and its proposal."""
    propose = drafter.propose

    def logged(model, cache, rows, pending, lengths, k):
        contexts = [r.history.tokens[:r.length + 1] for r in rows]
        proposal = propose(model, cache, rows, pending, lengths, k)
        log.extend(zip(contexts, proposal.tokens.tolist()))
        return proposal

    drafter.propose = logged


class Gammas:
    """A policy drafting a fixed cycle of gammas (0: a plain step, which the draft cache has to catch up on)."""

    def __init__(self, cycle: list[int]):
        self.cycle, self.rounds = cycle, 0

    def choose(self, batch: int) -> int:
        self.rounds += 1
        return self.cycle[self.rounds % len(self.cycle)]

    def observe_round(self, *args) -> None:
        pass

    def observe_acceptance(self, *args) -> None:
        pass


def test_proposals_are_the_draft_models_own_continuations(llm):
    """Every round's drafts == the draft model's greedy continuation of the committed text from scratch: the
    draft cache held exactly the committed context (caught up after full acceptance and plain steps, rolled back
    after rejections), in solo runs and in the engine's batches."""
    from selfspec.engine.stats import GenerationStats
    from selfspec.speculative.decode import decode

    log: list = []
    recording(llm.drafter, log)
    try:
        for p in PROMPTS[:2]:
            llm.generate(p, greedy(24), gamma=3)
            stats = GenerationStats()
            for _ in decode(llm.model, p, llm.verify_mode, llm.drafter, 3, greedy(40), stats,
                            policy=Gammas([3, 0, 2, 0, 0, 3, 1])):
                pass  # to the end of the cache
        engine = Engine(llm, max_batch=4, block_size=4, num_blocks=40, prefill_chunk=8, max_gamma=3)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, greedy(20), gamma=3)
        while engine.has_work():
            engine.step()
    finally:
        del llm.drafter.propose
    assert len(log) > 20
    for context, drafts in log:
        assert drafts == draft_greedy(llm.drafter, context, len(drafts)), context


def test_same_model_drafting_for_itself_is_always_accepted():
    """The target's own weights and verify mode as the draft model: every draft is accepted."""
    cfg, sd, _ = tiny_model("llama", seed=4)
    rec = resolve_recipe("draft-model", draft_model="itself")
    drafter = build_draft_model(cfg, None, "tiny", (cfg, {k: v.clone() for k, v in sd.items()}, None, "itself"),
                                rec, group_size=32)
    llm = build(cfg, sd, None, rec, group_size=32, drafter=drafter)
    out = llm.generate(PROMPTS[0], greedy(25), gamma=4)
    assert out.token_ids == llm.generate(PROMPTS[0], greedy(25), gamma=0).token_ids
    assert out.stats.draft_accepted == out.stats.draft_proposed > 0


def test_engine_batched_equals_solo(llm):
    """Greedy and seeded sampling rows, per-request gammas and the policy's, a pool small enough to preempt (a
    resumed row's draft cache is rebuilt): each request equals its solo run."""
    s = check_mixed_batch_equals_solo(llm, PROMPTS)
    assert s.num_preemptions > 0
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_memory_is_reported(llm):
    mem = llm.drafter.memory()
    c = llm.drafter.model.cfg
    assert mem["weight_bytes"] == llm.drafter.model.weight_bytes() > 0
    assert mem["kv_bytes_per_token"] == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    llm.generate(PROMPTS[0], greedy(4), gamma=2)
    assert mem["kv_bytes"] <= llm.drafter.memory()["kv_bytes"] > 0
    assert "drafts by first layer in w4a16" in llm.description
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=10)
    assert engine.cache in llm.drafter.stores  # allocated with the engine's pool, which it mirrors
    pool = llm.drafter.store_for(engine.cache)
    assert pool.k.shape[1:2] == engine.cache.k.shape[1:2] and pool.k.shape[3] == 4
    assert llm.drafter.memory()["kv_bytes"] >= pool.nbytes() == 11 * 4 * mem["kv_bytes_per_token"]


# ---------------------------------------------------------------- sampling keeps the verify distribution


def test_sampling_matches_verify_distribution():
    """Temperature 1 with top-k, 1000 seeds, gamma 2: tokens 0..2 follow the verify distribution, whether token 1
    was an accepted draft or a rejection's resample."""
    llm = make_llm("w4a4", seed=9, vocab_size=VOCAB, eos_token_id=None)
    prompt = [3, 7, 1, 12, 5]
    params = SamplingParams(**SAMPLING)
    m, mode = llm.model, llm.verify_mode
    p0 = next_probs(m, [prompt], mode, params)[tuple(prompt)]
    p1 = next_probs(m, [prompt + [a] for a in range(VOCAB)], mode, params)
    p2 = next_probs(m, [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], mode, params)
    n = 1000
    rows = draw(llm, prompt, n, gamma=2)
    check_against_verify(rows, prompt, p0, p1, p2)
    acc = rows[:, 3].bool()
    assert 0.1 * n < int(acc.sum()) < 0.95 * n  # both the accept and the reject path ran
    # Power: the draft model's own distribution of token 1 is far from the verify one.
    q1 = next_probs(llm.drafter.model, [prompt + [a] for a in range(VOCAB)], llm.drafter.mode, params)
    t0 = rows[:, 0]
    e_q = sum(q1[tuple(prompt + [a])] * int((t0 == a).sum()) for a in range(VOCAB))
    e_p = sum(p1[tuple(prompt + [a])] * int((t0 == a).sum()) for a in range(VOCAB))
    assert tv(e_q, e_p) > 2 * math.sqrt(VOCAB / n)


# ---------------------------------------------------------------- refusals


def test_a_draft_model_with_another_vocabulary_is_refused():
    cfg, sd, _ = tiny_model("llama", seed=1)
    other_cfg, other_sd, _ = tiny_model("llama", seed=2, vocab_size=128)
    rec = resolve_recipe("draft-model", draft_model="small-vocab")
    with pytest.raises(SelfspecError, match="draft model small-vocab has a vocabulary of 128 tokens, the model "
                                            "tiny one of 256"):
        build_draft_model(cfg, None, "tiny", (other_cfg, other_sd, None, "small-vocab"), rec)


class WordTokenizer:
    def __init__(self, shift: int):
        self.shift = shift

    def encode(self, text: str) -> list[int]:
        return [len(w) + self.shift for w in text.split()]


def test_a_draft_model_with_another_tokenizer_is_refused():
    cfg, sd, _ = tiny_model("llama", seed=1)
    rec = resolve_recipe("draft-model", draft_model="other")
    with pytest.raises(SelfspecError, match="draft model other tokenizes text differently from the model tiny"):
        build_draft_model(cfg, WordTokenizer(0), "tiny", (cfg, dict(sd), WordTokenizer(1), "other"), rec)


def test_recipe_options():
    r = resolve_recipe("draft-model", draft_model="m")
    assert (r.storage, r.verify, r.draft, r.draft_model) == ("planes", "full", "full", "m")
    r = resolve_recipe("draft-model", draft="w4a16", verify="w8a16", draft_model="m")
    assert (r.storage, r.verify, r.draft) == ("int8", "w8a16", "w4a16")  # the target stores what verify runs
    with pytest.raises(SelfspecError, match="needs the model that drafts: --draft-model"):
        resolve_recipe("draft-model")
    with pytest.raises(SelfspecError, match="under --recipe draft-model, not 'planes'"):
        resolve_recipe("planes", draft_model="m")
    with pytest.raises(SelfspecError, match="the draft model's mode, not 'ngram'"):
        resolve_recipe("draft-model", draft="ngram", draft_model="m")
    cfg, sd, _ = tiny_model("llama", seed=1)
    with pytest.raises(SelfspecError, match="draft_model=NAME_OR_PATH"):
        build(cfg, sd, None, r, group_size=32)


def test_eval_plans_draft_model_against_its_verify_mode():
    from selfspec.eval.runner import plan_configs

    ar, spec = plan_configs([], ["draft-model"], "small")
    assert (ar.label, ar.recipe, ar.storage) == ("full", "ar", "planes")
    assert (spec.reference, spec.draft) == ("full", "small:full")  # cached results depend on the draft model


# ---------------------------------------------------------------- the command line


def test_cli_generate_with_a_draft_model(tmp_path, capsys, monkeypatch):
    """`generate --recipe draft-model --draft-model DIR --json`: the AR text, and the draft model's extra memory;
    a draft model with another vocabulary is a one-line error naming both models."""
    import json

    from selfspec.cli import main
    from test_cli_errors import assert_clean_error, run, save_byte_tokenizer

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    dirs = {}
    for name, seed, vocab in (("target", 0, 256), ("draft", 5, 256), ("other", 5, 128)):
        dirs[name] = tmp_path / name
        tiny_model("llama", seed=seed, vocab_size=vocab, num_hidden_layers=1 if name != "target" else 2)[2] \
            .save_pretrained(dirs[name])
        save_byte_tokenizer(dirs[name])
    common = ["--model", str(dirs["target"]), "--prompt", "hello there", "--max-new-tokens", "12", "--group-size",
              "32", "--json"]
    assert main(["generate", *common, "--recipe", "ar", "--verify", "full"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "--recipe", "draft-model", "--draft-model", str(dirs["draft"]),
                 "--draft", "w4a16", "--fixed-gamma"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == ref["text"] and out["stats"]["draft_proposed"] > 0
    mem = out["draft_model"]
    assert mem["mode"] == "w4a16" and mem["weight_bytes"] > 0 and mem["kv_bytes"] >= 12 * mem["kv_bytes_per_token"]
    rc, _, err = run(capsys, *common, "--recipe", "draft-model", "--draft-model", str(dirs["other"]))
    assert_clean_error(rc, err, f"draft model {dirs['other']} has a vocabulary of 128 tokens", str(dirs["target"]))
    rc, _, err = run(capsys, *common, "--recipe", "draft-model")
    assert_clean_error(rc, err, "needs the model that drafts: --draft-model NAME_OR_PATH")
    assert main(["bench", "serve", "--shape", "llama-3-8b", "--recipes", "draft-model", "--device", "cuda"]) == 2
    assert "needs real weights (a real draft model): give --model" in capsys.readouterr().err


def test_the_policy_prices_draft_steps_without_the_draft_models_prefill(llm, monkeypatch):
    """A new row's first round catches the draft cache up on its whole prompt: the stats count that time as
    drafting, the timing the gamma policy learns from leaves it out (else one prefill would stop drafting)."""
    import time

    from selfspec.engine.stats import GenerationStats
    from selfspec.speculative.decode import Row, run_round

    catch_up = llm.drafter.catch_up
    monkeypatch.setattr(llm.drafter, "catch_up", lambda *a: (time.sleep(0.3), catch_up(*a)))
    prompt = PROMPTS[1]
    cache = llm.model.new_cache(64)
    llm.model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, llm.verify_mode)
    row = Row(7, len(prompt), greedy(8), None, GenerationStats(), llm.drafter.history(prompt + [7]))
    timing = run_round(llm.model, cache, [row], 3, llm.drafter, llm.verify_mode)
    assert row.stats.draft_s >= 0.3 > timing.draft_s
    before = row.stats.draft_s
    timing = run_round(llm.model, cache, [row], 3, llm.drafter, llm.verify_mode)  # no new row: all drafting
    assert timing.draft_s == pytest.approx(row.stats.draft_s - before) and timing.draft_s > 0
