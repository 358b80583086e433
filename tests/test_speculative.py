"""Speculative decoding is lossless: greedy == AR greedy of the verify mode, rollback leaves the exact AR cache,
and rejection sampling emits the verify distribution."""
from __future__ import annotations

import math
import time

import pytest
import torch

from conftest import tiny_model
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.quant.modes import MODES
from selfspec.speculative.decode import Row, decode, run_round
from selfspec.speculative.recipes import Recipe, resolve_recipe
from selfspec.speculative.sampling import SamplingParams, sample, to_probs
from selfspec.speculative.verify import accept_greedy, accept_rejection

GROUP = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def make_llm(recipe, arch="llama", seed=0, **overrides):
    cfg, sd, _ = tiny_model(arch, seed=seed, **overrides)
    return build(cfg, sd, None, recipe, group_size=GROUP)


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 are pooled. Cells of zero probability must be empty."""
    observed, expected = observed.double(), expected.double()
    assert observed.sum() == pytest.approx(float(expected.sum()), rel=1e-6)
    zero = expected < 1e-9
    assert observed[zero].sum() == 0, f"tokens of zero verify probability were emitted: {observed[zero]}"
    o, e = observed[~zero], expected[~zero]
    small = e < 5
    if small.any():
        o = torch.cat((o[~small], o[small].sum()[None]))
        e = torch.cat((e[~small], e[small].sum()[None]))
    if len(e) < 2:
        return 1.0
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2.0), stat / 2))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


# ---------------------------------------------------------------- (a) greedy is lossless

RECIPES = {
    "qspec": resolve_recipe("qspec"),  # int4: draft w4a4, verify w4a16
    "planes": resolve_recipe("planes"),  # planes: draft upper, verify full
    "planes-w4a8-w8a16": resolve_recipe("planes", draft="w4a8", verify="w8a16"),
    "planes-w4a4": resolve_recipe("planes", draft="w4a4"),
    "int4g": Recipe("int4g", "int4g", "w4a16", "w4a8"),  # int4g: draft w4a8 (int32 sums over K), verify w4a16
}
N_NEW = 24


@pytest.fixture(scope="module", params=list(RECIPES))
def greedy_setup(request):
    recipe = RECIPES[request.param]
    llm = make_llm(recipe, "qwen2" if request.param == "qspec" else "llama", seed=1)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    params = lambda: SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)  # noqa: E731
    refs = [llm.generate(p, params(), gamma=0).token_ids for p in prompts]  # AR in the verify mode, once
    return llm, prompts, refs, params


def test_ar_reference_is_verify_mode(greedy_setup):
    """The reference really is the verify mode's AR output, and the draft mode alone would differ from it."""
    llm, prompts, refs, params = greedy_setup
    assert all(len(r) == N_NEW for r in refs)
    m = llm.model
    for p, r in zip(prompts[:3], refs[:3]):  # no cache: whole sequence in the verify mode, argmax per position
        seq = torch.tensor([p + r])
        logits = m(seq, torch.arange(seq.shape[1]), m.new_cache(seq.shape[1]), llm.verify_mode)[0]
        assert logits[len(p) - 1 :].argmax(-1)[:N_NEW].tolist() == r
    draft_ar = [list(_take(decode(m, p, llm.draft_mode, None, 0, params(), GenerationStats()), N_NEW))
                for p in prompts]
    assert draft_ar != refs


def _take(chunks, n):
    out = []
    for c in chunks:
        out.extend(c)
        if len(out) >= n:
            return out[:n]
    return out


