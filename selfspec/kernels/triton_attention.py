"""Triton causal attention with GQA and per-row position offsets: query (b, t) reads keys 0..q_pos[b, t].

Flash-attention style: online softmax over key blocks of a fixed size, always in order from key 0, with
fp32 scores and accumulators. Batch invariance across the number of queries: a query's scores, running
max and sums only ever involve its own row, and a key block past its position is fully masked for it, which
leaves its state bit-for-bit unchanged (the max stays, exp2(0) = 1 rescales, p = 0 adds exact zeros), so
it gets the same result alone or among other queries.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from selfspec.kernels import register
from selfspec.kernels.reference import attention as reference_attention

BLOCK_T = 16  # queries per program: fixed, whatever T is
BLOCK_S = 64  # keys per step of the online softmax: fixed, so every query sums its keys in the same order


@triton.jit(do_not_specialize=["T", "S"])  # one binary for every number of queries and keys
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, T, S, H, N_REP, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_t = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    kv_h = h // N_REP  # GQA: query head h reads kv head h // N_REP (repeat_interleave)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_t[:, None] * stride_qt + offs_d[None, :],
                mask=q_mask, other=0)
    pos = tl.load(pos_ptr + b * T + offs_t, mask=offs_t < T, other=0)  # padding rows read key 0 only: no NaN
    end = tl.minimum(tl.max(pos, axis=0), S - 1) + 1  # keys this tile reads; later ones are never loaded
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh

    m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for s0 in range(0, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        kv_mask = (offs_s < end)[:, None] & (offs_d < D)[None, :]
        k = tl.load(k_base + offs_s[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_base + offs_s[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain: qk_scale folds in log2(e)
        scores = tl.where(offs_s[None, :] <= pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :],
             out.to(tl.bfloat16), mask=q_mask)


@register("attention", "", "cuda")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D] at positions q_pos [B, T]; k, v [B, Hkv, S, D]: the reference attention, in one kernel."""
    if not q.dtype == k.dtype == v.dtype == torch.bfloat16:
        return reference_attention(q, k, v, q_pos)  # the kernel is bf16 only: other dtypes take the reference
    b, h, t, d = q.shape
    q, k, v = (z if z.stride(-1) == 1 else z.contiguous() for z in (q, k, v))
    out = torch.empty((b, h, t, d), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(t, BLOCK_T), b * h)
    _attention_kernel[grid](
        q, k, v, q_pos.contiguous(), out, t, k.shape[2], h, h // k.shape[1], math.log2(math.e) / math.sqrt(d),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_T=BLOCK_T, BLOCK_S=BLOCK_S, num_warps=4,
    )
    return out
