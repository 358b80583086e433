"""Triton flash-decoding attention over a quantized KV cache (cache/quant_kv.py): `quantized_attention`.

A query at position p reads keys below quantized_below(p) from the quantized groups and the rest (up to p) from the
full-precision buffer. Both are paged: the quantized groups in blocks read through each row's block table, the
buffer in a block of its own per row (cache/quant_kv.py QuantLayer).

A program serves every query of a sequence row that reads one kv head: the T query tokens x the query heads of the
kv head (GQA) are the rows of its tensor-core dots (tiles of 16 rows; past 16 the rows are split over programs of
16), so a verify pass of up to 4 tokens at 4 query heads a kv head reads each key once. The quantized keys are split
into chunks of whole groups (CHUNK_KEYS, a multiple of G): one program per (row, kv head, slice of query rows,
chunk) loads the chunk's codes (INT8, or one or both INT4 planes, two codes a byte), dequantizes them in registers
with the group's per-channel key scales and the per-token value scales, and runs an online softmax over the chunk
(scores and the weighted sum as tensor-core dots: tf32 products, fp32 sums), each query masking the keys past its
own quantized range; one more program per (row, kv head, slice) does the same over the buffer keys, the only place a
causal mask applies. A second kernel merges each query head's chunk states (max, sum, accumulator) by log-sum-exp in
chunk order.

Batch invariance: a query's chunks and the steps of keys within them sit at offsets set by its position alone and
are walked in a fixed order; a step whose keys a query masks entirely (read for the other queries) leaves its state
bit for bit as it was; and every program has the one tile shape (16 rows on NUM_WARPS), so how a row is reduced cannot
depend on the pass (on an H100, 8 warps, which 32-row tiles need not to spill, made decode 1.8x slower than 4). So
a query's result does not depend on the other queries of the call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from selfspec.cache.kv import LayerKV
from selfspec.cache.quant_kv import quantized_below
from selfspec.errors import SelfspecError
from selfspec.kernels import register
from selfspec.kernels.reference import quantized_attention as reference_quantized_attention

CHUNK_KEYS = 256  # quantized keys per program (rounded to whole groups)
MIN_GROUP = 16  # smaller KV groups take the reference
BLOCK_N = 32  # keys per step of a program's online softmax (at most a group: a step reads one group's scales)
TILE_ROWS = 16  # query rows (tokens x query heads) per program, whatever the pass: more take more programs
NUM_WARPS = 4  # 8 warps: 1.8x slower decode at 128k keys on an H100 (docs/long-context.md)
# Registers per thread (ptxas maxnreg), None: the compiler's choice, 230-255 here, so 2 programs an SM; 168 fits 3
# and spills 200-456 bytes (`selfspec bench resources --attention --max-registers 168`). A tuning knob, not yet timed.
MAX_REGISTERS: int | None = None


def row_slices(rows: int) -> int:
    """Programs the query rows of one (sequence row, kv head) take: one per TILE_ROWS of them."""
    return -(-rows // TILE_ROWS)


def chunk_constants(group: int, dim: int, hier: bool, upper: bool) -> dict:
    """The chunk kernel's compile-time constants for KV groups of `group` and heads of `dim` channels."""
    block_d = triton.next_power_of_2(dim)
    return dict(G=group, CHUNK=max(group, CHUNK_KEYS // group * group), FMT_HIER=hier, UPPER=upper,
                BLOCK=min(BLOCK_N, group), BLOCK_R=TILE_ROWS, BLOCK_D=block_d,
                BLOCK_W=block_d // 2 if hier else block_d)


@triton.jit
def _float_codes(c, OFFSET: tl.constexpr):
    """float32 c - OFFSET of int32 codes 0 <= c < 2^23, exactly, without a conversion instruction: the code or'ed
    into the mantissa of 2^23 reads as 2^23 + c."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _codes(lo_ptr, hi_ptr, off, mask, FMT_HIER: tl.constexpr, UPPER: tl.constexpr, BLOCK: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """The codes of BLOCK keys [BLOCK, BLOCK_D] (float32) from their rows of bytes at off [BLOCK, bytes per row]:
    INT8 bytes; the upper plane's nibbles (channel 2j in byte j's low nibble, 2j + 1 in its high one); or both
    planes joined into one 8-bit code 16 * upper + lower, less the lower plane's offset 8 (one conversion for both)."""
    b = tl.load(lo_ptr + off, mask=mask, other=0).to(tl.int32)
    if FMT_HIER:  # if/else, no early return: the compiler types the code after a return under a constexpr if
        if UPPER:
            x = _float_codes(tl.reshape(tl.interleave(b & 15, b >> 4), (BLOCK, BLOCK_D)), 0.0)
        else:
            low = tl.load(hi_ptr + off, mask=mask, other=0).to(tl.int32)
            even = ((b & 15) << 4) | (low & 15)
            odd = (b & 0xF0) | (low >> 4)
            x = _float_codes(tl.reshape(tl.interleave(even, odd), (BLOCK, BLOCK_D)), 8.0)
    else:
        x = _float_codes(b, 0.0)
    return x


@triton.jit
def _dequantize(codes, s, z, FMT_HIER: tl.constexpr, UPPER: tl.constexpr):
    """z + s * code for INT8 codes and the upper plane; z + s / 16 * (16 * upper + lower - 8) with both planes
    (s, z broadcast): the reference's z + s * upper + s / 16 * (lower - 8) in one product."""
    if FMT_HIER and not UPPER:
        s = s / 16
    return z + s * codes


@triton.jit
def _softmax_step(m, l, acc, k, v, q, live):
    """One online-softmax step of the rows q [BLOCK_R, BLOCK_D] over keys, values [BLOCK_N, BLOCK_D] (live
    [BLOCK_R, BLOCK_N]): scores and the weighted sum on the tensor cores (tf32 products, fp32 sums). A row with no
    live key keeps m, l and acc as they were, bit for bit."""
    scores = tl.where(live, tl.dot(q, tl.trans(k)), float("-inf"))  # [BLOCK_R, BLOCK_N]
    m_new = tl.maximum(m, tl.max(scores, 1))
    none = m_new == float("-inf")  # no live key yet: what the exponents subtract is then any finite number
    m_sub = tl.where(none, 0.0, m_new)
    alpha = tl.where(none, 1.0, tl.exp(m - m_sub))
    p = tl.where(live, tl.exp(scores - m_sub[:, None]), 0.0)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l, acc


@triton.jit
def _quant_attention_chunks(
        q_ptr, pos_ptr, kq0, kq1, ks_ptr, kz_ptr, vq0, vq1, vs_ptr, vz_ptr, table_ptr, kb_ptr, vb_ptr, buf_ptr,
        start_ptr, m_ptr, l_ptr, acc_ptr,
        T, HQ, HKV, QBS, W, D, BS, N_CHUNKS, N_SLICES, sm_scale,
        sqb, sqh, sqt,
        G: tl.constexpr, CHUNK: tl.constexpr, FMT_HIER: tl.constexpr, UPPER: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)  # (b, kv head, slice of the query rows): the rows share each key read
    c = tl.program_id(1)  # chunk; the last one is the buffer's
    s = pid % N_SLICES
    hk = (pid // N_SLICES) % HKV
    b = pid // (N_SLICES * HKV)
    n_rep = HQ // HKV
    r = s * BLOCK_R + tl.arange(0, BLOCK_R)  # query row r: token r // n_rep, query head hk * n_rep + r % n_rep
    rmask = r < T * n_rep
    t = r // n_rep
    h = hk * n_rep + r % n_rep
    pos = tl.load(pos_ptr + b * T + t, mask=rmask, other=-1)  # padding rows: no live key anywhere
    below = G * tl.maximum(pos // G - 1, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + t[:, None] * sqt + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * sm_scale
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    width = D // 2 if FMT_HIER else D  # bytes a key's codes take: two channels a byte in a plane
    keys = tl.arange(0, BLOCK)
    if c < N_CHUNKS:  # quantized keys c * CHUNK .. (the rows' largest quantized range) - 1 of this chunk
        lo, hi = c * CHUNK, tl.minimum(c * CHUNK + CHUNK, tl.max(below, 0))
        # lo and hi are multiples of G, and BLOCK divides G: a step's keys are whole, in one group and one block,
        # each key a row of bytes; the key scales are one per channel of the group, the value scales one per key.
        bytes_mask = (tl.arange(0, BLOCK_W) < width)[None, :]
        for n0 in range(lo, hi, BLOCK):
            block = tl.load(table_ptr + b * W + n0 // QBS)
            row = block * HKV + hk
            at = n0 % QBS
            off = (row * QBS + at + keys)[:, None] * width + tl.arange(0, BLOCK_W)[None, :]
            group = (row * (QBS // G) + at // G) * D + d
            k = _dequantize(_codes(kq0, kq1, off, bytes_mask, FMT_HIER, UPPER, BLOCK, BLOCK_D),
                            tl.load(ks_ptr + group, mask=dmask, other=0).to(tl.float32)[None, :],
                            tl.load(kz_ptr + group, mask=dmask, other=0).to(tl.float32)[None, :], FMT_HIER, UPPER)
            token = row * QBS + at + keys
            v = _dequantize(_codes(vq0, vq1, off, bytes_mask, FMT_HIER, UPPER, BLOCK, BLOCK_D),
                            tl.load(vs_ptr + token).to(tl.float32)[:, None],
                            tl.load(vz_ptr + token).to(tl.float32)[:, None], FMT_HIER, UPPER)
            live = (n0 + keys)[None, :] < below[:, None]
            m, l, acc = _softmax_step(m, l, acc, k, v, q, live)
    else:  # the buffer (block buf[b] of the buffer pools): keys below .. pos at slots below - START .., causal
        row = tl.load(buf_ptr + b) * HKV + hk
        START = tl.load(start_ptr + b)
        # From the smallest quantized range of the rows: steps stay at offsets below - START + k * BLOCK of each
        # (the ranges are multiples of G), whatever the other rows.
        first = tl.min(tl.where(rmask, below, 2147483647), 0)
        for n0 in range(first - START, tl.max(pos, 0) - START + 1, BLOCK):
            slot = n0 + keys
            key_pos = START + slot
            live = (key_pos[None, :] >= below[:, None]) & (key_pos[None, :] <= pos[:, None])
            read = tl.max(live.to(tl.int32), 0) > 0  # the keys some row reads: other slots may hold anything
            mask = read[:, None] & dmask[None, :]
            off = (row * BS + slot)[:, None] * D + d[None, :]
            k = tl.load(kb_ptr + off, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(vb_ptr + off, mask=mask, other=0.0).to(tl.float32)
            m, l, acc = _softmax_step(m, l, acc, k, v, q, live)
    # States [B, T, HQ, N_CHUNKS + 1]: each query head's chunks side by side, for the merge.
    state = ((b * T + t) * HQ + h) * (N_CHUNKS + 1) + c
    tl.store(m_ptr + state, m, mask=rmask)
    tl.store(l_ptr + state, l, mask=rmask)
    tl.store(acc_ptr + state[:, None] * D + d[None, :], acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _merge_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, N_STATES, D, BLOCK_D: tl.constexpr):
    """Each (query, head)'s chunk states merged by log-sum-exp in chunk order -> out [B, T, HQ, D] float32."""
    r = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for c in range(0, N_STATES):
        mc = tl.load(m_ptr + r * N_STATES + c)
        lc = tl.load(l_ptr + r * N_STATES + c)
        ac = tl.load(acc_ptr + (r * N_STATES + c) * D + d, mask=dmask, other=0.0)
        m_new = tl.maximum(m, mc)
        a = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
        w = tl.where(mc == float("-inf"), 0.0, tl.exp(mc - m_new))
        l = l * a + lc * w
        acc = acc * a + ac * w
        m = m_new
    tl.store(out_ptr + r * D + d, acc / l, mask=dmask)


def quantized_attention(q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, upper: bool,
                        max_pos: int | None = None) -> torch.Tensor:
    """kernels/ops.py `quantized_attention`. The grid covers the quantized groups up to max_pos, by default every
    position the rows' block tables hold (chunks past a row's quantized range are empty and merge as nothing, so a
    query's bits do not depend on it): no host sync, and a CUDA graph captures the call. A caller that knows the
    largest of q_pos may pass it to launch no empty chunks (bench/long_context.py)."""
    quant = kv.quant
    g = quant.group
    if g & (g - 1):
        raise SelfspecError(f"the Triton quantized attention needs a power-of-two KV group, got {g}")
    if g < MIN_GROUP:  # a step's keys lie in one group, and a tensor-core dot needs 16 of them
        return reference_quantized_attention(q.float(), kv, q_pos, upper).to(q.dtype)
    b, hq, t, dim = q.shape
    hkv, qbs = quant.keys[0].shape[1], quant.keys[0].shape[2]
    hier = quant.fmt == "hier"
    consts = chunk_constants(g, dim, hier, upper)
    capacity = quant.table.shape[1] * qbs  # positions the block tables hold: every quantized range lies below
    quantized = capacity if max_pos is None else min(capacity, int(quantized_below(torch.tensor(max_pos), g)))
    n_chunks = -(-quantized // consts["CHUNK"])
    n_slices = row_slices(t * (hq // hkv))
    states = b * t * hq * (n_chunks + 1)
    m = torch.empty(states, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(states, dim, dtype=torch.float32, device=q.device)
    kq1 = quant.keys[1] if hier else quant.keys[0]
    vq1 = quant.values[1] if hier else quant.values[0]
    _quant_attention_chunks[(b * hkv * n_slices, n_chunks + 1)](
        q, q_pos.contiguous(), quant.keys[0], kq1, quant.k_scale, quant.k_zero, quant.values[0], vq1,
        quant.v_scale, quant.v_zero, quant.table.contiguous(), kv.k, kv.v, kv.table[:, 0].contiguous(),
        quant.start.contiguous(), m, l, acc,
        t, hq, hkv, qbs, quant.table.shape[1], dim, kv.k.shape[2], n_chunks, n_slices, dim ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        **consts, num_warps=NUM_WARPS, **({} if MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}))
    out = torch.empty(b, t, hq, dim, dtype=torch.float32, device=q.device)
    _merge_chunks[(b * t * hq,)](m, l, acc, out, n_chunks + 1, dim, BLOCK_D=consts["BLOCK_D"])
    return out.transpose(1, 2).to(q.dtype)


register("quantized_attention", "", "cuda")(quantized_attention)