@pytest.mark.parametrize("kv", ["bf16", "hier"])
def test_decode_continues_a_cache_that_holds_the_prompt_start(kv):
    """decode(start=S) over a cache holding a prompt's first S positions == decode of the whole prompt (greedy,
    speculative): what a long-context benchmark runs from its filled cache."""
    from selfspec.model import prefill
    from selfspec.quant.modes import prompt_mode

    llm = make_llm(RECIPES["planes"], seed=1)
    model, verify, draft = llm.model, llm.verify_mode, llm.draft_mode
    model.set_kv_format(kv, 16)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    params = lambda: SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)  # noqa: E731
    whole = _take(decode(model, prompt, verify, draft, 3, params(), GenerationStats()), N_NEW)
    cache = model.new_cache(len(prompt) + N_NEW + 8)
    prefill(model, prompt[:35], cache, prompt_mode(verify))
    stats = GenerationStats()
    assert _take(decode(model, prompt[35:], verify, draft, 3, params(), stats, cache=cache, start=35), N_NEW) == whole
    assert stats.draft_proposed > 0
    with pytest.raises(SelfspecError, match="continues a given cache"):
        next(decode(model, prompt, verify, draft, 3, params(), GenerationStats(), start=35))


@pytest.mark.parametrize("gamma", range(1, 7))
def test_greedy_speculative_equals_ar(greedy_setup, gamma):
    llm, prompts, refs, params = greedy_setup
    proposed = accepted = 0
    for p, ref in zip(prompts, refs):
        out = llm.generate(p, params(), gamma=gamma)
        assert out.token_ids == ref, (p, gamma)
        assert out.finish_reason == "length"
        s = out.stats
        assert s.new_tokens == N_NEW and s.draft_proposed <= gamma * s.rounds
        proposed, accepted = proposed + s.draft_proposed, accepted + s.draft_accepted
    assert 0 < accepted < proposed  # drafts were both accepted and rejected: both paths ran


def test_greedy_streamed_chunks_equal_generate(greedy_setup):
    llm, prompts, refs, params = greedy_setup
    chunks = [ids for _, ids, _ in llm.stream(prompts[0], params(), gamma=4)]
    assert sum(chunks, []) == refs[0]
    assert max(len(c) for c in chunks) > 1  # some round committed several tokens


def test_greedy_lossless_up_to_the_context_limit():
    """Near max_seq_len the draft count shrinks; output still equals AR and fills the context exactly."""
    llm = make_llm(RECIPES["planes-w4a4"], seed=2, max_position_embeddings=24)
    prompt = [5, 9, 200, 17, 3, 3, 80]
    room = 24 - len(prompt)
    ref = llm.generate(prompt, SamplingParams(max_new_tokens=room, ignore_eos=True), gamma=0).token_ids
    assert len(ref) == room
    for gamma in (1, 3, 6, 32):
        out = llm.generate(prompt, SamplingParams(max_new_tokens=room, ignore_eos=True), gamma=gamma)
        assert out.token_ids == ref, gamma


class TimedModel:
    """A stand-in model whose passes take a known time per mode (draft 10 ms, verify 30 ms)."""
    device = torch.device("cpu")

    def __init__(self, draft, verify):
        self.cost = {draft.name: 0.01, verify.name: 0.03}

    def __call__(self, tokens, pos, cache, mode):
        time.sleep(self.cost[mode.name])
        return torch.randn(*tokens.shape, 11)


def test_round_time_splits_into_draft_and_verify():
    """The round's draft time is its k draft steps and its verify time the verify pass (the gamma policy
    compares them), however the passes are queued."""
    draft, verify = MODES["upper"], MODES["full"]
    rows = [Row(3, 5, SamplingParams(max_new_tokens=8), None, GenerationStats()) for _ in range(2)]
    timing = run_round(TimedModel(draft, verify), None, rows, 3, draft, verify)
    assert 0.03 <= timing.draft_s < 0.03 + 0.025
    assert 0.03 <= timing.verify_s < 0.03 + 0.025


def test_accept_greedy_unit():
    target = [3, 5, 7, 1]  # the verify pass's argmax at the pending token and each draft
    assert accept_greedy([3, 5, 7], target) == (3, 1)
    assert accept_greedy([3, 5, 6], target) == (2, 7)
    assert accept_greedy([4, 5, 7], target) == (0, 3)
    assert accept_greedy([], target[:1]) == (0, 3)


