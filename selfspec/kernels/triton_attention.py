"""Triton causal attention with GQA and per-row position offsets: query (b, t) reads keys 0..q_pos[b, t].

Keys are read through a block table: key s of row b is pool[table[b, s // BS], kv_head, s % BS], so the paged
cache is read in place (no gather); the contiguous cache is the case of one block of S slots per row. Where
blocks hold whole key tiles (BS a multiple of BLOCK_S, the contiguous cache included), a tile's keys share one
block id, read once per tile instead of once per key.

Flash-decoding: the keys are cut into chunks of a fixed size (CHUNK); one program per (tile of query rows, kv
head, chunk) runs an online softmax over its chunk's key blocks, in order, with fp32 scores and accumulators; a
second kernel merges each query's chunk partials in chunk order. A tile's rows are the (query, head) pairs of
the query heads that share one kv head (GQA), so each key block is read once for all of them. A decode step has
one query per head, so splitting the keys is what puts enough programs on the GPU.
Batch invariance across the number of queries: a query's scores, running max and sums only ever involve its
own row, and its tile is fixed by its own place in the query-major order; a key block past its position is
fully masked for it, which leaves its state bit-for-bit unchanged (the max stays, exp2(0) = 1 rescales, p = 0
adds exact zeros); the chunks are fixed and merged in order, and a chunk past its position is skipped. So it
gets the same result alone or among other queries.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from selfspec.cache.paged import KEY_TILE, check_block_size
from selfspec.errors import SelfspecError
from selfspec.kernels import register
from selfspec.kernels.launch import launch_options, wait
from selfspec.kernels.reference import attention as reference_attention

BLOCK_T = 16  # queries per program: fixed, whatever T is
# Keys per step of the online softmax: fixed, so every query sums its keys in the same order. H100, 8B heads, 8
# warps (docs/bench-h100/attention-key-tiles.json): 128 keys took 9.0 us at batch 1 and 1k keys against 11.1 for
# 64, and 118 vs 112 us at batch 32 x 9 queries (256: 6.8 and 147).
BLOCK_S = KEY_TILE
CHUNK = 256  # keys per chunk: fixed, whatever T and S are (H100, 8B heads: 256 beat 512 and 128 at 1k-4k keys)


@triton.jit(do_not_specialize=["T", "S"])  # one binary for every number of queries and keys
def _attention_chunk_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, T, S, BS, W, HKV, N_REP, N_CHUNKS, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_kn, stride_kh, stride_ks, stride_vn, stride_vh, stride_vs,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait(PDL)
    pid_r = tl.program_id(0)
    bkv = tl.program_id(1)
    c = tl.program_id(2)
    b = bkv // HKV
    kv_h = bkv % HKV
    # GQA: the rows of a tile are the (query, head) pairs of one kv head, query-major, so the N_REP heads that
    # share it read each key once. A pair's tile is fixed by its own query and head, whatever T is.
    r = pid_r * BLOCK_T + tl.arange(0, BLOCK_T)
    t = r // N_REP
    h = kv_h * N_REP + r % N_REP
    live = t < T
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = live[:, None] & (offs_d < D)[None, :]
    # Padding rows read key 0 only (no NaN); a position past the table's S keys reads all S of them.
    pos = tl.minimum(tl.load(pos_ptr + b * T + t, mask=live, other=0), S - 1)
    end = tl.minimum(tl.max(pos, axis=0) + 1, (c + 1) * CHUNK)  # keys this program reads
    if c * CHUNK < end:  # else no row of this tile reaches the chunk: the merge skips it
        q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=q_mask, other=0)
        k_head = k_ptr + kv_h * stride_kh
        v_head = v_ptr + kv_h * stride_vh
        m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for s0 in range(c * CHUNK, end, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            kv_mask = (offs_s < end)[:, None] & (offs_d < D)[None, :]
            if TILE_IN_BLOCK:  # one block id for the whole tile: no per-key lookup before the K/V loads
                block = tl.load(table_ptr + b * W + s0 // BS)
            else:
                block = tl.load(table_ptr + b * W + offs_s // BS, mask=offs_s < end, other=0)[:, None]
            slot = offs_s % BS
            k = tl.load(k_head + block * stride_kn + slot[:, None] * stride_ks + offs_d[None, :],
                        mask=kv_mask, other=0)
            v = tl.load(v_head + block * stride_vn + slot[:, None] * stride_vs + offs_d[None, :],
                        mask=kv_mask, other=0)
            scores = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain: qk_scale folds in log2(e)
            scores = tl.where(offs_s[None, :] <= pos[:, None], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row that reaches no key of the chunk keeps m = -inf: exp2(-inf - -inf) would be NaN.
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_i - m_new))
            p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp2(scores - m_new[:, None]))
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m_i = m_new
        row = ((b * HKV * N_REP + h) * N_CHUNKS + c) * T + t  # partials [B * H, N_CHUNKS, T]
        tl.store(m_ptr + row, m_i, mask=live)
        tl.store(l_ptr + row, l_i, mask=live)
        tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=live[:, None])


@triton.jit(do_not_specialize=["T", "S"])
def _attention_merge_kernel(
    pos_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, T, S, H, N_CHUNKS, stride_ob, stride_oh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    wait(PDL)
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    pos = tl.minimum(tl.load(pos_ptr + b * T + offs_t, mask=offs_t < T, other=0), S - 1)  # as the chunk kernel
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for c in range(0, tl.max(pos, axis=0) // CHUNK + 1):  # in chunk order; chunk 0 holds key 0 for everyone
        row = (bh * N_CHUNKS + c) * T + offs_t
        used = (offs_t < T) & (c * CHUNK <= pos)  # a chunk past a query's position is not read for it
        m_c = tl.load(m_ptr + row, mask=used, other=float("-inf"))
        l_c = tl.load(l_ptr + row, mask=used, other=0)
        acc_c = tl.load(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=used[:, None], other=0)
        m_new = tl.maximum(m, m_c)  # finite: chunk 0 gives every query a finite max
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_c - m_new)
        l = l * alpha + l_c * beta
        acc = acc * alpha[:, None] + acc_c * beta[:, None]
        m = m_new
    out = acc / l[:, None]
    o_mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :],
             out.to(tl.bfloat16), mask=o_mask)


@register("attention", "", "cuda")
def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              q_pos: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D] at positions q_pos [B, T]; pools [N, Hkv, bs, D], block table [B, W] (kernels/ops.py):
    the reference attention, in two kernels, reading the keys in place."""
    if not q.dtype == k_pool.dtype == v_pool.dtype == torch.bfloat16:
        return reference_attention(q, k_pool, v_pool, table, q_pos)  # bf16 only: other dtypes take the reference
    b, h, t, d = q.shape
    bs, w = k_pool.shape[2], table.shape[1]
    check_block_size(bs)
    s = w * bs  # keys the table addresses
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise SelfspecError("the KV pools must be contiguous along head_dim")
    table, pos = table.contiguous(), q_pos.contiguous()
    n_chunks, block_d = triton.cdiv(s, CHUNK), triton.next_power_of_2(d)
    m = torch.empty((b * h, n_chunks, t), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b * h, n_chunks, t, block_d), dtype=torch.float32, device=q.device)
    out = torch.empty((b, h, t, d), dtype=q.dtype, device=q.device)
    hkv = k_pool.shape[1]
    _attention_chunk_kernel[(triton.cdiv(t * (h // hkv), BLOCK_T), b * hkv, n_chunks)](
        q, k_pool, v_pool, table, pos, m, l, acc, t, s, bs, w, hkv, h // hkv, n_chunks,
        math.log2(math.e) / math.sqrt(d), *q.stride()[:3], *k_pool.stride()[:3], *v_pool.stride()[:3],
        D=d, BLOCK_D=block_d, BLOCK_T=BLOCK_T, BLOCK_S=BLOCK_S, CHUNK=CHUNK, TILE_IN_BLOCK=bs % BLOCK_S == 0,
        num_warps=8, num_stages=2, **launch_options(),
    )
    _attention_merge_kernel[(triton.cdiv(t, BLOCK_T), b * h)](
        pos, m, l, acc, out, t, s, h, n_chunks, *out.stride()[:3],
        D=d, BLOCK_D=block_d, BLOCK_T=BLOCK_T, CHUNK=CHUNK, num_warps=4, **launch_options(),
    )
    return out
