"""Hadamard rotation: exact in the unquantized sense, makes W4A4 robust to activation outlier channels,
shares one small matrix across weights and modes, and keeps qspec's greedy decoding lossless."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from selfspec.engine.llm import build
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES
from selfspec.quant.rotation import BlockHadamard, hadamard
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 2, 32, 64])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n), atol=1e-6, rtol=0)
    assert torch.equal(h, h.T)
    assert torch.equal(h.abs(), torch.full((n, n), n**-0.5))  # every entry +-1/sqrt(n): nothing is dropped
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(12)


def test_block_hadamard_rotates_each_block_of_the_last_dim():
    x = randn(2, 3, 96, seed=0)
    rot = BlockHadamard(32)
    y = rot(x)
    h = hadamard(32)
    for b in range(3):
        torch.testing.assert_close(y[..., 32 * b : 32 * (b + 1)], x[..., 32 * b : 32 * (b + 1)] @ h)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # orthonormal: lengths kept
    assert rot(x.bfloat16()).dtype == torch.bfloat16


def test_rotated_linear_equals_plain_linear_unquantized():
    """Dense storage: (x H)(W H)^T + b = x W^T + b up to float rounding, with H only ever applied online."""
    w, b, x = randn(40, 192, seed=1), randn(40, seed=2), randn(2, 5, 192, seed=3)
    qw = quantize_weight(w, "dense", 64, rotations={})
    assert qw.rotation is not None and qw.rotation.block == 64
    assert not torch.allclose(qw.weight, w, atol=1e-2)  # what is stored really is rotated
    ref = F.linear(x, w, b)
    torch.testing.assert_close(linear(x, qw, MODES["fp32"], b), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(F.linear(x, qw.weight, b), ref, atol=1e-2)  # so x must be rotated too


def w4a4_error(x: torch.Tensor, w: torch.Tensor, rotations: dict | None) -> float:
    qw = quantize_weight(w, "int4", 128, rotations)
    ref = F.linear(x, w)
    return float((linear(x, qw, MODES["w4a4"]) - ref).norm() / ref.norm())


def test_rotation_tames_activation_outlier_channels_in_w4a4():
    """A few channels 10-20x larger (as after an RMSNorm of a real LLM) set the per-token INT4 scale, which
    then rounds most other channels to zero; rotated, each outlier is spread over its block of 64."""
    k = 576  # SmolLM2's hidden size: blocks of 64 (the largest power of two dividing it)
    w, x = randn(96, k, seed=4), randn(4, 7, k, seed=5)
    x[..., torch.tensor([3, 200, 451])] *= torch.tensor([20.0, -15.0, 10.0])
    plain, rotated = w4a4_error(x, w, None), w4a4_error(x, w, {})
    assert rotated < 0.5 * plain, (rotated, plain)  # measured: 0.16 vs 0.47
    # Without outliers both are plain INT4 quantization noise: the rotation is not what makes it accurate.
    x_flat = randn(4, 7, k, seed=6)
    assert w4a4_error(x_flat, w, {}) < 0.2 and w4a4_error(x_flat, w, None) < 0.2


def test_one_rotation_per_block_order_shared_by_weights_and_counted_once():
    cfg, sd, _ = tiny_model("llama", seed=7, intermediate_size=96)  # K = 64 (dim) and 96 = 3 x 32 (down)
    llm = build(cfg, sd, None, resolve_recipe("qspec"), group_size=64)
    model = llm.model
    rotations = {id(lin.weight.rotation): lin.weight.rotation for lin in model.linears()}
    assert sorted(r.block for r in rotations.values()) == [32, 64]  # one per block order, not per weight
    h_bytes = sum(4 * r.block**2 for r in rotations.values())
    stored = sum(lin.weight.nbytes() for lin in model.linears())
    params = sum(t.numel() * t.element_size() for t in model.parameters())  # embedding, norms
    others = params + model.lm_head.nbytes() + model.cos.nbytes + model.sin.nbytes
    assert model.weight_bytes() == stored + h_bytes + others
    assert model.lm_head.rotation is None  # the head stays dense and unrotated


def test_recipes_switch_rotation_on_for_qspec_only():
    assert resolve_recipe("qspec").rotate and resolve_recipe("qspec", draft="w4a8").rotate
    assert not resolve_recipe("planes").rotate and not resolve_recipe("ar", verify="w4a16").rotate


@pytest.fixture(scope="module")
def qspec_qwen3():
    """Rotated qspec on a tiny Qwen3 (QK-norm): test_speculative covers llama/qwen2; same check, other model."""
    cfg, sd, _ = tiny_model("qwen3", seed=8)
    llm = build(cfg, sd, None, resolve_recipe("qspec"), group_size=32)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (int(torch.randint(1, 10, (), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    params = lambda: SamplingParams(max_new_tokens=20, ignore_eos=True)  # noqa: E731
    refs = [llm.generate(p, params(), gamma=0).token_ids for p in prompts]
    return llm, prompts, refs, params


@pytest.mark.parametrize("gamma", range(1, 7))
def test_rotated_qspec_greedy_is_lossless(qspec_qwen3, gamma):
    llm, prompts, refs, params = qspec_qwen3
    assert all(lin.weight.rotation is not None for lin in llm.model.linears())
    accepted = proposed = 0
    for p, ref in zip(prompts, refs):
        out = llm.generate(p, params(), gamma=gamma)
        assert out.token_ids == ref, (p, gamma)
        accepted, proposed = accepted + out.stats.draft_accepted, proposed + out.stats.draft_proposed
    assert 0 < accepted < proposed
