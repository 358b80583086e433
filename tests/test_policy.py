"""Gamma policy: expected tokens, cost estimates, exploration order, the choice with given costs, and the probe
schedule against a simulated engine."""
import bisect
import random

import pytest

from selfspec.speculative.policy import GammaPolicy, expected_tokens


def measured(verify: dict[int, float], draft_ratio: float, acceptance: float, batch: int, max_gamma: int = 8,
             **kw):
    """A policy that has seen plain decoding at `verify`'s sizes and drafts costing draft_ratio x verify(B) (the
    schedule alone: no floor from the probes' losses unless `probe_budget` is given)."""
    p = GammaPolicy(max_gamma, **{"probe_budget": 1.0, **kw})
    for tokens, s in verify.items():
        p.observe_round(tokens, 0, 0.0, s)
    p.observe_round(batch, 1, draft_ratio * p.verify_estimate(batch), p.verify_estimate(2 * batch))
    n = round(acceptance * 1000)
    p.observe_acceptance(1, [1] * n + [0] * (1000 - n))
    return p


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_is_the_geometric_estimate_with_a_prior_over_decaying_rounds():
    p = GammaPolicy(alpha=0.25)
    assert p.acceptance is None
    p.observe_acceptance(4, [4, 1])  # 5 successes in 4 + 2 trials, and one of each of prior
    assert p.acceptance == pytest.approx(6 / 8)
    p.observe_acceptance(2, [0, 0, 0])  # 3 failures; the first round's weight is now 3/4
    assert p.acceptance == pytest.approx((0.75 * 5 + 1) / (0.75 * 6 + 3 + 2))
    q = GammaPolicy()
    q.observe_acceptance(1, [0])  # one round that accepted nothing is not taken for certain
    assert q.acceptance == pytest.approx(1 / 3)


def test_zero_when_draft_costs_as_much_as_verify():
    """Memory-bound verify (flat cost), perfect-ish acceptance, but a draft step costs a verify step: never."""
    p = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=1.0, acceptance=0.95, batch=1)
    assert p.choose(1) == 0


def test_speculates_when_drafts_are_cheap_and_verify_is_flat():
    p = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=0.3, acceptance=0.8, batch=1)
    k = p.choose(1)
    assert k > 1
    # a=0.8, r=0.3: E(k)/(1 + 0.3k) peaks at k=3 (2.95/1.9) among 1..8
    assert k == max(range(9), key=lambda j: expected_tokens(0.8, j) / (1 + 0.3 * j))


def test_zero_at_a_batch_where_verify_is_compute_bound():
    """Verify cost flat up to 8 tokens, then linear: speculation pays at batch 1, not at batch 32."""
    costs = {n: max(1.0, n / 8) for n in (1, 2, 4, 8, 32, 64, 128)}
    p = measured(costs, draft_ratio=0.3, acceptance=0.8, batch=1)
    assert p.choose(1) > 0
    assert p.choose(32) == 0


def test_zero_when_speculation_gains_less_than_the_margin():
    # k=1: E = 1.1 tokens for 1 + 0.02 cost: 1.078x over AR, but verify(2) costs 1.05 -> under 5%.
    p = measured({1: 1.0, 2: 1.05}, draft_ratio=0.02, acceptance=0.1, batch=1, max_gamma=1)
    assert p.choose(1) == 0


def test_the_margin_is_to_start_drafting_not_to_go_on():
    """Drafting by its own choice, the policy goes on while drafting is estimated to win at all (acceptance comes in
    bursts: a dip of the recent estimate under the margin is not the end of a stretch that pays); not drafting, it
    starts only past the margin."""
    def drafting_wins_by(p):  # k = 1 over plain decoding, as the policy estimates it
        return p.throughput(1, 1) / p.throughput(1, 0)

    p = measured({1: 1.0, 2: 1.0}, draft_ratio=0.1, acceptance=0.5, batch=1, max_gamma=1)
    assert p.choose(1) == 1 and not p.measuring
    for _ in range(30):  # recent rounds accept 13%: drafting wins by 1-3%, under the 5% margin
        p.observe_acceptance(1, [1] * 13 + [0] * 87)
    assert 1.0 < drafting_wins_by(p) < 1.05
    assert p.choose(1) == 1
    fresh = measured({1: 1.0, 2: 1.0}, draft_ratio=0.1, acceptance=0.13, batch=1, max_gamma=1)
    assert 1.0 < drafting_wins_by(fresh) < 1.05 and fresh.choose(1) == 0
    for _ in range(30):  # 5%: drafting loses
        p.observe_acceptance(1, [1] * 5 + [0] * 95)
    assert drafting_wins_by(p) < 1.0 and p.choose(1) == 0


