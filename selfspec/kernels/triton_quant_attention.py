"""Triton flash-decoding attention over a quantized KV cache (cache/quant_kv.py): `quantized_attention`.

A query at position p reads keys below quantized_below(p) from the quantized groups and the rest (up to p) from the
full-precision buffer. Both are paged: the quantized groups in blocks read through each row's block table, the
buffer in a block of its own per row (cache/quant_kv.py QuantLayer).

A program serves every query of a sequence row that reads one kv head: the T query tokens x the query heads of the
kv head (GQA) are the rows of its tensor-core dots (tiles of 16 rows; past 16 the rows are split over programs of
16), so a verify pass of up to 4 tokens at 4 query heads a kv head reads each key once. The quantized keys are split
into chunks of whole groups (CHUNK_KEYS, a multiple of G): one program per (row, kv head, slice of query rows,
chunk) runs an online softmax over its chunk, BLOCK_N keys a step; one more program per (row, kv head, slice) does
the same over the buffer keys, the only place a causal mask applies. A second kernel merges each query head's chunk
states (max, sum, accumulator) by log-sum-exp: the buffer's first, then the chunks in order, MERGE_STATES a step.

No code is dequantized. The tensor cores take the codes themselves, as exact float16 integers (bytes turned into
float16 by byte permutes, `_BYTES_ASM`), and the scales and zeros go where they cost a row, not a key:
- keys (a scale and zero per channel of a group): q . (z + s * c) = (q * s) . c + q . z, so each step scales the
  query rows by the group's scales (rounded to float16 for the dot) and adds q . z to the scores;
- values (a scale and zero per key): sum_n p_n (z_n + s_n c_n) = sum_n (p_n s_n) c_n + sum_n p_n z_n, so the
  probabilities are scaled by the keys' scales (times 2^8, so that small ones stay normal float16) and the zeros
  summed apart.
Both hier planes join into one 8-bit code 16 * upper + lower (the lower plane's -8 folded into the zero); the upper
plane alone reads nibbles. A byte holds channels 2j and 2j + 1 (hier), so the rows' channels are read as two halves
(even and odd channels; for int8 the first and the second half), each its own dot: no interleaving in registers.

Batch invariance: a query's chunks and the steps of keys within them sit at offsets set by its position alone and
are walked in a fixed order; a step whose keys a query masks entirely (read for the other queries) leaves its state
bit for bit as it was; the buffer's state comes first in the merge and each chunk's sits at a slot set by its index
alone, empty ones merging as nothing; and every program has the one tile shape (16 rows on NUM_WARPS), so how a row
is reduced cannot depend on the pass. So a query's result does not depend on the other queries of the call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from selfspec.cache.kv import LayerKV
from selfspec.cache.quant_kv import quantized_below
from selfspec.errors import SelfspecError
from selfspec.kernels import ptx, register
from selfspec.kernels.launch import INTERPRETING, cdiv, next_power_of_2
from selfspec.kernels.reference import quantized_attention as reference_quantized_attention

CHUNK_KEYS = 1024  # quantized keys per program (rounded to whole groups)
MIN_GROUP = 16  # smaller KV groups take the reference
MIN_DIM = 32  # and so do smaller heads (a dot takes at least 16 channels of each half)
BLOCK_N = 64  # keys per step of a program's online softmax (at most a group: a step reads one group's key scales)
TILE_ROWS = 16  # query rows (tokens x query heads) per program, whatever the pass: more take more programs
NUM_WARPS = 4
NUM_STAGES = 2  # software pipelining of a program's key steps
# The merge: chunk states a step (a fixed tree: the bits do not depend on the count; at 128k keys, 257 states in 5
# steps) and channels a program (a decode query's 32 heads would be only 32 programs).
MERGE_STATES = 64
MERGE_CHANNELS = 32
# Probabilities times value scales are scaled by this before float16 (exact: a power of two), so that small ones
# stay normal numbers; the accumulators are scaled back on the way out.
V_SCALE = tl.constexpr(256.0)
# Registers per thread (ptxas maxnreg): 128 lets 4 programs share an SM, where the compiler's choice (230-243) lets 2,
# and hides more load latency (`selfspec bench quant_attention` sweeps; docs/long-context.md).
MAX_REGISTERS: int | None = 128
LOG2E = tl.constexpr(1.4426950408889634)  # exponents in base 2


def row_slices(rows: int) -> int:
    """Programs the query rows of one (sequence row, kv head) take: one per TILE_ROWS of them."""
    return -(-rows // TILE_ROWS)


def chunk_constants(group: int, dim: int, hier: bool, upper: bool) -> dict:
    """The chunk kernel's compile-time constants for KV groups of `group` and heads of `dim` channels."""
    return dict(D=dim, G=group, CHUNK=max(group, CHUNK_KEYS // group * group), FMT_HIER=hier, UPPER=upper,
                BLOCK=min(BLOCK_N, group), BLOCK_R=TILE_ROWS, HALF=next_power_of_2(dim) // 2,
                ASM=not INTERPRETING)


_BYTES_ASM = tl.constexpr(ptx.BYTES_F16)  # the codes as exact float16, several a register (kernels/ptx.py)
_NIBBLES_ASM = tl.constexpr(ptx.NIBBLES_F16)
_PLANES_ASM = tl.constexpr(ptx.PLANES_F16)


@triton.jit
def _as_f16(b, ASM: tl.constexpr):
    """uint8 codes -> exact float16 (the cast pins the byte type the asm packs four to a register)."""
    if ASM:
        return tl.inline_asm_elementwise(_BYTES_ASM, "=r,=r,r", [b.to(tl.uint8)], dtype=tl.float16, is_pure=True,
                                         pack=4)
    return b.to(tl.float32).to(tl.float16)


@triton.jit
def _bytes(ptr, off, mask, MASKED: tl.constexpr):
    """Bytes at off; unmasked where every channel is real (a power-of-two head), so that the loads are vectors."""
    if MASKED:
        return tl.load(ptr + off, mask=mask, other=0)
    return tl.load(ptr + off)


@triton.jit
def _code_halves(lo_ptr, hi_ptr, off, mask, HALF_BYTES: tl.constexpr, FMT_HIER: tl.constexpr, UPPER: tl.constexpr,
                 MASKED: tl.constexpr, ASM: tl.constexpr):
    """The codes of a step's keys as two float16 tiles [BLOCK, HALF] (the rows' channel halves), from their bytes at
    off: int8 bytes at off and off + HALF_BYTES; the upper plane's low and high nibbles; or both planes joined,
    16 * upper + lower, at the even and the odd channels."""
    b = _bytes(lo_ptr, off, mask, MASKED)
    if FMT_HIER:
        if UPPER:
            if ASM:
                return tl.inline_asm_elementwise(_NIBBLES_ASM, "=r,=r,=r,=r,r", [b.to(tl.uint8)],
                                                 dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            a, c = b & 15, b >> 4
        else:
            low = _bytes(hi_ptr, off, mask, MASKED)
            if ASM:
                return tl.inline_asm_elementwise(_PLANES_ASM, "=r,=r,=r,=r,r,r", [b.to(tl.uint8), low.to(tl.uint8)],
                                                 dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            a = ((b & 15) << 4) | (low & 15)
            c = (b & 0xF0) | (low >> 4)
    else:
        a, c = b, _bytes(lo_ptr, off + HALF_BYTES, mask, MASKED)
    return _as_f16(a, ASM), _as_f16(c, ASM)


@triton.jit
def _affine(s, z, FMT_HIER: tl.constexpr, UPPER: tl.constexpr):
    """(scale, zero) of the codes `_code_halves` gives: z + s * c for int8 and the upper plane; for both planes
    z + s / 16 * (16 * upper + lower - 8) = (z - s / 2) + s / 16 * joined."""
    if FMT_HIER and not UPPER:
        return s / 16, z - s / 2
    return s, z


@triton.jit
def _softmax_step(m, l, acc_a, acc_b, acc_z, scores, live, pv_scale, vz, va, vb):
    """One online-softmax step (base 2) of the rows over a step's keys: scores [BLOCK_R, BLOCK_N] (live where a row
    reads the key), the values as two float16 halves va, vb [BLOCK_N, HALF] with per-key scales pv_scale (V_SCALE
    included) and zeros vz [BLOCK_N]. A row with no live key keeps its state bit for bit."""
    scores = tl.where(live, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    none = m_new == float("-inf")  # no live key yet: what the exponents subtract is then any finite number
    m_sub = tl.where(none, 0.0, m_new)
    alpha = tl.where(none, 1.0, tl.exp2(m - m_sub))
    p = tl.where(live, tl.exp2(scores - m_sub[:, None]), 0.0)
    l = l * alpha + tl.sum(p, 1)
    acc_z = acc_z * alpha + tl.sum(p * vz[None, :], 1)
    pv = (p * pv_scale[None, :]).to(tl.float16)
    acc_a = tl.dot(pv, va, acc_a * alpha[:, None])
    acc_b = tl.dot(pv, vb, acc_b * alpha[:, None])
    return m_new, l, acc_a, acc_b, acc_z


@triton.jit
def _quant_attention_chunks(
        q_ptr, pos_ptr, kq0, kq1, ks_ptr, kz_ptr, vq0, vq1, vs_ptr, vz_ptr, table_ptr, kb_ptr, vb_ptr, buf_ptr,
        start_ptr, m_ptr, l_ptr, acc_ptr,
        T, HQ, HKV, QBS, W, BS, N_CHUNKS, N_SLICES, sm_scale,
        sqb, sqh, sqt,
        D: tl.constexpr, G: tl.constexpr, CHUNK: tl.constexpr, FMT_HIER: tl.constexpr, UPPER: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)  # (b, kv head, slice of the query rows): the rows share each key read
    c = tl.program_id(1)  # 0: the buffer; c > 0: quantized chunk c - 1
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
    # The channels of the two halves: even and odd (hier: a byte holds channels 2j and 2j + 1), or first and second.
    j = tl.arange(0, HALF)
    jmask = j < D // 2
    d_a = 2 * j if FMT_HIER else j
    d_b = d_a + 1 if FMT_HIER else j + D // 2
    q_rows = q_ptr + b * sqb + h[:, None] * sqh + t[:, None] * sqt
    qmask = rmask[:, None] & jmask[None, :]
    q_a = tl.load(q_rows + d_a[None, :], mask=qmask, other=0.0).to(tl.float32) * (sm_scale * LOG2E)
    q_b = tl.load(q_rows + d_b[None, :], mask=qmask, other=0.0).to(tl.float32) * (sm_scale * LOG2E)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_R,), tl.float32)
    acc_a = tl.zeros((BLOCK_R, HALF), tl.float32)
    acc_b = tl.zeros((BLOCK_R, HALF), tl.float32)
    acc_z = tl.zeros((BLOCK_R,), tl.float32)
    keys = tl.arange(0, BLOCK)
    if c > 0:  # quantized keys (c - 1) * CHUNK .. (the rows' largest quantized range) - 1 of this chunk
        lo = (c - 1) * CHUNK
        hi = tl.minimum(lo + CHUNK, tl.max(below, 0))
        WIDTH: tl.constexpr = D // 2 if FMT_HIER else D  # bytes a key's codes take: two channels a byte in a plane
        MASKED: tl.constexpr = HALF != D // 2  # a head of no power of two: the halves' tiles are padded
        codes = keys[:, None] * WIDTH + j[None, :]  # a step's bytes from its first key's: whole rows of bytes
        cmask = jmask[None, :]
        # lo and hi are multiples of G, and BLOCK divides G: a step's keys are whole, in one group and one block,
        # each key a row of bytes; the key scales are one per channel of the group, the value scales one per key.
        # The upper plane puts a group's key scales into the query rows once (and q . z) for the G // BLOCK steps of
        # its keys: per step, their float16 rounding and the sum go through shared memory, 12% of its time at 128k.
        # The larger steps of both planes and of int8 gained nothing so (int8 lost 20%: two steps spill).
        OUTER: tl.constexpr = G if UPPER else BLOCK
        for g0 in tl.range(lo, hi, OUTER):
            block = tl.load(table_ptr + b * W + g0 // QBS)
            first = (block * HKV + hk) * QBS + g0 % QBS  # the first key in the pools (64-bit)
            group = first // G * D
            ks_a, kz_a = _affine(tl.load(ks_ptr + group + d_a, mask=jmask, other=0).to(tl.float32),
                                 tl.load(kz_ptr + group + d_a, mask=jmask, other=0).to(tl.float32), FMT_HIER, UPPER)
            ks_b, kz_b = _affine(tl.load(ks_ptr + group + d_b, mask=jmask, other=0).to(tl.float32),
                                 tl.load(kz_ptr + group + d_b, mask=jmask, other=0).to(tl.float32), FMT_HIER, UPPER)
            qs_a = (q_a * ks_a[None, :]).to(tl.float16)
            qs_b = (q_b * ks_b[None, :]).to(tl.float16)
            qz = tl.sum(q_a * kz_a[None, :] + q_b * kz_b[None, :], 1)
            for step in tl.static_range(OUTER // BLOCK):
                at = (first + step * BLOCK) * WIDTH
                k_a, k_b = _code_halves(kq0 + at, kq1 + at, codes, cmask, D // 2, FMT_HIER, UPPER, MASKED, ASM)
                scores = tl.dot(qs_a, tl.trans(k_a))
                scores = tl.dot(qs_b, tl.trans(k_b), scores) + qz[:, None]
                vs, vz = _affine(tl.load(vs_ptr + first + step * BLOCK + keys).to(tl.float32),
                                 tl.load(vz_ptr + first + step * BLOCK + keys).to(tl.float32), FMT_HIER, UPPER)
                v_a, v_b = _code_halves(vq0 + at, vq1 + at, codes, cmask, D // 2, FMT_HIER, UPPER, MASKED, ASM)
                live = (g0 + step * BLOCK + keys)[None, :] < below[:, None]
                m, l, acc_a, acc_b, acc_z = _softmax_step(m, l, acc_a, acc_b, acc_z, scores, live, vs * V_SCALE,
                                                          vz, v_a, v_b)
    else:  # the buffer (block buf[b] of the buffer pools): keys below .. pos at slots below - START .., causal
        row = tl.load(buf_ptr + b) * HKV + hk
        START = tl.load(start_ptr + b)
        q_a16 = q_a.to(tl.float16)
        q_b16 = q_b.to(tl.float16)
        # From the smallest quantized range of the rows: steps stay at offsets below - START + k * BLOCK of each
        # (the ranges are multiples of G), whatever the other rows.
        first = tl.min(tl.where(rmask, below, 2147483647), 0)
        for n0 in range(first - START, tl.max(pos, 0) - START + 1, BLOCK):
            slot = n0 + keys
            key_pos = START + slot
            live = (key_pos[None, :] >= below[:, None]) & (key_pos[None, :] <= pos[:, None])
            read = tl.max(live.to(tl.int32), 0) > 0  # the keys some row reads: other slots may hold anything
            mask = read[:, None] & jmask[None, :]
            at = (row * BS + n0 + keys)[:, None] * D  # the step's keys' rows in the buffer pools
            k_a = tl.load(kb_ptr + at + d_a[None, :], mask=mask, other=0.0).to(tl.float16)
            k_b = tl.load(kb_ptr + at + d_b[None, :], mask=mask, other=0.0).to(tl.float16)
            scores = tl.dot(q_b16, tl.trans(k_b), tl.dot(q_a16, tl.trans(k_a)))
            v_a = tl.load(vb_ptr + at + d_a[None, :], mask=mask, other=0.0).to(tl.float16)
            v_b = tl.load(vb_ptr + at + d_b[None, :], mask=mask, other=0.0).to(tl.float16)
            m, l, acc_a, acc_b, acc_z = _softmax_step(m, l, acc_a, acc_b, acc_z, scores, live,
                                                      tl.full((BLOCK,), V_SCALE, tl.float32),
                                                      tl.zeros((BLOCK,), tl.float32), v_a, v_b)
    # States [B, T, HQ, N_CHUNKS + 1]: each query head's states side by side (the buffer's first), for the merge.
    state = ((b * T + t) * HQ + h) * (N_CHUNKS + 1) + c
    tl.store(m_ptr + state, m, mask=rmask)
    tl.store(l_ptr + state, l, mask=rmask)
    z = acc_z[:, None]
    out = acc_ptr + state[:, None] * D
    tl.store(out + d_a[None, :], acc_a / V_SCALE + z, mask=qmask)
    tl.store(out + d_b[None, :], acc_b / V_SCALE + z, mask=qmask)


@triton.jit
def _merge_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, N_STATES, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Each (query, head)'s chunk states merged by log-sum-exp (base 2), BLOCK_S states a step in state order, BLOCK_D
    channels a program -> out [B, T, HQ, D] float32. A state sits in the step and lane its index sets, and an empty
    one (no live key) adds exact zeros, so the states past a row's range change none of its bits."""
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for c0 in tl.range(0, N_STATES, BLOCK_S):
        cs = c0 + tl.arange(0, BLOCK_S)
        cmask = cs < N_STATES
        mc = tl.load(m_ptr + r * N_STATES + cs, mask=cmask, other=float("-inf"))
        lc = tl.load(l_ptr + r * N_STATES + cs, mask=cmask, other=0.0)
        ac = tl.load(acc_ptr + (r * N_STATES + cs)[:, None] * D + d[None, :], mask=cmask[:, None] & dmask[None, :],
                     other=0.0)
        m_new = tl.maximum(m, tl.max(mc, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_sub)  # 0 for -inf: no NaN from -inf - -inf
        w = tl.exp2(mc - m_sub)
        l = l * a + tl.sum(lc * w, 0)
        acc = acc * a + tl.sum(ac * w[:, None], 0)
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
    b, hq, t, dim = q.shape
    if g < MIN_GROUP or dim % 2 or dim < MIN_DIM:  # a tensor-core dot: 16 keys of a group, 16 channels a half
        if torch.cuda.is_current_stream_capturing():  # the reference reads positions on the host
            raise SelfspecError(f"the quantized KV attention runs in CUDA graphs for KV groups of at least {MIN_GROUP}"
                                f" and even head dims of at least {MIN_DIM} (got group {g}, head dim {dim}): use a "
                                f"larger --kv-group, or kv format bf16")
        return reference_quantized_attention(q.float(), kv, q_pos, upper).to(q.dtype)
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
        t, hq, hkv, qbs, quant.table.shape[1], kv.k.shape[2], n_chunks, n_slices, dim ** -0.5,
        q.stride(0), q.stride(1), q.stride(2),
        **consts, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **({} if MAX_REGISTERS is None else {"maxnreg": MAX_REGISTERS}))
    out = torch.empty(b, t, hq, dim, dtype=torch.float32, device=q.device)
    block_d = min(MERGE_CHANNELS, next_power_of_2(dim))
    _merge_chunks[(b * t * hq, cdiv(dim, block_d))](m, l, acc, out, n_chunks + 1, dim, BLOCK_S=MERGE_STATES,
                                                    BLOCK_D=block_d)
    return out.transpose(1, 2).to(q.dtype)


register("quantized_attention", "", "cuda")(quantized_attention)
