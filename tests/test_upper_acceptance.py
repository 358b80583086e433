"""The teacher-forced acceptance estimate (selfspec/bench/upper_acceptance.py): agreement, trace conversion,
the teacher-forced pass on a tiny random model, and the upper-plane variants."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from selfspec.bench.upper_acceptance import (TeacherForced, agreement, agreements, continuations, full_int8,
                                             full_widened, predicted_speedup, set_weights, upper_floor, upper_lsq,
                                             upper_rtn)
from selfspec.engine.llm import LLM
from selfspec.model import Linear, Transformer
from selfspec.quant.formats import minmax_quant
from selfspec.speculative.layer_skip import accepted_per_round
from selfspec.speculative.policy import expected_tokens
from selfspec.speculative.recipes import resolve_recipe

pytestmark = pytest.mark.usefixtures("one_thread")
T, F = True, False


def test_agreement_is_argmax_equality():
    draft = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 1.0]])
    verify = torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 1.0]])
    assert agreement(draft, verify).tolist() == [True, False]


@pytest.mark.parametrize("agree, k, rounds", [
    ([T, F, T, T, T, F, F], 4, [1, 3, 0]),  # rounds start at 0, 2 (after 1 + bonus), 6
    ([T, F, T, T, T, F, F], 2, [1, 2, 0, 0]),  # starts 0, 2, 5, 6: the cap splits the run of three
    ([T, T, T, T, T], 2, [2, 2]),  # starts 0, 3; the second round runs out of positions after two
    ([F, F], 8, [0, 0]),
    ([], 4, []),
])
def test_accepted_per_round(agree, k, rounds):
    assert accepted_per_round(agree, k) == rounds


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert predicted_speedup(0.5, 2, 0.5) == pytest.approx(1.75 / 2)


def tiny_llm(seed: int = 0) -> tuple[LLM, dict[str, torch.Tensor]]:
    cfg, sd, _ = tiny_model("qwen2", seed=seed)
    model = Transformer(cfg, sd)
    originals = {name: m.weight.weight for name, m in model.named_modules() if isinstance(m, Linear)}
    set_weights(model, originals, full_int8, 32)
    return LLM(model, None, resolve_recipe("ar")), originals


def test_teacher_forced_verify_reproduces_the_greedy_continuation():
    """Prompts of different lengths (right padding), one batched pass: the verify weights' argmax after each
    continuation token is the next token greedy AR decoding produced."""
    llm, _ = tiny_llm()
    prompts = [[5, 9, 3, 7, 11, 4], [8, 2], [1, 3, 5, 7, 9, 11, 13, 15, 17]]
    conts = continuations(llm, prompts, 12)
    argmax = TeacherForced(llm.model, prompts, conts).argmax()
    for row, c in zip(argmax.tolist(), conts):
        assert row[: len(c) - 1] == c[1:]


def test_agreements_of_the_verify_weights_with_themselves_are_all_true_and_the_draft_differs():
    llm, originals = tiny_llm(seed=1)
    prompts = [[5, 9, 3, 7], [8, 2, 6]]
    conts = continuations(llm, prompts, 16)
    tf = TeacherForced(llm.model, prompts, conts)
    set_weights(llm.model, originals, full_int8, 32)
    same = tf.argmax()
    assert [same[i, : len(c) - 1].tolist() for i, c in enumerate(conts)] == [c[1:] for c in conts]
    agree = agreements(tf, originals, conts, ["floor-g32"])["floor-g32"]
    assert [len(a) for a in agree] == [len(c) - 1 for c in conts]
    assert not all(x for a in agree for x in a)  # a tiny random model's INT4 draft does disagree somewhere


def rand_weight(n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0, :5] *= 20  # an outlier group
    return w


def test_widened_int8_upper_plane_is_the_rtn_int4():
    """full_widened's INT8: its floor(q8 / 16) with the planes' upper affine (16 s, lo + 7.5 s) is the
    independent RTN INT4, and the INT8 error stays within half its (255/240 wider) step."""
    w, g = rand_weight(), 64
    n, k = w.shape
    wg = w.view(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s8 = (hi - lo) / 240
    full = full_widened(w, g).view(n, k // g, g)
    q8 = ((full - (lo - 7.5 * s8)[..., None]) / s8[..., None]).round()
    upper = (lo - 7.5 * s8 + 7.5 * s8)[..., None] + 16 * s8[..., None] * (q8 // 16)
    rtn = upper_rtn(w, g).view(n, k // g, g)
    assert q8.min() >= 0 and q8.max() <= 255
    assert torch.allclose(upper, rtn, rtol=0, atol=1e-5)
    assert ((full - wg).abs() <= s8[..., None] / 2 + 1e-5).all()


def test_lsq_upper_error_is_at_most_todays_and_keeps_todays_codes():
    w, g = rand_weight(), 128
    n, k = w.shape
    floor_err = (upper_floor(w, g) - w).pow(2).view(n, k // g, g).sum(-1)
    lsq = upper_lsq(w, g)
    lsq_err = (lsq - w).pow(2).view(n, k // g, g).sum(-1)
    assert (lsq_err <= floor_err * (1 + 1e-5) + 1e-8).all()
    assert (lsq_err < floor_err).any()
    # Today's codes: within a group, weights with one code get one value, and values rise with the code.
    q8, _, _ = minmax_quant(w, 8, g)
    for u, v in zip((q8 >> 4).view(-1, g), lsq.view(-1, g)):
        order = torch.argsort(u, stable=True)
        u, v = u[order], v[order]
        same = u[1:] == u[:-1]
        assert torch.equal(v[1:][same], v[:-1][same])
        assert (v[1:][~same] > v[:-1][~same]).all()
