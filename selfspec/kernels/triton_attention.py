"""Triton causal attention with GQA and per-row position offsets: query (b, t) reads keys 0..q_pos[b, t].

Keys are read through a block table: key s of row b is pool[table[b, s // BS], kv_head, s % BS], so the paged
cache is read in place (no gather); the contiguous cache is the case of one block of S slots per row. Where
blocks hold whole key tiles (BS a multiple of BLOCK_S, the contiguous cache included), a tile's keys share one
block id, read once per tile instead of once per key.

The keys are cut into chunks of a fixed size (CHUNK). Each chunk is an online softmax over its key tiles, in
order, from a fresh state, with fp32 scores and accumulators (`_chunk_softmax`); the chunks' (max, sum, acc)
states are then merged in chunk order (`_merge`). A tile's rows are the (query, head) pairs of the query heads
that share one kv head (GQA), so each key tile is read once for all of them. Two paths run this arithmetic:
- split (flash-decoding): one program per (tile of rows, kv head, chunk) writes its chunk's state; a second
  kernel merges each query's chunk states. A decode step has one query per head, so splitting the keys is what
  puts enough programs on the GPU.
- in-program (prefill): one program per (tile of rows, kv head) walks all its chunks itself and merges each into
  a running state as it goes: no partials through memory, and a tile stops at its last row's position.
Both give a query the same bits: its chunk states are computed by the same code from the same keys, and merged
by the same code in the same order. A shared tree pass (model.TreeLayout with tails) may take a third,
`tree_attention`: the split path with a tile's rows the (node, head) pairs of one sequence's nodes, each node's query
once, the prefix read once for them all and each branch's own keys in a masked pass of their own.

Invariance across the number of queries, the batch and the path: a query's scores, running max and sums only
ever involve its own row (the sums are dots with ones, so no layout's reduction tree enters: the tile height and
the warps may follow the batch, `_tiles`); a key tile past its
position is fully masked for it, which leaves its state bit-for-bit unchanged (the max stays, exp2(0) = 1
rescales, p = 0 adds exact zeros); the chunks are fixed and merged in order, and a chunk past its position is
not merged for it. So it gets the same result alone, among other queries, or in a prompt cut into pieces.
On the GPU the tile height picks the tensor-core instructions (16, 32 rows: mma.sync; 64 or more: wgmma), and
wgmma rounds some rows differently (H100: 5-163 outputs of a prompt): so every tile here is 16 or 32 rows high
(tests/gpu compares the bits). 3-D dots over 16-row slabs (mma.sync at any height) were slower still at 64 rows
and did not keep the bits either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from selfspec.cache.paged import KEY_TILE, check_block_size
from selfspec.errors import SelfspecError
from selfspec.kernels import register
from selfspec.kernels.launch import cdiv, launch_options, next_power_of_2, wait
from selfspec.kernels.reference import attention as reference_attention

if TYPE_CHECKING:
    from selfspec.model import TreeLayout

# Keys per step of the online softmax: fixed, so every query sums its keys in the same order. H100, 8B heads, 8
# warps (docs/bench-h100/attention-key-tiles.json): 128 keys took 9.0 us at batch 1 and 1k keys against 11.1 for
# 64, and 118 vs 112 us at batch 32 x 9 queries (256: 6.8 and 147).
BLOCK_S = KEY_TILE
CHUNK = 256  # keys per chunk: fixed, whatever T and S are (H100, 8B heads: 256 beat 512 and 128 at 1k-4k keys)
MERGE_BLOCK_T = 16  # queries per program of the merge kernel (elementwise: no bearing on any query's bits)


@dataclass(frozen=True)
class Tiles:
    """How a call is cut into programs. Every choice computes the same arithmetic in the same order per query."""
    block_t: int = 16  # (query, head) rows per program: a power of two >= 16 (a tensor-core tile)
    in_program: bool = False  # one program walks all chunks, else chunks split over programs + the merge kernel
    warps: int = 8  # per program (the row sums are dots, so the layout the warps make has no bearing on the bits)


DECODE_TILES = Tiles()  # decode and verify: few queries, so the keys are split to fill the GPU
# Verify passes of a batch: more (query, head) rows per kv head than one 16-row tile holds (5 tokens x 4 heads =
# 20), over enough kv heads to fill the GPU. One 32-row tile reads each key chunk once; 4 warps halve the rows'
# exchange. H100, 8B heads, 1k keys (docs/bench-h100/attention-verify-tiles.log): batch 32 x 5 queries 81.5 us
# against 105.4 for DECODE_TILES, batch 8 27.8 vs 31.4; batch 1 (8 kv heads) 14.0 vs 11.5, so it keeps 16 rows.
VERIFY_TILES = Tiles(32, warps=4)
VERIFY_MIN_HEADS = 64  # batch x kv heads from which verify passes take VERIFY_TILES
# From batch 32 (8 kv heads) those tiles fill the GPU without splitting the keys: no partials, no merge kernel.
# H100, 5 queries (attention-verify-in-program.log): 77.3 vs 82.1 us at 1k keys, 247 vs 270 at 4k, batch 64 144.7
# vs 152.4; batch 16 loses (63.5 vs 46.4).
WIDE_VERIFY_TILES = Tiles(32, in_program=True, warps=4)
WIDE_VERIFY_MIN_HEADS = 256
# Many queries fill the GPU by themselves: no partials through memory. 32 rows: the tallest tile that keeps the
# 16-row tiles' bits (mma.sync; 64 and 128 rows take wgmma, which changed 5-163 outputs); H100, 8B heads, causal
# B=1 x 2048: 643 us against 1116 for 16 rows in-program and 837 for 16-row split tiles
# (docs/bench-h100/attention-prefill-tiles.json).
PREFILL_TILES = Tiles(32, in_program=True)
# Prompt tokens (Mode.prompt) in their own arithmetic: every prompt query on 128-row tiles, at any T. wgmma then
# rounds some rows otherwise than the tiles above, but the same way at any tile height from 64 rows and whatever
# the other rows of the tile (the 64- and 128-row tiles changed the same 5-163 outputs, split or in-program), so
# chunked == one piece and packed == alone still hold; 3.4x SDPA's time at B=1 x 8192 against 10.1x for 32 rows
# (docs/bench-h100/attention-prefill-tiles.json).
PROMPT_TILES = Tiles(128, in_program=True)
# Queries per row from which a call takes PREFILL_TILES. Either path gives the same bits, so this is speed only:
# at 256 queries a batch of one already has 256 * N_REP / 16 tiles per kv head (python -m selfspec.bench.attention
# times both paths there).
PREFILL_MIN_T = 256


@triton.jit
def _tile_rows(pos_ptr, pid_r, b, kv_h, T, S, N_REP, BLOCK_T: tl.constexpr, TAILS: tl.constexpr):
    """A tile's rows: their queries t, heads h, whether they exist, and their positions (clamped to the table)."""
    # Query-major (query, head) pairs of one kv head, so the N_REP heads that share it read each key once. A
    # pair's tile is fixed by its own query and head, whatever T is.
    r = pid_r * BLOCK_T + tl.arange(0, BLOCK_T)
    t = r // N_REP
    h = kv_h * N_REP + r % N_REP
    live = t < T
    if TAILS:  # a tile of a branch row's padding (queries not past their predecessor, a suffix) is not computed
        t0 = pid_r * BLOCK_T // N_REP
        if t0 > 0 and t0 < T:
            live = live & (tl.load(pos_ptr + b * T + t0) > tl.load(pos_ptr + b * T + t0 - 1))
    # Padding rows read key 0 only (no NaN); a position past the table's S keys reads all S of them.
    pos = tl.minimum(tl.load(pos_ptr + b * T + t, mask=live, other=0), S - 1)
    return t, h, live, pos