def test_exploration_order():
    p = GammaPolicy(4)
    assert p.choose(8) == 0  # nothing measured at batch 8: plain decoding first
    p.observe_round(8, 0, 0.0, 1.0)
    assert p.choose(8) == 1  # no draft measured yet: one cheap round
    p.observe_round(8, 1, 0.9, 1.0)
    p.observe_acceptance(1, [1, 0, 1, 1, 0, 1, 1, 1])
    assert p.choose(8) == 0  # draft ratio 0.9: speculation loses
    assert p.choose(16) == 0  # unmeasured size: plain decoding first
    assert GammaPolicy(0).choose(1) == 0  # no draft mode


def test_verify_estimate_interpolates_and_extrapolates():
    p = GammaPolicy()
    assert p.verify_estimate(4) is None
    p.observe_round(2, 0, 0.0, 2.0)
    assert p.verify_estimate(100) == 2.0  # one size stands for all
    p.observe_round(4, 0, 0.0, 4.0)
    assert p.verify_estimate(3) == pytest.approx(3.0)
    assert p.verify_estimate(8) == pytest.approx(8.0)
    assert p.verify_estimate(1) == pytest.approx(1.0)


def test_probes_re_time_the_option_not_taken():
    """Speculating, a plain round re-times verify(B) after probe_every rounds, each probe that leaves the choice as
    it was doubling the interval, up to max_probe_every. Decoding plainly, a drafting round re-times drafting and
    acceptance every max(probe_every, L / probe_budget) rounds, L its estimated loss in plain rounds (here 1 + 1 -
    1.8 = 0.2), without backing off: its budget bounds what it costs."""
    p = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=0.3, acceptance=0.8, batch=1, max_probe_every=16)
    p.probe_every = 4
    assert [p.choose(1) for _ in range(4 + 1 + 8 + 1 + 16 + 1 + 16 + 1)] == \
        [3] * 4 + [0] + [3] * 8 + [0] + [3] * 16 + [0] + [3] * 16 + [0]
    q = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=1.0, acceptance=0.8, batch=1, probe_every=2,
                 max_probe_every=32)
    assert [q.choose(1) for _ in range(4 * 3)] == ([0] * 2 + [1]) * 4  # L / 1.0 below probe_every
    b = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=1.0, acceptance=0.8, batch=1, probe_every=2,
                 probe_budget=0.01)
    probes = [i for i in range(100) if b.choose(1)]
    gaps = {j - i for i, j in zip(probes, probes[1:])}
    assert len(gaps) == 1 and 21 <= gaps.pop() <= 22  # 0.2 / 1% = 20 rounds (rounded up) between probes


def test_probe_schedules_follow_the_batch_and_the_choice():
    """Drafting probes are spaced by the loss at the batch they run at (a 2-token pass of 16 rows costs 1, of 32
    rows 1.5: L = 0.2 at batch 8, 0.7 at 16); once drafts turn cheap the choice flips and plain probes start from
    their base interval."""
    q = measured({8: 1.0, 9: 1.0, 16: 1.0, 18: 1.0, 32: 1.5}, draft_ratio=1.0, acceptance=0.8, batch=8,
                 probe_every=2, probe_budget=0.01)
    def gaps(batch: int, rounds: int) -> set[int]:
        probes = [i for i in range(rounds) if q.choose(batch)]
        return {j - i for i, j in zip(probes, probes[1:])}

    at8, at16 = gaps(8, 100), gaps(16, 300)
    assert at8 and at8 <= {21, 22} and at16 and at16 <= {71, 72}
    for _ in range(20):  # drafts became cheap
        q.observe_round(16, 1, 0.1, 1.0)
    k = q.choose(16)
    assert k > 1 and [q.choose(16) for _ in range(3)] == [k, 0, k]  # speculating: plain probes from the base


