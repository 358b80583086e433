"""Gamma policy: expected tokens, cost estimates, exploration order, and the choice with given costs."""
import pytest

from selfspec.spec.policy import GammaPolicy, expected_tokens


def measured(verify: dict[int, float], draft_ratio: float, acceptance: float, batch: int, max_gamma: int = 8):
    """A policy that has seen plain decoding at `verify`'s sizes and drafts costing draft_ratio x verify(B)."""
    p = GammaPolicy(max_gamma)
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


def test_acceptance_is_the_geometric_mle():
    p = GammaPolicy()
    p.observe_acceptance(4, [4, 1])  # 5 successes in 4 + 2 trials
    assert p.acceptance == pytest.approx(5 / 6)


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
    """Speculating, a plain round every probe_every rounds re-times verify(B); decoding plainly, a round of
    the best k every 4 x probe_every rounds re-times drafting and acceptance."""
    p = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=0.3, acceptance=0.8, batch=1)
    p.probe_every = 4
    assert [p.choose(1) for _ in range(10)] == [3, 3, 3, 3, 0, 3, 3, 3, 3, 0]
    q = measured({n: 1.0 for n in (1, 2, 4, 8, 16)}, draft_ratio=1.0, acceptance=0.8, batch=1)
    q.probe_every = 2
    assert [q.choose(1) for _ in range(18)] == [0] * 8 + [1] + [0] * 8 + [1]
