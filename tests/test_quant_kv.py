"""KV cache quantizers: round trips within their error bounds, the upper plane alone a valid INT4 cache."""
from __future__ import annotations

import pytest
import torch

from selfspec.quant.kv import dequantize_hier, dequantize_int8, quantize_hier, quantize_int8


def kv_like(seed: int = 0) -> torch.Tensor:
    """[H, G, D] keys-like values: per-channel offsets and a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 64, generator=g) + 3 * torch.randn(1, 1, 64, generator=g)
    x[..., 5] *= 20
    return x


@pytest.mark.parametrize("dim", [-2, -1])  # keys: per channel over the tokens; values: per token
def test_int8_round_trip(dim):
    x = kv_like()
    q, scale, zero = quantize_int8(x, dim)
    assert q.dtype == torch.uint8 and scale.dtype == torch.float16 and scale.shape[dim] == 1
    err = (dequantize_int8(q, scale, zero) - x).abs()
    assert (err <= scale.float() / 2 * (1 + 1e-3)).all()
    assert (zero.float() <= x.amin(dim, keepdim=True)).all()


@pytest.mark.parametrize("dim", [-2, -1])
def test_hier_planes(dim):
    x = kv_like(1)
    upper, lower, scale, zero = quantize_hier(x, dim)
    assert upper.shape == lower.shape == (*x.shape[:-1], x.shape[-1] // 2) and upper.dtype == torch.uint8
    s = scale.float()
    err4 = (dequantize_hier(upper, None, scale, zero) - x).abs()
    err8 = (dequantize_hier(upper, lower, scale, zero) - x).abs()
    assert (err4 <= s / 2 * (1 + 1e-3)).all()  # the upper plane alone: an INT4 cache
    assert (err8 <= s / 16 * (1 + 1e-3)).all()  # both planes: INT8 (clipped residual +8 -> 7 at worst)
    assert err8.mean() < err4.mean() / 8  # the lower plane refines every value, not just a few
    # Both planes are as close as a direct INT8 quantization over the same range (16 steps per upper step vs 255).
    q8, s8, z8 = quantize_int8(x, dim)
    assert err8.mean() < 1.5 * (dequantize_int8(q8, s8, z8) - x).abs().mean()


def test_constant_run_quantizes_exactly():
    x = torch.full((1, 4, 8), 0.3)
    upper, lower, scale, zero = quantize_hier(x, -2)
    assert torch.isfinite(scale.float()).all() and scale.float().min() > 0
    assert torch.allclose(dequantize_hier(upper, lower, scale, zero), x, atol=1e-3)