def test_a_probe_drafts_the_k_losing_least_time_not_the_best_k():
    """A verify pass of 2+ tokens per row costs 3x one of 1, a draft step as much as the latter, acceptance 0.8:
    3 drafts have the best throughput (still half of plain decoding's), 1 draft the cheapest loss."""
    p = measured({1: 1.0, 2: 3.0, 4: 3.0, 8: 3.0, 16: 3.0}, draft_ratio=1.0, acceptance=0.8, batch=1, probe_every=2)
    assert max(range(1, 9), key=lambda k: p.throughput(1, k)) == 3 and p.throughput(1, 3) < 0.6 * p.throughput(1, 0)
    assert [p.choose(1) for _ in range(4)] == [0] * 3 + [1]  # L = 1 + 3 - 1.8 = 2.2 rounds: after 3


def test_measuring_flags_exploration_and_drafting_probes_not_chosen_speculation():
    """`measuring`: the round drafts only to measure (exploration, a drafting probe while decoding plainly); plain
    rounds, plain probes and the rounds of a chosen speculation do not."""
    def flags(p: GammaPolicy, rounds: int, batch: int = 1) -> list[tuple[int, bool]]:
        return [(p.choose(batch), p.measuring) for _ in range(rounds)]

    p = GammaPolicy(4)
    assert flags(p, 1, 8) == [(0, False)]  # plain decoding measured first
    p.observe_round(8, 0, 0.0, 1.0)
    assert flags(p, 1, 8) == [(1, True)]  # exploration
    q = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=1.0, acceptance=0.8, batch=1, probe_every=2)
    assert flags(q, 3) == [(0, False)] * 2 + [(1, True)]  # decoding plainly: the drafting probe
    s = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=0.3, acceptance=0.8, batch=1, probe_every=4)
    assert flags(s, 5) == [(3, False)] * 4 + [(0, False)]  # speculating: chosen rounds, then a plain probe


def test_a_plain_round_of_several_steps_counts_each_step_toward_the_probes():
    """The engine runs a plain round as up to decode_steps steps back to back: each counts as a round of the probe
    schedule, so a drafting probe comes after probe_every steps, not probe_every bursts (4x later, 4x under the
    probes' time budget)."""
    q = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=1.0, acceptance=0.8, batch=1, probe_every=8)
    ks = []
    for _ in range(4):
        ks.append(q.choose(1))
        q.observe_round(1, ks[-1], 0.0, 1.0, steps=4 if ks[-1] == 0 else 1)
    assert ks == [0, 0, 1, 0]  # 4 + 4 steps, then the 9th: a probe (one at a step a choice: the 9th choice)


def test_speculation_chosen_on_few_acceptance_trials_only_measures():
    """One exploration round whose 8 rows all accepted its draft estimates acceptance 0.9: the speculation chosen on
    it measures (its greedy rows stay in lockstep in the engine) until min_trials trials were seen."""
    p = GammaPolicy(4, min_trials=64)
    p.observe_round(8, 0, 0.0, 1.0)
    assert (p.choose(8), p.measuring) == (1, True)  # exploration
    p.observe_round(8, 1, 0.3, 1.0)
    p.observe_acceptance(1, [1] * 8)
    assert p.acceptance == pytest.approx(9 / 10) and p.num_trials == 8
    flags = []
    for _ in range(3):
        k = p.choose(8)
        flags.append((k, p.measuring))
        p.observe_round(8, k, 0.3 * k, 1.0)
        p.observe_acceptance(k, [k] * 8)  # k trials a row
    assert flags == [(4, True), (4, True), (4, False)]  # 8 + 2 x 32 trials seen before the third