@triton.jit
def _chunk_softmax(q, pos, k_head, v_head, table_row, tail_row, base, start, end, BS, qk_scale, stride_kn, stride_ks,
                   stride_vn, stride_vs, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_S: tl.constexpr, TILE_IN_BLOCK: tl.constexpr, TAILS: tl.constexpr):
    """The online softmax of keys start..end-1 (one chunk, cut at the tile's last position) from a fresh state:
    each row's (max, sum, acc), max -inf for a row that reaches no key of the chunk. With TAILS, key base + i is
    read at position tail_row[i] (kernels/ops.py `attention`): the tiles from the one holding key `base` on, in a
    loop of their own (a branch in the loop would cost the other tiles their pipelining); the same tiles, values
    and order."""
    offs_d = tl.arange(0, BLOCK_D)
    mid = end
    if TAILS:
        mid = tl.minimum(end, start + tl.maximum(base - start, 0) // BLOCK_S * BLOCK_S)
    m_i, l_i, acc = _shared_tiles(q, pos, k_head, v_head, table_row, start, mid, end, BS, qk_scale, stride_kn,
                                  stride_ks, stride_vn, stride_vs, D, BLOCK_D, BLOCK_T, BLOCK_S, TILE_IN_BLOCK)
    if TAILS:
        for s0 in range(mid, end, BLOCK_S):  # the tiles holding the row's own keys
            offs_s = s0 + tl.arange(0, BLOCK_S)
            kv_mask = (offs_s < end)[:, None] & (offs_d < D)[None, :]
            own = (offs_s >= base) & (offs_s < end)
            at = tl.where(own, tl.load(tail_row + offs_s - base, mask=own, other=0), offs_s)
            k, v = _keys_at(at, k_head, v_head, table_row, kv_mask, offs_s < end, BS, stride_kn, stride_ks, stride_vn,
                            stride_vs, offs_d)
            m_i, l_i, acc = _softmax_step(q, k, v, pos, offs_s, qk_scale, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _shared_tiles(q, pos, k_head, v_head, table_row, start, mid, end, BS, qk_scale, stride_kn, stride_ks, stride_vn,
                  stride_vs, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                  TILE_IN_BLOCK: tl.constexpr):
    """The online softmax of the key tiles from start up to mid (keys below end) from a fresh state, each key read
    at its own position through the block table: a chunk's tiles before any row's own tail keys."""
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for s0 in range(start, mid, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        kv_mask = (offs_s < end)[:, None] & (offs_d < D)[None, :]
        if TILE_IN_BLOCK:  # one block id for the whole tile: no per-key lookup before the K/V loads
            block = tl.load(table_row + s0 // BS)
        else:
            block = tl.load(table_row + offs_s // BS, mask=offs_s < end, other=0)[:, None]
        slot = offs_s % BS
        k = tl.load(k_head + block * stride_kn + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_head + block * stride_vn + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0)
        m_i, l_i, acc = _softmax_step(q, k, v, pos, offs_s, qk_scale, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _keys_at(at, k_head, v_head, table_row, kv_mask, in_chunk, BS, stride_kn, stride_ks, stride_vn, stride_vs, offs_d):
    """A key tile's K and V [BLOCK_S, BLOCK_D] read at positions `at` through the block table (a tail's keys sit
    where its tails say, not in order)."""
    block = tl.load(table_row + at // BS, mask=in_chunk, other=0)[:, None]
    slot = at % BS
    k = tl.load(k_head + block * stride_kn + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0)
    v = tl.load(v_head + block * stride_vn + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0)
    return k, v


@triton.jit
def _softmax_step(q, k, v, pos, offs_s, qk_scale, m_i, l_i, acc):
    """One key tile of the online softmax: the running (max, sum, acc) with keys offs_s (k, v) added."""
    scores = tl.dot(q, tl.trans(k))
    scores = scores * qk_scale  # log2 domain: qk_scale folds in log2(e)
    scores = tl.where(offs_s[None, :] <= pos[:, None], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that reaches no key of the chunk keeps m = -inf: exp2(-inf - -inf) would be NaN.
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_i - m_new))
    p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp2(scores - m_new[:, None])).to(tl.bfloat16)
    l_i = l_i * alpha + _row_sums(p)
    acc = tl.dot(p, v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _row_sums(p):
    """Each row's sum of p [BLOCK_T, BLOCK_S] (bf16, the weights the dot with v takes) as a tensor-core dot with
    ones: its order of adds is the instruction's, whatever the warps and the tile height (tl.sum's tree follows
    the layout, so it would tie the bits to them); every column of the product holds the sum, max picks one."""
    ones = tl.full((p.shape[1], 16), 1.0, tl.float32).to(tl.bfloat16)  # (the interpreter has no bf16 constants)
    return tl.max(tl.dot(p, ones), axis=1)


@triton.jit
def _merge(m, l, acc, m_c, l_c, acc_c):
    """The running state (m, l, acc) with one more chunk's state merged in: the one merge of both paths."""
    m_new = tl.maximum(m, m_c)  # finite once chunk 0 is in: it holds key 0 for everyone
    alpha = tl.exp2(m - m_new)
    beta = tl.exp2(m_c - m_new)
    l = l * alpha + l_c * beta
    acc = acc * alpha[:, None] + acc_c * beta[:, None]
    return m_new, l, acc


@triton.jit(do_not_specialize=["T", "S"])  # one binary for every number of queries and keys
def _attention_chunk_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, tails_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, T, S, BS, W, HKV, N_REP, N_CHUNKS,
    qk_scale, stride_qb, stride_qh, stride_qt, stride_kn, stride_kh, stride_ks, stride_vn, stride_vh, stride_vs,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr, TAILS: tl.constexpr, PDL: tl.constexpr,
):
    wait(PDL)
    pid_r = tl.program_id(0)
    bkv = tl.program_id(1)
    c = tl.program_id(2)
    b = bkv // HKV
    kv_h = bkv % HKV
    t, h, live, pos = _tile_rows(pos_ptr, pid_r, b, kv_h, T, S, N_REP, BLOCK_T, TAILS)
    offs_d = tl.arange(0, BLOCK_D)
    end = tl.minimum(tl.max(pos, axis=0) + 1, (c + 1) * CHUNK)  # keys this program reads
    if c * CHUNK < end:  # else no row of this tile reaches the chunk: the merge skips it
        q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=live[:, None] & (offs_d < D)[None, :], other=0)
        m_i, l_i, acc = _chunk_softmax(
            q, pos, k_ptr + kv_h * stride_kh, v_ptr + kv_h * stride_vh, table_ptr + b * W, tails_ptr + b * T,
            tl.load(pos_ptr + b * T), c * CHUNK, end, BS, qk_scale, stride_kn, stride_ks, stride_vn, stride_vs, D,
            BLOCK_D, BLOCK_T, BLOCK_S, TILE_IN_BLOCK, TAILS)
        row = ((b * HKV * N_REP + h) * N_CHUNKS + c) * T + t  # partials [B * H, N_CHUNKS, T]
        tl.store(m_ptr + row, m_i, mask=live)
        tl.store(l_ptr + row, l_i, mask=live)
        tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=live[:, None])


@triton.jit(do_not_specialize=["T", "S", "N_SEQ"])
def _tree_chunk_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, tails_ptr, pos_ptr, first_ptr, starts_ptr, m_ptr, l_ptr, acc_ptr, T, S, BS, W, HKV,
    N_REP, N_CHUNKS, N_SEQ, qk_scale, stride_qb, stride_qh, stride_qt, stride_kn, stride_kh, stride_ks, stride_vn,
    stride_vh, stride_vs, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr, TILE_IN_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """_attention_chunk_kernel for a shared tree pass, each node's query once: a tile's rows are (node, head)
    pairs of one sequence's nodes, each at the entry `first` names (its branch row b, query t). The prefix's key
    tiles (below the pending token's position, shared by every branch) are read once for all; a tile holding a
    branch's own keys runs once per branch among the tile's rows, the other rows' scores all masked (a fully masked
    tile leaves a row's state bit for bit). So each node gets the bits of its branch row in `_attention_chunk_kernel`
    (the same keys, tiles and order), with its ancestors' queries not recomputed in every branch. Programs go
    through the sequences' tiles in order (starts [N_SEQ + 1]; a padding sequence, starts not rising, has none)."""
    wait(PDL)
    kv_h = tl.program_id(1)
    c = tl.program_id(2)
    per_tile = BLOCK_T // N_REP  # nodes a tile holds
    seq = -1
    tile = tl.program_id(0)
    for s in range(0, N_SEQ):  # this program's sequence and its tile there
        count = (tl.maximum(tl.load(starts_ptr + s + 1) - tl.load(starts_ptr + s), 0).to(tl.int32) + per_tile - 1)
        count = count // per_tile
        hit = (seq < 0) & (tile < count)
        tile = tl.where((seq < 0) & ~hit, tile - count, tile)
        seq = tl.where(hit, s, seq)
    lo = tl.load(starts_ptr + seq, mask=seq >= 0, other=0)
    hi = tl.load(starts_ptr + seq + 1, mask=seq >= 0, other=0)
    r = tl.arange(0, BLOCK_T)
    slot = r // N_REP
    n = lo + tile * per_tile + slot
    live = (n < hi) & (slot < per_tile)
    h = kv_h * N_REP + r % N_REP
    e = tl.load(first_ptr + n, mask=live, other=0)
    b = e // T
    t = e % T
    root = tl.load(first_ptr + lo, mask=lo < hi, other=0)  # the pending token: its row's table, its position
    base = tl.load(pos_ptr + root)
    table_row = table_ptr + (root // T) * W
    pos = tl.minimum(tl.load(pos_ptr + e, mask=live, other=0), S - 1)
    end = tl.minimum(tl.max(pos, axis=0) + 1, (c + 1) * CHUNK)
    start = c * CHUNK
    if (start < end) & (lo < hi):
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b[:, None] * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                    mask=live[:, None] & (offs_d < D)[None, :], other=0)
        k_head = k_ptr + kv_h * stride_kh
        v_head = v_ptr + kv_h * stride_vh
        mid = tl.minimum(end, start + tl.maximum(base - start, 0) // BLOCK_S * BLOCK_S)
        m_i, l_i, acc = _shared_tiles(q, pos, k_head, v_head, table_row, start, mid, end, BS, qk_scale, stride_kn,
                                      stride_ks, stride_vn, stride_vs, D, BLOCK_D, BLOCK_T, BLOCK_S,
                                      TILE_IN_BLOCK)  # the prefix: every branch's
        b_lo = tl.min(tl.where(live, b, 1 << 30), axis=0)
        b_hi = tl.max(tl.where(live, b, -1), axis=0)
        for s0 in range(mid, end, BLOCK_S):  # the tiles holding the branches' own keys, each branch in turn
            offs_s = s0 + tl.arange(0, BLOCK_S)
            kv_mask = (offs_s < end)[:, None] & (offs_d < D)[None, :]
            own = (offs_s >= base) & (offs_s < end)
            for bb in range(b_lo, b_hi + 1):
                at = tl.where(own, tl.load(tails_ptr + bb * T + offs_s - base, mask=own, other=0), offs_s)
                k, v = _keys_at(at, k_head, v_head, table_row, kv_mask, offs_s < end, BS, stride_kn, stride_ks,
                                stride_vn, stride_vs, offs_d)
                m_i, l_i, acc = _softmax_step(q, k, v, tl.where(b == bb, pos, -1), offs_s, qk_scale, m_i, l_i, acc)
        row = ((b * HKV * N_REP + h) * N_CHUNKS + c) * T + t  # partials [B * H, N_CHUNKS, T], as the chunk kernel's
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
        m, l, acc = _merge(m, l, acc, m_c, l_c, acc_c)
    out = (acc / l[:, None]).to(tl.bfloat16)
    o_mask = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_t[:, None] * stride_ot + offs_d[None, :], out, mask=o_mask)


@triton.jit(do_not_specialize=["T", "S"])
def _attention_in_program_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, tails_ptr, pos_ptr, o_ptr, T, S, BS, W, HKV, N_REP, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_kn, stride_kh, stride_ks, stride_vn, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_ot,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr, TAILS: tl.constexpr, PDL: tl.constexpr,
):
    wait(PDL)
    pid_r = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the last tiles read the most keys, so start first
    bkv = tl.program_id(1)
    b = bkv // HKV
    kv_h = bkv % HKV
    t, h, live, pos = _tile_rows(pos_ptr, pid_r, b, kv_h, T, S, N_REP, BLOCK_T, TAILS)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                mask=live[:, None] & (offs_d < D)[None, :], other=0)
    k_head = k_ptr + kv_h * stride_kh
    v_head = v_ptr + kv_h * stride_vh
    end = tl.max(pos, axis=0) + 1  # the tile stops at its last row's position
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for c in range(0, (end + CHUNK - 1) // CHUNK):  # in chunk order, each chunk's state as the split path's
        m_c, l_c, acc_c = _chunk_softmax(
            q, pos, k_head, v_head, table_ptr + b * W, tails_ptr + b * T, tl.load(pos_ptr + b * T), c * CHUNK,
            tl.minimum(end, (c + 1) * CHUNK), BS, qk_scale, stride_kn, stride_ks, stride_vn, stride_vs, D, BLOCK_D,
            BLOCK_T, BLOCK_S, TILE_IN_BLOCK, TAILS)
        used = c * CHUNK <= pos  # as the merge kernel: a chunk past a query's position is not merged for it
        m_c = tl.where(used, m_c, float("-inf"))
        l_c = tl.where(used, l_c, 0.0)
        acc_c = tl.where(used[:, None], acc_c, 0.0)
        m, l, acc = _merge(m, l, acc, m_c, l_c, acc_c)
    out = (acc / l[:, None]).to(tl.bfloat16)
    tl.store(o_ptr + b * stride_ob + h[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :], out,
             mask=live[:, None] & (offs_d < D)[None, :])


@register("attention", "", "cuda")
def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              q_pos: torch.Tensor, prompt: bool = False, tiles: Tiles | None = None,
              tails: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] at positions q_pos [B, T]; pools [N, Hkv, bs, D], block table [B, W] (kernels/ops.py):
    the reference attention, reading the keys in place. tiles: PROMPT_TILES for prompt tokens, else
    PREFILL_TILES from PREFILL_MIN_T queries on, else (WIDE_)VERIFY_TILES or DECODE_TILES (`_tiles`; read at each
    call, so a script may set them)."""
    return _attention(q, k_pool, v_pool, table, q_pos, prompt, tiles, tails=tails)


def _tiles(b: int, hkv: int, t: int, n_rep: int, prompt: bool, tails: bool = False) -> Tiles:
    """The dispatcher's tiles for b rows of t queries over hkv kv heads (speed only: all give the same bits, but
    PROMPT_TILES, prompt tokens' own arithmetic). Rows with tails (a tree's branches) take VERIFY_TILES at any
    batch: H100, 8B heads, 6 branch rows x 6 queries, 1k keys (docs/bench-h100/attention-tails-probe.log): 19.2 us
    against 41.3 for DECODE_TILES, whose gathered tail tiles are slow on 8 warps. Never in-program: a tree pass of
    4 sequences (32 branch rows over 600 keys, H200, under the engine's graphs) took 102 us a layer there, each
    program walking every key of its row alone."""
    if prompt:
        return PROMPT_TILES
    if t >= PREFILL_MIN_T:
        return PREFILL_TILES
    if t * n_rep > DECODE_TILES.block_t:
        if tails:
            return VERIFY_TILES
        if b * hkv >= VERIFY_MIN_HEADS:
            return WIDE_VERIFY_TILES if b * hkv >= WIDE_VERIFY_MIN_HEADS else VERIFY_TILES
    return DECODE_TILES


def _attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
               q_pos: torch.Tensor, prompt: bool, tiles: Tiles | None,
               tails: torch.Tensor | None = None) -> torch.Tensor:
    if not q.dtype == k_pool.dtype == v_pool.dtype == torch.bfloat16:  # bf16 only: others take the reference
        return reference_attention(q, k_pool, v_pool, table, q_pos, tails=tails)
    b, h, t, d = q.shape
    tiles = tiles or _tiles(b, k_pool.shape[1], t, h // k_pool.shape[1], prompt, tails is not None)
    q, table, pos, out = _kernel_inputs(q, k_pool, v_pool, table, q_pos, tiles)
    bs, w = k_pool.shape[2], table.shape[1]
    s = w * bs  # keys the table addresses
    hkv = k_pool.shape[1]
    args = (t, s, bs, w, hkv, h // hkv)
    strides = (math.log2(math.e) / math.sqrt(d), *q.stride()[:3], *k_pool.stride()[:3], *v_pool.stride()[:3])
    if tails is not None and tails.shape != pos.shape:
        raise SelfspecError(f"tails {tuple(tails.shape)} must match the queries' positions {tuple(pos.shape)}")
    consts = dict(D=d, BLOCK_D=next_power_of_2(d), BLOCK_T=tiles.block_t, BLOCK_S=BLOCK_S, CHUNK=CHUNK,
                  TILE_IN_BLOCK=bs % BLOCK_S == 0, TAILS=tails is not None, num_warps=tiles.warps, num_stages=2,
                  **launch_options())
    tails = pos if tails is None else tails.contiguous()  # (not read without TAILS)
    n_tiles = cdiv(t * (h // hkv), tiles.block_t)
    if tiles.in_program:
        _attention_in_program_kernel[(n_tiles, b * hkv)](
            q, k_pool, v_pool, table, tails, pos, out, *args, *strides, *out.stride()[:3], **consts)
        return out
    m, l, acc = _chunk_states(out, s)
    _attention_chunk_kernel[(n_tiles, b * hkv, m.shape[1])](
        q, k_pool, v_pool, table, tails, pos, m, l, acc, *args, m.shape[1], *strides, **consts)
    return _merge_chunks(pos, m, l, acc, out, s)


def _kernel_inputs(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                   q_pos: torch.Tensor, tiles: Tiles) -> tuple[torch.Tensor, ...]:
    """The checked inputs of a bf16 attention kernel (q, table, positions), and its output [B, H, T, D], written
    token-major: the output projection's input [B, T, H * D] is then a view, not a copy."""
    if tiles.block_t < 16 or tiles.block_t & (tiles.block_t - 1):
        raise SelfspecError(f"attention tiles need a power of two >= 16 rows (a tensor-core tile), got {tiles.block_t}")
    check_block_size(k_pool.shape[2])
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise SelfspecError("the KV pools must be contiguous along head_dim")
    b, h, t, d = q.shape
    out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    return q if q.stride(-1) == 1 else q.contiguous(), table.contiguous(), q_pos.contiguous(), out


def _chunk_states(out: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split path's partials for output out [B, H, T, D] over s keys: each (query, head)'s chunk states, max
    and sum [B * H, N_CHUNKS, T] and acc [B * H, N_CHUNKS, T, BLOCK_D] (fp32)."""
    b, h, t, d = out.shape
    m = torch.empty((b * h, cdiv(s, CHUNK), t), dtype=torch.float32, device=out.device)
    acc = torch.empty((*m.shape, next_power_of_2(d)), dtype=torch.float32, device=out.device)
    return m, torch.empty_like(m), acc


def _merge_chunks(pos: torch.Tensor, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor,
                  s: int) -> torch.Tensor:
    """out with each query's chunk states merged in chunk order (`_attention_merge_kernel`)."""
    _, h, t, d = out.shape
    _attention_merge_kernel[(cdiv(t, MERGE_BLOCK_T), m.shape[0])](
        pos, m, l, acc, out, t, s, h, m.shape[1], *out.stride()[:3],
        D=d, BLOCK_D=acc.shape[-1], BLOCK_T=MERGE_BLOCK_T, CHUNK=CHUNK, num_warps=4, **launch_options(),
    )
    return out


# Tree passes, each node's query once: H200, 8B heads, B sequences of 16-node trees over 600 / 1,100 keys, per layer
# under CUDA graphs (docs/bench-h200/tree-attention-probe.log): 16 rows on 4 warps 19.6 / 23.0 us at B = 1 against
# 21.0 / 37.1 for the branch rows (VERIFY_TILES), 52.3 / 73.7 at B = 4 against 71.4 / 117.2; from 128 nodes (B = 8)
# 32-row tiles, 93.6 / 113.4 against 154.1 / 220.3 (16 rows: 94.9 / 132.3).
TREE_TILES = Tiles(16, warps=4)
WIDE_TREE_TILES = Tiles(32, warps=4)
WIDE_TREE_NODES = 128  # nodes in the pass from which it takes WIDE_TREE_TILES


@register("tree_attention", "", "cuda")
def tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                   q_pos: torch.Tensor, tree: TreeLayout, tiles: Tiles | None = None) -> torch.Tensor:
    """kernels/ops.py `tree_attention`, each node's query once (`_tree_chunk_kernel`): q [R, H, T, D] and q_pos
    [R, T] in branch rows; tree.starts: each sequence's nodes consecutive from its pending token (a sequence's branch
    rows read its table row). Only the entries tree.first names are written, each the bits `attention` gives it.
    tiles: TREE_TILES, or WIDE_TREE_TILES from WIDE_TREE_NODES nodes (speed only: every tile gives the same bits)."""
    if not q.dtype == k_pool.dtype == v_pool.dtype == torch.bfloat16:
        return reference_attention(q, k_pool, v_pool, table, q_pos, tails=tree.tails)
    tiles = tiles or (WIDE_TREE_TILES if len(tree.first) >= WIDE_TREE_NODES else TREE_TILES)
    q, table, pos, out = _kernel_inputs(q, k_pool, v_pool, table, q_pos, tiles)
    h, t, d = q.shape[1:]
    hkv, bs, w = k_pool.shape[1], k_pool.shape[2], table.shape[1]
    s, n_rep = w * bs, h // hkv
    m, l, acc = _chunk_states(out, s)
    n_seq = len(tree.starts) - 1
    # Enough programs for every sequence's tiles: a sequence's last tile is the only one not full.
    n_tiles = cdiv(len(tree.first), tiles.block_t // n_rep) + n_seq
    _tree_chunk_kernel[(n_tiles, hkv, m.shape[1])](
        q, k_pool, v_pool, table, tree.tails.contiguous(), pos, tree.first, tree.starts, m, l, acc, t, s, bs, w, hkv,
        n_rep, m.shape[1], n_seq, math.log2(math.e) / math.sqrt(d), *q.stride()[:3], *k_pool.stride()[:3],
        *v_pool.stride()[:3], D=d, BLOCK_D=acc.shape[-1], BLOCK_T=tiles.block_t, BLOCK_S=BLOCK_S, CHUNK=CHUNK,
        TILE_IN_BLOCK=bs % BLOCK_S == 0, num_warps=tiles.warps, num_stages=2, **launch_options())
    return _merge_chunks(pos, m, l, acc, out, s)