# ---------------------------------------------------------------- (b) rollback leaves the AR cache


class RefCache:
    """The cache plain AR decoding in the verify mode builds, advanced as tokens are committed."""

    def __init__(self, model, prompt, mode, max_len):
        self.model, self.mode = model, mode
        self.cache = model.new_cache(max_len)
        model(torch.tensor([prompt]), torch.arange(len(prompt)), self.cache, mode)
        self.cache.commit(len(prompt))

    def advance(self, token: int) -> None:
        L = self.cache.length
        self.model(torch.tensor([[token]]), torch.tensor([L]), self.cache, self.mode)
        self.cache.commit(L + 1)


@pytest.mark.parametrize("recipe,temperature", [("qspec", 0.0), ("planes-w4a4", 0.0), ("planes-w4a4", 1.0)])
@torch.inference_mode()
def test_rollback_leaves_exact_ar_cache(recipe, temperature):
    llm = make_llm(RECIPES[recipe], seed=3)
    model, verify, draft = llm.model, llm.verify_mode, llm.draft_mode
    prompt = [7, 100, 31, 4, 250, 66, 12, 9]
    gamma, max_len = 4, 60
    params = SamplingParams(temperature=temperature, seed=5, max_new_tokens=40)
    cache = model.new_cache(max_len)
    ref = RefCache(model, prompt, verify, max_len)
    stats = GenerationStats()
    emitted, checked_rejections = [], 0
    prev_proposed = prev_accepted = 0
    for chunk in decode(model, prompt, verify, draft, gamma, params, stats, cache=cache):
        # Every committed token but the newest (pending, not yet fed) has its KV in the cache.
        for t in ([emitted[-1]] if emitted else []) + chunk[:-1]:
            ref.advance(t)
        emitted.extend(chunk)
        L = cache.length
        assert L == len(prompt) + len(emitted) - 1 == ref.cache.length
        # Not bit-exact: the verify pass computes k+1 positions in one matmul, AR one at a time (fp32 GEMM
        # blocking differs), which moves a few values by ~1e-6; a draft-mode row would be off by ~1e-1 (below).
        torch.testing.assert_close(cache.k[:, :, :, :L], ref.cache.k[:, :, :, :L], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v[:, :, :, :L], ref.cache.v[:, :, :, :L], atol=1e-5, rtol=1e-5)
        rejected = (stats.draft_proposed - prev_proposed) - (stats.draft_accepted - prev_accepted)
        if rejected:
            checked_rejections += 1
            # Rollback only moves `length`: rows L.. still hold the rejected tokens' KV, which nothing may read.
            assert cache.k[:, :, :, L : L + rejected].abs().amin(-1).gt(0).all()
        prev_proposed, prev_accepted = stats.draft_proposed, stats.draft_accepted
        if L + gamma + 2 >= max_len:
            break
    assert checked_rejections >= 3, "no round rejected a draft: the rollback path was not exercised"
    # Power: the same tokens' KV in the draft mode is far from the verify mode's, so a draft row left in
    # the committed range would fail the comparison above.
    L = cache.length
    draft_ref = RefCache(model, prompt + emitted[:-1], draft, max_len).cache
    assert (draft_ref.k[:, :, :, len(prompt):L] - cache.k[:, :, :, len(prompt):L]).abs().amax(-1).min() > 1e-4
    # The next token computed from the speculative cache equals AR's (the pending token fed at position L).
    a = model(torch.tensor([[emitted[-1]]]), torch.tensor([L]), cache, verify)
    b = model(torch.tensor([[emitted[-1]]]), torch.tensor([L]), ref.cache, verify)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- (c) sampling keeps the verify distribution

VOCAB = 16
# top-k: drafts may have q > 0 where p == 0 and p > 0 where q == 0; it also concentrates the distributions.
SAMPLING = dict(temperature=1.0, top_k=4)