def serve(p: GammaPolicy, rounds: int, batch: int, draft_ratio: float, acceptance: float, rng: random.Random,
          verify=lambda tokens: 1.0) -> list[int]:
    """Let the policy drive `rounds` simulated rounds over `batch` rows: a draft step costs draft_ratio x
    verify(B), the verify pass verify(the policy's pass_tokens), a row accepts each draft with probability
    `acceptance` until its first rejection, timings jitter by 3%. Returns the k of every round."""
    ks = []
    for _ in range(rounds):
        k = p.choose(batch)
        jitter = lambda: rng.uniform(0.97, 1.03)  # noqa: E731
        p.observe_round(batch, k, k * draft_ratio * verify(batch) * jitter(),
                        verify(p.pass_tokens(batch, k)) * jitter())
        accepted = []
        for _ in range(batch):
            n = 0
            while n < k and rng.random() < acceptance:
                n += 1
            accepted.append(n)
        p.observe_acceptance(k, accepted)
        ks.append(k)
    return ks


def test_probes_cost_under_1pct_when_drafts_cost_as_much_as_verify():
    """The H100 case: speculation never pays; the probes are the only drafting rounds, lose under 1% of the time
    (each half a plain round: one in ~50 rounds), keep coming, and draft 1 token."""
    ks = serve(GammaPolicy(), 5000, 8, draft_ratio=1.0, acceptance=0.5, rng=random.Random(0))
    probes = [i for i, k in enumerate(ks) if k]
    assert 0.5 * len(probes) < 0.011 * len(ks)  # a probe: a draft step and a 2-token pass for 1.5 tokens
    assert probes[-1] > len(ks) - 60 and {ks[i] for i in probes} == {1}


def test_settles_on_speculation_quickly_when_drafts_are_cheap():
    ks = serve(GammaPolicy(), 1000, 8, draft_ratio=0.2, acceptance=0.9, rng=random.Random(0))
    assert ks[:2] == [0, 1] and ks[2] >= 2  # measure plain, explore 1 draft, then speculate
    assert sum(k >= 2 for k in ks[2:]) >= 0.97 * len(ks[2:])  # plain probes back off too


def test_follows_a_change_of_costs():
    """Drafts turn cheap after 3000 plain rounds (only probes can see it; at most a few capped intervals), and
    dear again after 3000 speculative ones (every round sees it)."""
    rng = random.Random(0)
    p = GammaPolicy()
    ks = serve(p, 3000, 8, 1.0, 0.9, rng)
    assert 0.1 * sum(k > 0 for k in ks) < 0.011 * len(ks)  # a probe loses 0.1 plain rounds (2 - 1.9)
    ks = serve(p, 3000, 8, 0.2, 0.9, rng)
    switch = next(i for i, k in enumerate(ks) if k >= 2)
    assert switch <= 3 * p.probe_every
    assert sum(k >= 2 for k in ks[switch:]) >= 0.98 * len(ks[switch:])
    ks = serve(p, 3000, 8, 1.0, 0.9, rng)
    switch = next(i for i, k in enumerate(ks) if k == 0)
    assert switch <= 20
    assert 0.1 * sum(k > 0 for k in ks[switch + 10:]) < 0.011 * len(ks[switch + 10:])  # probes: 1% of the time


def forked_tree(batch: int, k: int) -> int:
    """A tree of 15 branches forked into rows (TreeDrafter.verify_tokens at batch > 1)."""
    return batch if k == 0 else batch * 15 * (k + 1)


def test_a_tree_round_is_priced_by_the_rows_it_verifies():
    """Free drafts, acceptance 0.9, verify cost growing with the pass's tokens: a chain of 32 rows speculates, a
    tree forking 15 rows a sequence does not (one draft verifies 960 tokens, not 64)."""
    def cost(tokens: int) -> float:
        return 1 + tokens / 64

    choices = []
    for pass_tokens in (None, forked_tree):
        p = GammaPolicy(8, pass_tokens=pass_tokens)
        for t in (32, 64, 128, 256, 512, 1024):
            p.observe_round(t, 0, 0.0, cost(t))
        p.observe_round(32, 1, 0.0, cost(p.pass_tokens(32, 1)))
        p.observe_acceptance(1, [1] * 900 + [0] * 100)
        choices.append(p.choose(32))
    assert choices[0] > 0 and choices[1] == 0


