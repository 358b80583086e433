"""Drafters: the n-gram lookup (longest n first, most recent match, proposal lengths, the incremental index ==
a brute-force rescan), recipe `ngram` (greedy == AR of `full`, batched == solo in the engine, sampling keeps the
verify distribution), and drafter names."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from conftest import RecordedPasses, ShuffledGammaPolicy, check_mixed_batch_equals_solo, tiny_model
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.quant.modes import get_mode
from selfspec.speculative.drafters import (HybridDrafter, NgramDrafter, SelfDraft, TokenHistory, draft_modes,
                                           make_drafter)
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams
from test_speculative import SAMPLING, VOCAB, check_against_verify, draw, next_probs, tv

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- the lookup


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by rescanning: the last n tokens (n = max_n .. min_n) at their most recent earlier start s
    that has a continuation; propose tokens[s + n:], continued periodically up to k tokens."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            start = starts[-1] + n
            text = list(tokens)
            while len(text) < start + k:
                text.append(text[len(text) - (len(tokens) - start)])
            return text[start:start + k]
    return []


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # Suffix [1, 2, 3]: the 3-gram occurs at the start (-> 50); the 1-gram [3] occurs later (-> 60).
    h = TokenHistory([1, 2, 3, 50, 51, 9, 3, 60, 61, 1, 2, 3], min_n=1, max_n=3)
    assert h.lookup(2) == [50, 51]
    assert TokenHistory(h.tokens, min_n=1, max_n=1).lookup(2) == [60, 61]


def test_most_recent_occurrence_wins():
    h = TokenHistory([7, 8, 10, 7, 8, 20, 7, 8], min_n=1, max_n=2)
    assert h.lookup(1) == [20]


def test_proposal_lengths():
    assert TokenHistory([4, 5, 6], 1, 3).lookup(3) == []  # nothing seen twice: no proposal
    assert TokenHistory([4], 1, 3).lookup(3) == []
    assert TokenHistory([4, 5, 6, 4], 1, 3).lookup(4) == [5, 6, 4, 5]  # runs into the suffix: keeps copying
    assert TokenHistory([9, 9, 9, 9], 1, 3).lookup(5) == [9] * 5
    assert TokenHistory([4, 5, 6, 4], 2, 3).lookup(4) == []  # below min_n
    assert TokenHistory([4, 5, 6, 4, 5], 1, 3).lookup(0) == []


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_equals_a_rescan(seed):
    """Random streams over small vocabularies (many matches of every length), appended in chunks as rounds do, read
    after some of them only (as rounds that draft nothing leave the index to the next lookup)."""
    rng = random.Random(seed)
    vocab, min_n, max_n = rng.choice([2, 3, 5, 8]), rng.randint(1, 2), rng.randint(2, 4)
    h = TokenHistory([rng.randrange(vocab) for _ in range(rng.randint(0, 6))], min_n, max_n)
    for _ in range(60):
        h.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 4))])
        assert h.indexed < len(h.tokens)  # appending indexes nothing
        if rng.random() < 0.5:
            k = rng.randint(1, 8)
            assert h.lookup(k) == brute_force_lookup(h.tokens, k, min_n, max_n), (h.tokens, k)
            assert h.indexed == len(h.tokens)


# ---------------------------------------------------------------- names and recipes


def test_drafter_names():
    assert make_drafter("ngram") == NgramDrafter(max_n=3, min_n=1)
    assert make_drafter("ngram:2-4") == NgramDrafter(max_n=4, min_n=2)
    assert isinstance(make_drafter("upper"), SelfDraft)
    assert make_drafter("hybrid:2-4") == HybridDrafter(get_mode("upper"), NgramDrafter(max_n=4, min_n=2))
    assert draft_modes("hybrid:2-4") == draft_modes("hybrid") == ["upper"] and draft_modes("ngram:2-4") == []


@pytest.mark.parametrize("bad,needle", [
    ("ngram:3-1", "1 <= min_n <= max_n"), ("ngram:0-2", "1 <= min_n <= max_n"), ("ngram3", "unknown drafter 'ngram3'"),
    ("ngram:2", "ngram:MIN-MAX"), ("w9a9", "unknown mode 'w9a9'"),
    # tree drafters
    ("hybrid-tree:1", "at least 2 branches"), ("ngram-tree:0", "at least 1 branch"),
    ("tree:w9a9", "unknown mode 'w9a9'"), ("ngram-tree:x", "ngram-tree"), ("tree", "tree:MODE"),
    # hybrid: a lookup, else the upper chain
    ("hybrid:x", "unknown drafter 'hybrid:x'; write ngram or"), ("hybrid:3-1", "1 <= min_n <= max_n")])
def test_bad_drafter_names_say_what_to_write(bad, needle):
    with pytest.raises(SelfspecError, match=needle):
        make_drafter(bad)


def test_ngram_recipe_and_overrides():
    r = resolve_recipe("ngram")
    assert (r.storage, r.verify, r.draft) == ("planes", "full", "ngram")
    assert resolve_recipe("ngram", draft="ngram:2-5").draft == "ngram:2-5"
    assert resolve_recipe("ngram", verify="w8a16").storage == "planes"
    assert resolve_recipe("ngram", verify="bf16").storage == "dense"  # no draft mode: any verify mode's storage
    assert resolve_recipe("qspec", draft="ngram").storage == "int4"  # lookup drafts for another verify mode
    with pytest.raises(SelfspecError, match="ngram:MIN-MAX"):
        resolve_recipe("ngram", draft="ngram:5")
    with pytest.raises(SelfspecError, match="recipe 'ar' does not draft"):
        resolve_recipe("ar", draft="ngram")


# ---------------------------------------------------------------- recipe ngram on a tiny model

REPETITIVE = [[5, 9, 200, 17, 3, 5, 9, 200, 17, 3, 5, 9], [40, 41, 42, 43] * 4, [7] * 6, [11, 250, 3, 99, 64]]


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=1)
    return build(cfg, sd, None, resolve_recipe("ngram"), group_size=32)


def greedy(n):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_ngram_equals_ar(llm, gamma):
    proposed = accepted = rounds_without = 0
    for p in REPETITIVE:
        ref = llm.generate(p, greedy(40), gamma=0).token_ids
        out = llm.generate(p, greedy(40), gamma=gamma)
        assert out.token_ids == ref, (p, gamma)
        s = out.stats
        proposed, accepted = proposed + s.draft_proposed, accepted + s.draft_accepted
        rounds_without += s.rounds * gamma - s.draft_proposed
    assert 0 < accepted < proposed  # both paths ran
    assert rounds_without > 0  # rows without a full proposal were verified too


def test_verify_pass_stops_at_the_longest_proposal(llm):
    """Each round verifies the pending token and the proposal only (no padding to gamma): a round without a
    match is a one-token plain step."""
    from selfspec.engine.stats import GenerationStats
    from selfspec.speculative.decode import decode

    plain_steps = 0
    for prompt in REPETITIVE:
        model, stats = RecordedPasses(llm.model), GenerationStats()
        for _ in decode(model, prompt, llm.verify_mode, NgramDrafter(), 6, greedy(30), stats):
            pass  # to the end of the cache
        rounds = [width for _, width in model.shapes[1:]]  # [0]: the prefill
        assert len(rounds) == stats.rounds and sum(rounds) == stats.rounds + stats.draft_proposed
        plain_steps += rounds.count(1)
    assert plain_steps > 0


def test_engine_batched_equals_solo_with_ngram_rows_mixed(llm):
    """Repetitive prompts (lookups match) and random ones (mostly no match), per-request gammas with the policy's,
    greedy rows next to sampling rows, a pool small enough to preempt (a resumed row rebuilds its history): every
    greedy request equals its solo run, every seeded sampling request its solo seeded run."""
    s = check_mixed_batch_equals_solo(llm, REPETITIVE)
    assert s.num_preemptions > 0
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert s.num_draft_tokens < 4 * s.num_drafts  # some rows proposed fewer than k


# ---------------------------------------------------------------- sampling keeps the verify distribution


@pytest.fixture(scope="module")
def sampling_setup():
    """A one-layer model over 16 tokens and a prompt holding every token, so the lookup proposes whatever the
    first emitted token t0 is."""
    cfg, sd, _ = tiny_model("llama", seed=9, vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=1)
    llm = build(cfg, sd, None, resolve_recipe("ngram"), group_size=32)
    prompt = [3, 7, 1, 12, 5, 3, 7] + list(range(VOCAB))
    params = SamplingParams(**SAMPLING)
    m = llm.model
    p0 = next_probs(m, [prompt], llm.verify_mode, params)[tuple(prompt)]
    p1 = next_probs(m, [prompt + [a] for a in range(VOCAB)], llm.verify_mode, params)
    p2 = next_probs(m, [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], llm.verify_mode, params)
    return llm, prompt, p0, p1, p2


def test_ngram_sampling_matches_verify_distribution(sampling_setup):
    """Temperature 1, 2500 seeds: tokens 1 and 2 (token 1 is the first judged proposal: accepted with probability
    p(d), else drawn from p without d) follow the verify distribution; acceptance is sum p(d) as predicted."""
    llm, prompt, p0, p1, p2 = sampling_setup
    n = 2500
    rows = draw(llm, prompt, n, gamma=2)
    check_against_verify(rows, prompt, p0, p1, p2)
    t0, t1, acc = rows[:, 0], rows[:, 1], rows[:, 3].bool()
    proposal = {a: NgramDrafter().history(prompt + [a]).lookup(2)[0] for a in range(VOCAB)}
    p_acc = torch.tensor([float(p1[tuple(prompt + [a])][proposal[a]]) for a in t0.tolist()], dtype=torch.float64)
    assert 0.1 * n < int(acc.sum()) < 0.9 * n  # both the accept and the reject path ran, often
    assert abs(int(acc.sum()) - p_acc.sum()) < 4 * math.sqrt((p_acc * (1 - p_acc)).sum()) + 1
    assert all(int(t1[i]) == proposal[int(t0[i])] for i in range(n) if acc[i])
    # Power: had the proposals been emitted unchecked, token 1 would be the lookup's, far from p.
    unchecked = torch.bincount(torch.tensor([proposal[a] for a in t0.tolist()]), minlength=VOCAB).double()
    e1 = sum(p1[tuple(prompt + [a])] * int((t0 == a).sum()) for a in range(VOCAB))
    assert tv(unchecked, e1) > 2 * math.sqrt(VOCAB / n)


def test_bench_lookup_runs_on_the_cpu(capsys):
    from selfspec.cli import main

    assert main(["bench", "lookup", "--batch", "2", "--history", "64", "300", "--rounds", "5"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("2", "64"), ("2", "300")]
    assert all(float(r[3]) > 0 for r in rows)  # us per round, lookup and commit


# ---------------------------------------------------------------- recipe hybrid: lookup, else the upper chain


@pytest.fixture(scope="module")
def hybrid():
    cfg, sd, _ = tiny_model("llama", seed=1)
    return build(cfg, sd, None, resolve_recipe("hybrid"), group_size=32)


def prefilled_rows(llm, prompts: list[list[int]], params: list[SamplingParams]):
    """A cache holding each prompt but its last token (pending), and the rows over it."""
    from selfspec.engine.stats import GenerationStats
    from selfspec.model import prefill
    from selfspec.speculative.decode import Row, make_generator

    cache = llm.model.new_cache(64, len(prompts))
    rows = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        prefill(llm.model, p[:-1], cache.rows(i, i + 1), llm.verify_mode)
        rows.append(Row(p[-1], len(p) - 1, sp, make_generator(sp, llm.model.device), GenerationStats(),
                        llm.drafter.history(p)))
    pending = torch.tensor([r.pending for r in rows])
    lengths = torch.tensor([[r.length] for r in rows])
    return cache, rows, pending, lengths


def test_hybrid_proposes_lookups_and_chains_where_lookups_keep_missing(hybrid):
    """A row whose lookup matches proposes it; with chain_after 2 one that misses takes a plain step, and chains
    from its second miss in a row on (the default, 1, chains at once). A round with no chain runs no draft step;
    with one, k steps run for the batch: the chaining row proposes the `upper` chain, the others keep their lookups
    (or nothing), and a sampling row that does not chain draws nothing from its generator (it draws what its solo
    run draws)."""
    k, match, miss = 4, REPETITIVE[0], [11, 250, 3, 99, 64]
    assert hybrid.drafter == make_drafter("hybrid") and hybrid.drafter.chain_after == 1
    drafter = replace(hybrid.drafter, chain_after=2)
    assert drafter.mode.name == "upper"
    assert drafter.history(miss).lookup(k) == [] and len(drafter.history(match).lookup(k)) == k
    lookup = drafter.history(match).lookup(k)
    sampled = SamplingParams(temperature=1.0, seed=5, max_new_tokens=8)
    cache, rows, pending, lengths = prefilled_rows(hybrid, [match, miss, match], [greedy(8), greedy(8), sampled])
    state = rows[2].gen.get_state()
    model = RecordedPasses(hybrid.model)
    first = drafter.propose(model, cache, rows, pending, lengths, k)  # the row's first miss: a plain step
    assert model.shapes == [] and first.counts == [k, 0, k] and first.q == [None] * 3
    assert first.tokens[0].tolist() == first.tokens[2].tolist() == lookup
    second = drafter.propose(model, cache, rows, pending, lengths, k)  # its second miss in a row: the chain
    assert model.shapes == [(3, 1)] * k and second.counts == [k] * 3 and second.q == [None] * 3
    assert torch.equal(rows[2].gen.get_state(), state)
    chains = SelfDraft(drafter.mode).propose(hybrid.model, cache, rows, pending, lengths, k).tokens
    assert second.tokens.tolist() == [lookup, chains[1].tolist(), lookup]
    assert chains[0].tolist() != lookup  # the lookup rows' own drafts were there to take, and were not taken
    rows[1].history.extend([11, 250])  # now it matches again: its streak ends
    third = drafter.propose(model, cache, rows, pending, lengths, k)
    assert rows[1].history.misses == 0 and third.counts == [k] * 3 and len(model.shapes) == k


@pytest.mark.parametrize("gamma,chain_after", [(2, 1), (5, 2)])
def test_greedy_hybrid_equals_ar_with_every_kind_of_round(hybrid, gamma, chain_after, monkeypatch):
    from selfspec.bench.traces import record

    monkeypatch.setattr(hybrid, "drafter", replace(hybrid.drafter, chain_after=chain_after))
    for p in REPETITIVE:
        ar = hybrid.generate(p, greedy(30), gamma=0).token_ids
        assert hybrid.generate(p, greedy(30), gamma=gamma).token_ids == ar
    rounds = record(hybrid, REPETITIVE, gamma, 30)  # what each round paid, from the passes it ran
    assert {r.kind for r in rounds} == {"lookup", "draft"} | ({"none"} if chain_after > 1 else set())
    assert all(r.draft_steps == (gamma if r.kind == "draft" else 0) for r in rounds)


def test_engine_batched_equals_solo_with_hybrid_rows_mixed(hybrid):
    """As with ngram: rows that match and rows that do not, greedy next to seeded sampling rows, per-request gammas
    next to the policy's, a small pool: every request equals its solo run."""
    s = check_mixed_batch_equals_solo(hybrid, REPETITIVE)
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


@pytest.mark.parametrize("recipe", ["ngram", "hybrid"])
def test_engine_batched_equals_solo_over_shuffled_schedules(llm, hybrid, recipe):
    """The same mix under policies whose drafts per round are drawn at random (seeded), so that the batches, the
    groups by k and the preemptions differ from schedule to schedule and not with this machine's timings. A sampling
    row's draws follow its drafter's state (the hybrid's miss streak): a sequence preempted again while its resume
    still prefills must keep the state it was first preempted with (seeds 1 and 3 lost it)."""
    for seed in range(6):
        s = check_mixed_batch_equals_solo(llm if recipe == "ngram" else hybrid, REPETITIVE, ShuffledGammaPolicy(seed))
        assert s.num_preemptions > 0