@torch.inference_mode()
def next_probs(model, prefixes: list[list[int]], mode, params) -> dict[tuple, torch.Tensor]:
    """Exact next-token probabilities after each prefix (all the same length), whole sequence, no cache reuse."""
    seq = torch.tensor(prefixes)
    logits = model(seq, torch.arange(seq.shape[1]), model.new_cache(seq.shape[1], batch=len(prefixes)), mode)
    probs = to_probs(logits[:, -1], params)
    return {tuple(p): probs[i].double() for i, p in enumerate(prefixes)}


@pytest.fixture(scope="module")
def sampling_setup():
    # One layer keeps the thousands of generations cheap; the decoding loop is the same. The seed gives a
    # draft that is rejected at token 1 about 19% of the time.
    llm = make_llm(resolve_recipe("planes", draft="w4a4"), seed=9, vocab_size=VOCAB, eos_token_id=None,
                   num_hidden_layers=1)
    prompt = [3, 7, 1, 12, 5]
    params = SamplingParams(**SAMPLING)
    m = llm.model
    p0 = next_probs(m, [prompt], llm.verify_mode, params)[tuple(prompt)]
    p1 = next_probs(m, [prompt + [a] for a in range(VOCAB)], llm.verify_mode, params)
    p2 = next_probs(m, [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], llm.verify_mode, params)
    # The first draft's distribution: draft mode on top of the prompt's verify-mode KV (what decode does).
    with torch.inference_mode():
        cache = m.new_cache(len(prompt) + 1, batch=VOCAB)
        m(torch.tensor([prompt] * VOCAB), torch.arange(len(prompt)), cache, llm.verify_mode)
        logits = m(torch.arange(VOCAB)[:, None], torch.tensor([len(prompt)]), cache, llm.draft_mode)[:, -1]
    q = to_probs(logits, params).double()
    q1 = {tuple(prompt + [a]): q[a] for a in range(VOCAB)}
    return llm, prompt, p0, p1, p2, q1


def draw(llm, prompt, n, gamma):
    """n seeded generations of 3 tokens; for each, whether token 1 was an accepted draft."""
    rows = []
    for seed in range(n):
        params = SamplingParams(**SAMPLING, seed=seed, max_new_tokens=3, ignore_eos=True)
        chunks = [ids for _, ids, _ in llm.stream(prompt, params, gamma=gamma)]
        toks = sum(chunks, [])
        # chunk 0 is the prefill's token; token 1 is an accepted draft iff round 1 committed more than one token.
        rows.append((*toks[:3], gamma > 0 and len(chunks[1]) > 1))
    return torch.tensor(rows, dtype=torch.long)