def test_drafting_probes_lose_at_most_1pct_of_the_time_however_dear():
    """The forked tree at batch 32 (a probe verifies 960 tokens, ~9 plain steps' time): probes come no sooner than
    1% of the time allows (at max_probe_every alone they would lose ~7%), and still come."""
    def cost(tokens: int) -> float:
        return 1 + tokens / 64

    ks = serve(GammaPolicy(pass_tokens=forked_tree), 6000, 32, draft_ratio=0.0, acceptance=0.5,
               rng=random.Random(0), verify=cost)
    plain = cost(32)
    lost = sum(cost(forked_tree(32, k)) - expected_tokens(0.5, k) * plain for k in ks[2:] if k)  # past exploration
    assert 0 < lost < 0.012 * plain * len(ks)
    assert sum(k > 0 for k in ks[-2000:]) >= 1


def test_a_round_that_must_lose_is_explored_no_sooner_than_a_probe():
    """Costs known before any drafting (the engine's warm-up times its passes), acceptance unknown: a chain at
    batch 32 explores at once; the forked tree, whose one draft verifies 960 tokens and loses ~9 steps even if
    accepted, decodes plainly and drafts first when a probe's best-case loss fits 1% of the time."""
    def seeded(pass_tokens) -> GammaPolicy:
        p = GammaPolicy(8, pass_tokens=pass_tokens)
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            p.observe_round(t, 0, 0.0, 1 + t / 64)
        return p

    chain = seeded(None)
    assert (chain.choose(32), chain.measuring) == (1, True)
    tree = seeded(forked_tree)
    ks = [tree.choose(32) for _ in range(1000)]
    first = next(i for i, k in enumerate(ks) if k)
    lost = (1 + forked_tree(32, 1) / 64) - 2 * (1 + 32 / 64)  # at every draft accepted, in plain steps' time
    assert 0.95 * lost / 1.5 / 0.01 <= first <= 1.05 * lost / 1.5 / 0.01 + 1 and ks[first] == 1


def test_noisy_costs_never_price_a_larger_pass_below_a_smaller_one():
    """A larger pass measured cheaper than a smaller one (noise) would extrapolate to nothing: estimates past it
    keep the dearest smaller pass's cost. Below the smallest pass measured, a downward extrapolation stops at 0
    (then a round is taken as able to pay, not divided by)."""
    p = GammaPolicy(4)
    p.observe_round(8, 0, 0.0, 1.0)
    p.observe_round(16, 0, 0.0, 0.5)
    assert p.verify_estimate(8 * 5) == 1.0 and p.verify_estimate(12) == 1.0
    assert (p.choose(8), p.measuring) == (1, True)  # the 16-token pass (k = 1) was measured cheap: explored
    q = GammaPolicy(4)
    q.observe_round(8, 0, 0.0, 1.0)
    q.observe_round(16, 0, 0.0, 4.0)
    assert q.verify_estimate(2) == 0.0 and q.verify_estimate(24) == pytest.approx(7.0)


def test_a_measured_pass_is_never_priced_below_a_smaller_one():
    """The warm-up times each graph once over a short context; a wide pass no round then runs keeps that price (a
    lookup's rounds verify at most its longest proposal, here 6 tokens a row at batch 32: 224 and 256 tokens never
    run, while the passes that do run are priced from the rounds, their host time in). Taken as is, 256 tokens at
    6.7 ms under 192's 9.7 ms made k = 7 the best round by far (an estimated 1.17x, where its rounds ran 192-token
    passes: H200, quasar at batch 32, drafting while it lost); a measured size keeps the dearest smaller pass's cost
    too, and drafting (k = 1: 1.03x) stays under the margin."""
    costs = {32: 5.7, 64: 6.9, 96: 7.4, 128: 7.6, 160: 8.2, 192: 9.7, 224: 6.75, 256: 6.7}
    p = measured(costs, draft_ratio=0.05, acceptance=0.3, batch=32, draft_steps=lambda k: 1)
    assert p.verify_estimate(256) == 9.7 and p.verify_estimate(224) == 9.7 and p.verify_estimate(64) == 6.9
    assert p.throughput(32, 1) / p.throughput(32, 0) < 1.05
    assert p.choose(32) == 0


