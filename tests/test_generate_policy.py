"""`generate` picks each round's drafts with the serving engine's gamma policy (speculative/policy.py), --gamma as the
cap; --fixed-gamma (LLM fixed_gamma) drafts gamma tokens every round. Greedy output stays AR output either way."""
import pytest

import selfspec
from conftest import tiny_model
from selfspec.cli import main
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.speculative import decode as decode_module
from selfspec.speculative.decode import decode
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

N_NEW = 16


def make_llm(gamma: int, fixed_gamma: bool = False):
    cfg, sd, _ = tiny_model("llama", seed=3)
    return build(cfg, sd, None, resolve_recipe("planes"), group_size=32, gamma=gamma, fixed_gamma=fixed_gamma)


def params() -> SamplingParams:
    return SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)


def drafts_per_round(llm, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(tokens, drafts proposed in each round) of a streamed greedy generation."""
    proposed, before, out = [], 0, None
    for _, _, out in llm.stream(prompt, params()):
        if out.stats.rounds > len(proposed):
            proposed.append(out.stats.draft_proposed - before)
            before = out.stats.draft_proposed
    return out.token_ids, proposed


def test_fixed_gamma_drafts_gamma_every_round():
    llm = make_llm(3, fixed_gamma=True)
    prompt = list(range(5, 15))
    tokens, proposed = drafts_per_round(llm, prompt)
    assert proposed and all(k == 3 for k in proposed)
    assert tokens == llm.generate(prompt, params(), gamma=0).token_ids


def test_policy_picks_within_the_cap():
    llm = make_llm(3)
    prompt = list(range(5, 15))
    tokens, proposed = drafts_per_round(llm, prompt)
    # the policy's exploration: a plain round measures the verify step, then one draft measures the draft step
    assert proposed[:2] == [0, 1]
    assert all(0 <= k <= 3 for k in proposed)
    assert llm.policy.verify_cost and llm.policy.acceptance is not None  # it learned from the rounds
    assert tokens == llm.generate(prompt, params(), gamma=0).token_ids
    out = llm.generate(prompt, params(), gamma=2)  # a per-call gamma is fixed, as a request's in the engine
    assert out.stats.draft_proposed == 2 * out.stats.rounds


class StepClock:
    """perf_counter for the decode loop: each reading one second after the last, so every pass measures one
    second whatever its width (real timings on a shared CPU could make a wider verify pass look cheaper)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_policy_stops_drafting_when_drafts_lose(monkeypatch):
    """Every draft rejected: after its one exploring round of one draft, the policy decodes plainly (its next
    probe of drafting is 4 x 16 rounds away)."""
    monkeypatch.setattr(decode_module, "time", StepClock())
    llm = make_llm(4)
    stats = GenerationStats()
    reject_all = lambda drafts, targets: (0, targets[0])  # noqa: E731
    n = 0
    for _ in decode(llm.model, list(range(5, 15)), llm.verify_mode, llm.draft_mode, 4,
                    SamplingParams(max_new_tokens=64, ignore_eos=True), stats,
                    accept=reject_all, policy=GammaPolicy(4)):
        n += 1  # the prefill's token, then one per round
        if n > 40:
            break
    assert stats.rounds == 40 and stats.draft_proposed == 1 and stats.draft_accepted == 0


def test_cli_fixed_gamma_reaches_load(monkeypatch, capsys):
    seen = {}

    def fake_load(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise SelfspecError("not loading in this test")

    monkeypatch.setattr(selfspec, "load", fake_load)
    assert main(["generate", "--prompt", "hi", "--gamma", "3", "--fixed-gamma"]) == 2
    assert seen["args"][4] == 3 and seen["kwargs"]["fixed_gamma"] is True
    assert main(["generate", "--prompt", "hi", "--gamma", "3"]) == 2
    assert seen["kwargs"]["fixed_gamma"] is False
    capsys.readouterr()


def test_load_passes_fixed_gamma(monkeypatch):
    cfg, sd, _ = tiny_model("llama", seed=3)
    monkeypatch.setattr(selfspec.loading, "resolve", lambda model: (cfg, sd, None, "tiny"))
    llm = selfspec.load(gamma=2, group_size=32, fixed_gamma=True)
    assert llm.fixed_gamma and llm.policy.max_gamma == 2
    out = llm.generate(list(range(5, 15)), params())
    assert out.stats.draft_proposed == 2 * out.stats.rounds