def check_against_verify(rows, prompt, p0, p1, p2, q1=None):
    n = len(rows)
    t0, t1, t2, acc = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3].bool()
    count = lambda t: torch.bincount(t, minlength=VOCAB)  # noqa: E731
    pvals = {"t0": chi2_pvalue(count(t0), n * p0)}
    # Token 1 given token 0: p(. | prompt, t0), summed over the draws' own t0.
    e1 = sum(p1[tuple(prompt + [a])] * int((t0 == a).sum()) for a in range(VOCAB))
    pvals["t1"] = chi2_pvalue(count(t1), e1)
    # Token 2 given (t0, t1) is p(. | prefix) whether token 1 was accepted (token 2 drawn in the same round)
    # or was the rejection's resample (token 2 drawn in the next round).
    for name, sel in (("t2", torch.ones_like(acc)), ("t2|accepted", acc), ("t2|rejected", ~acc)):
        if sel.sum() == 0:
            continue
        e2 = torch.zeros(VOCAB, dtype=torch.float64)
        for a, b in rows[sel][:, :2].tolist():
            e2 += p2[tuple(prompt + [a, b])]
        pvals[name] = chi2_pvalue(count(t2[sel]), e2)
    assert min(pvals.values()) > 1e-4, pvals
    # Marginal total variation within a bound derived from n (E[TV] <= sqrt(V / n) / 2; allow 2x).
    m1 = sum(p0[a] * p1[tuple(prompt + [a])] for a in range(VOCAB))
    assert tv(count(t1).double(), m1) < math.sqrt(VOCAB / n), tv(count(t1).double(), m1)
    if q1 is not None:
        # Token 1 is an accepted draft with probability sum_x min(p, q) = 1 - TV(p, q), given t0.
        p_acc = torch.tensor([float(torch.minimum(p1[tuple(prompt + [a])], q1[tuple(prompt + [a])]).sum())
                              for a in t0.tolist()], dtype=torch.float64)
        assert abs(int(acc.sum()) - p_acc.sum()) < 4 * math.sqrt((p_acc * (1 - p_acc)).sum()) + 1
        # Power: had drafts been emitted unchecked, token 1 would follow q and fail this test.
        e1q = sum(q1[tuple(prompt + [a])] * int((t0 == a).sum()) for a in range(VOCAB))
        assert tv(e1q, e1) > 0.5 * math.sqrt(VOCAB / n)
        with pytest.raises(AssertionError):
            assert chi2_pvalue(count(t1), e1q) > 1e-4
    return pvals


@pytest.mark.parametrize("gamma,n", [(2, 2500), (3, 1500)])
def test_speculative_sampling_matches_verify_distribution(sampling_setup, gamma, n):
    llm, prompt, p0, p1, p2, q1 = sampling_setup
    rows = draw(llm, prompt, n, gamma)
    acc = rows[:, 3].bool()
    assert 0.1 * n < int((~acc).sum()) < 0.5 * n  # both the accept and the reject path ran, often
    check_against_verify(rows, prompt, p0, p1, p2, q1)


def test_ar_sampling_matches_verify_distribution(sampling_setup):
    llm, prompt, p0, p1, p2, _ = sampling_setup
    check_against_verify(draw(llm, prompt, 2000, gamma=0), prompt, p0, p1, p2)


def test_sampling_is_seeded():
    llm = make_llm(resolve_recipe("qspec"), seed=5)
    run = lambda s: llm.generate([4, 8, 15], SamplingParams(temperature=1.0, seed=s, max_new_tokens=16,  # noqa: E731
                                                             ignore_eos=True), gamma=3).token_ids
    assert run(1) == run(1) and run(1) != run(2)


def test_draft_and_verify_use_the_same_transform():
    """Draft mode == verify mode: q equals p only if temperature/top-k/top-p are applied alike; then every
    draft is accepted."""
    llm = make_llm(resolve_recipe("planes", draft="full", verify="full"), seed=6)
    stats = GenerationStats()
    for seed in range(5):
        out = llm.generate([1, 2, 3, 4], SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=seed,
                                                        max_new_tokens=30, ignore_eos=True), gamma=4)
        stats.draft_proposed += out.stats.draft_proposed
        stats.draft_accepted += out.stats.draft_accepted
    assert stats.draft_proposed > 50 and stats.acceptance_rate > 0.99


# ---------------------------------------------------------------- accept_rejection and to_probs, unit level


def _dist(*xs):
    t = torch.tensor(xs, dtype=torch.float32)
    return t / t.sum()


PQ = {
    "random": (_dist(5, 1, 3, 0.5, 2), _dist(1, 4, 1, 2, 2)),
    "q zero where p > 0": (_dist(2, 3, 1, 4, 0), _dist(0, 5, 0, 5, 1)),
    "p zero where q > 0": (_dist(0, 3, 1, 0, 6), _dist(4, 1, 1, 3, 1)),
    "p == q": (_dist(1, 2, 3, 4, 5), _dist(1, 2, 3, 4, 5)),
    "disjoint": (_dist(1, 1, 0, 0, 0), _dist(0, 0, 1, 2, 1)),
}