def test_estimates_follow_every_observation():
    """verify_estimate keeps its floors (the dearest smaller pass) between observations: on random observations,
    each estimate equals the definition recomputed from the costs as they stand."""
    rng = random.Random(7)
    p = GammaPolicy(4)
    for _ in range(300):
        p.observe_round(rng.randrange(1, 64), 0, 0.0, rng.uniform(0.5, 2.0))
        tokens = rng.randrange(1, 80)
        sizes = p.verify_sizes
        cost = {n: p.verify_cost[n].value for n in sizes}
        i = bisect.bisect_left(sizes, tokens)
        if tokens in cost:
            expected = max(cost[n] for n in sizes[:i + 1])
        elif len(sizes) == 1:
            expected = cost[sizes[0]]
        else:
            n0, n1 = sizes[min(max(i - 1, 0), len(sizes) - 2):][:2]
            line = cost[n0] + (cost[n1] - cost[n0]) * (tokens - n0) / (n1 - n0)
            expected = max(line, max((cost[n] for n in sizes[:i]), default=0.0))
        assert p.verify_estimate(tokens) == expected


def test_an_unlucky_exploration_does_not_keep_a_cheap_tree_off():
    """A lone sequence's tree (16 nodes a round whatever its depth, a 16-token pass costing 1.06 steps, free drafts,
    acceptance 0.55) whose exploration round accepted nothing: drafting probes, each losing 6% of a step, come every
    probe_every rounds, so speculation starts within a few of them and holds."""
    def shared(batch: int, k: int) -> int:
        return batch if k == 0 else batch * 16

    def cost(tokens: int) -> float:
        return 1 + tokens / 256

    for seed in range(3):
        p = GammaPolicy(8, pass_tokens=shared)
        for t in (1, 2, 4, 8, 16, 32):
            p.observe_round(t, 0, 0.0, cost(t))
        assert p.choose(1) == 1  # the exploration ...
        p.observe_round(1, 1, 0.0, cost(16))
        p.observe_acceptance(1, [0])  # ... accepts nothing
        ks = serve(p, 1000, 1, draft_ratio=0.0, acceptance=0.55, rng=random.Random(seed), verify=cost)
        first = next(i for i, k in enumerate(ks) if k >= 2)
        assert first <= 3 * p.probe_every and sum(k >= 2 for k in ks[first:]) >= 0.9 * len(ks[first:])


def test_a_drafter_without_draft_steps_pays_its_proposing_once_a_round():
    """A lookup or a recycled tree proposes on the host once a round, whatever k: priced per draft, its time read k
    times over (k = 5: five proposings), and the policy drafted less than pays. gamma_policy gives each drafter its
    rule: draft steps for a draft mode, one proposing for a lookup or a recycled tree."""
    from selfspec.speculative.drafters import gamma_policy, make_drafter

    per_round = GammaPolicy(8, draft_steps=lambda k: 1)
    per_draft = GammaPolicy(8)
    for p in (per_round, per_draft):
        p.observe_round(1, 0, 0.0, 4.0)
        p.observe_round(6, 0, 0.0, 5.0)
        p.observe_round(1, 5, 0.5, 5.0)  # five drafts proposed in 0.5
    # verify(3 tokens) = 4.4, between the passes of 1 and 6 tokens
    assert per_round.draft_estimate(1) == pytest.approx(0.5)
    assert per_round.round_cost(1, 5) == pytest.approx(5.5) and per_round.round_cost(1, 2) == pytest.approx(4.9)
    assert per_draft.draft_estimate(1) == pytest.approx(0.1) and per_draft.round_cost(1, 2) == pytest.approx(4.6)
    assert [gamma_policy(make_drafter(n), 8).draft_steps(5) for n in ("ngram", "recycle-tree", "upper", "hybrid")] == \
        [1, 1, 5, 5]
