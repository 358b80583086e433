"""float64 oracles shared by the kernel tests (interpreted on CPU in tests/, compiled on the GPU in tests/gpu/)."""
from __future__ import annotations

import torch

from selfspec.quant.act import quantize_per_token

TOL = 5e-3  # relative (Frobenius) error vs float64: bf16 operands and outputs, fp32 sums


def rel_err(y: torch.Tensor, oracle: torch.Tensor) -> float:
    return ((y.double() - oracle).norm() / oracle.norm()).item()


def linear_oracle(x: torch.Tensor, weight, mode, bias) -> torch.Tensor:
    """y of what the mode computes: exact quantized activations, the dequantized weight."""
    if mode.act_bits is None:
        xe = x.double()
    else:
        q, s = quantize_per_token(x, mode.act_bits)
        xe = q.double() * s.double()
    y = xe @ weight.dequantize(mode).double().T
    return y if bias is None else y + bias.double()


def attention_oracle(q, k, v, q_pos) -> torch.Tensor:
    """q [B, Hq, T, D] at positions q_pos [B, T] over keys k, v [B, Hkv, S, D]."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(n_rep, 1), v.double().repeat_interleave(n_rep, 1)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.arange(k.shape[2], device=q.device) <= q_pos[:, None, :, None]
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


def rope_angles(pos: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, 2 * half] float32 for positions pos [B, T] and random frequencies."""
    freqs = torch.rand(half, device=pos.device, dtype=torch.float64)
    angles = pos.double()[..., None] * freqs
    emb = torch.cat((angles, angles), -1)
    return emb.cos().float(), emb.sin().float()


def scatter_to_pool(k: torch.Tensor, v: torch.Tensor, bs: int, gen: torch.Generator):
    """Contiguous keys/values [B, Hkv, S, D] -> pools [N, Hkv, bs, D] (a trash block 0 of random values included)
    and a block table [B, S // bs] placing each row's blocks at shuffled pool ids."""
    b, h, s, d = k.shape
    w = s // bs
    ids = (torch.randperm(b * w, generator=gen).view(b, w) + 1).to(k.device)
    k_pool = torch.randn(b * w + 1, h, bs, d, device=k.device).to(k.dtype)
    v_pool = torch.randn(b * w + 1, h, bs, d, device=k.device).to(v.dtype)
    for pool, x in ((k_pool, k), (v_pool, v)):
        pool[ids] = x.view(b, h, w, bs, d).transpose(1, 2)
    return k_pool, v_pool, ids