@pytest.mark.parametrize("case", list(PQ))
def test_accept_rejection_emits_p(case):
    p, q = PQ[case]
    n = 8000
    gen = torch.Generator().manual_seed(17)
    counts, accepted = torch.zeros(5), 0
    bonus = _dist(1, 1, 1, 1, 1)
    for _ in range(n):
        d = sample(q, gen)
        k, nxt = accept_rejection([d], q[None], torch.stack((p, bonus)), gen)
        counts[d if k == 1 else nxt] += 1
        accepted += k
    assert chi2_pvalue(counts, n * p.double()) > 1e-4
    assert tv(counts, p) < math.sqrt(5 / n)
    expected_acc = float(torch.minimum(p, q).sum())  # P(accept) = sum min(p, q) = 1 - TV(p, q)
    assert abs(accepted / n - expected_acc) < 4 * math.sqrt(0.25 / n) + 1e-9
    if case == "p == q":
        assert accepted == n
    if case == "disjoint":
        assert accepted == 0


def test_accept_rejection_multi_draft_positions():
    """With k drafts, the token emitted at each position (given it is reached) follows that position's p."""
    g = torch.Generator().manual_seed(3)
    k, V, n = 3, 6, 6000
    p = torch.softmax(2 * torch.randn(k + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(k, V, generator=g), -1)
    q[1, 2] = 0  # a zero in q
    q = q / q.sum(-1, keepdim=True)
    counts = torch.zeros(k + 1, V)
    for _ in range(n):
        drafts = [sample(q[i], g) for i in range(k)]
        m, nxt = accept_rejection(drafts, q, p, g)
        for i, t in enumerate(drafts[:m] + [nxt]):
            counts[i, t] += 1
    for i in range(k + 1):
        reached = counts[i].sum()
        assert reached > 300
        assert chi2_pvalue(counts[i], reached * p[i].double()) > 1e-4, i


def test_to_probs_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(to_probs(logits, SamplingParams(temperature=t)), torch.softmax(logits / t, -1))


def test_to_probs_top_k_keeps_k():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 50, generator=g)
    for k in (1, 3, 10, 50, 80):
        probs = to_probs(logits, SamplingParams(temperature=0.9, top_k=k))
        kept = probs > 0
        assert (kept.sum(-1) == min(k, 50)).all()
        top = logits.topk(min(k, 50), -1).indices
        assert kept.gather(-1, top).all()
        ref = torch.softmax((logits / 0.9).masked_fill(~kept, float("-inf")), -1)
        torch.testing.assert_close(probs, ref)


def test_to_probs_top_p_keeps_minimal_prefix():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(20, 30, generator=g) * 2
    for top_p in (0.05, 0.3, 0.5, 0.77, 0.9, 0.99):
        probs = to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        full = torch.softmax(logits, -1)
        for row in range(20):
            sp, idx = full[row].sort(descending=True)
            cum = sp.cumsum(0)
            assert (cum - top_p).abs().min() > 1e-5  # no row sits on a boundary (the test would be ambiguous)
            m = int((cum < top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
            kept = probs[row] > 0
            assert int(kept.sum()) == m, (top_p, row)
            assert kept[idx[:m]].all()
            torch.testing.assert_close(probs[row, idx[:m]], sp[:m] / sp[:m].sum())
    # top-k first, then top-p over the renormalized top-k (the HF order).
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))  # 4/7 >= 0.5: one token
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))  # 4/7 < 0.6: both
    torch.testing.assert_close(probs, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=1e-45), dict(temperature=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1e-100), dict(top_p=1.5), dict(top_k=-1),
                                 dict(seed=1 << 70), dict(max_new_tokens=0)])
def test_sampling_params_validated(bad):
    from selfspec.errors import SelfspecError

    with pytest.raises(SelfspecError):
        SamplingParams(**bad)
