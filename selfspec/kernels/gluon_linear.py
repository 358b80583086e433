"""GEMMs for many tokens on Hopper, warp-specialized (Gluon): a loader warp keeps TMA copies in flight while two
consumer warpgroups run wgmma. The nibble formats' (w4a16, `upper`, `full` with bf16 activations) dequantize
their weight tiles in the consumers' registers; INT8 codes with bf16 activations (w8a16) take the same kernel, read
as 32-bit words of four codes (k = 4j .. 4j + 3, the quarters' order), the channel scale at the end, as
_linear_kernel's word tiles; the bf16 one (bf16 weights, and prompt tokens' dequantized weights)
and the int8 one (w8a8: int8 codes on both sides, their products summed exactly in int32 over K; persistent CTAs
past 512 rows) are plain GEMMs in _linear_kernel's arithmetic (at the end of the module).

For one [BLOCK_N = 128, BLOCK_M = 128] tile of y^T = W x^T (64 rows of x where the tiles are few: nibble_block_m;
the tiles walked in groups of M tiles: _grouped_tile):
- the loader warp copies each K tile's x (as four quarter tiles, below), the planes' 16-bit words and the tile's
  group scale and offset into a ring of shared memory;
- each consumer warpgroup takes 64 weight rows: it builds their bf16 weights from the words in registers (the
  codes, then the weight in one bf16 fused multiply-add per two: _nibble_chunk's `_weight`), in the layout wgmma
  takes its first operand in (no trip through shared memory), one tile ahead while the tensor cores work on the
  tile before, and chains each chunk's wgmma into one accumulator; the split's chunks are added into their sum, a
  second accumulator.

The same bits as the decode tiles: _nibble_kernel reads a word's four codes (as weights) as four dots, over
the columns k = 4j + t of x for t = 0..3, K tile by K tile, chunk by chunk. Here x comes with each K tile's columns
already in that order (`quartered`: column t * BLOCK_K / 4 + j of a tile holds its column 4j + t; a prompt's norms
and swiglu write it so as they write it, `ops.quarters_input`), so the quarters are four TMA boxes and the four dots
the same wgmma instructions in the same order; each output's products and adds are the decode tiles' (the GPU tests
compare every row's bits). The K tile, the chunks of the decode config's split and the order of every add are the
decode config's; only the tiles differ.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from selfspec.kernels import ptx
from selfspec.kernels.launch import INTERPRETING, SHARED_MEMORY, cdiv, launch_options, wait
from selfspec.kernels.linear_tiles import FULL, INT4, INT4G, INT8, UPPER
from selfspec.kernels.ops import ROW_SUM_COLS
from selfspec.kernels.triton_small import sum_chunks

BLOCK_N = 128  # weight rows per CTA: two consumer warpgroups of WARPGROUP_ROWS
BLOCK_M = 128  # rows of x per CTA
NARROW = gl.constexpr(32)  # the fewest columns of x a CTA's product takes (M's last tile: 32, 64 or BLOCK_M)
WARPGROUP_ROWS = gl.constexpr(64)
LOADER_REGISTERS = gl.constexpr(24)
CONSUMER_REGISTERS = gl.constexpr(240)  # the second consumer warpgroup's; the first (default) gets what is left
_WORD_NIBBLES = gl.constexpr(ptx.WORD_NIBBLES)
_PLANE_WORDS = gl.constexpr(ptx.PLANE_WORDS)
_INT8_WORDS = gl.constexpr(ptx.INT8_WORDS)
_AFFINE = gl.constexpr(ptx.AFFINE)
_WORD_INT8 = gl.constexpr(ptx.WORD_INT8)
_WORD_INT8_SCALED = gl.constexpr(ptx.WORD_INT8_SCALED)


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """A ring's barriers: `ready` (a slot's TMA copies have landed) and `free` (both consumer warpgroups have read
    it)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=2)
    return ready, free


@gluon.jit
def _loader(x_desc, w_desc, w2_desc, scale_desc, lo_desc, sums_desc, x_bufs, w_bufs, w2_bufs, affine_bufs, sums_bufs,
            ready, free, m0, n0, k_begin, k_end, FMT: gl.constexpr, GROUP: gl.constexpr, BLOCK_K: gl.constexpr,
            SUMS: gl.constexpr):
    """One warp: each K tile's x quarters, words and group affine (scale, lo) into the ring, as its slots come free,
    for the K tiles from k_begin to k_end (INT8 codes: the quarters and the words alone); with SUMS, also x's sums
    over the tile, a row of BLOCK_M tokens (int8 activations: sums_desc over [K tiles, M])."""
    stages: gl.constexpr = ready.type.shape[0]
    q: gl.constexpr = BLOCK_K // 4
    planes: gl.constexpr = 2 if FMT == FULL else 1
    if FMT == INT8:
        nbytes: gl.constexpr = 4 * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = (4 * x_desc.block_type.nbytes + planes * w_desc.block_type.nbytes
                                + 2 * scale_desc.block_type.nbytes + SUMS * sums_desc.block_type.nbytes)
    first = k_begin // BLOCK_K
    for j in range(gl.cdiv(k_end - k_begin, BLOCK_K)):
        i = first + j
        slot = j % stages
        mbarrier.wait(free.index(slot), ((j // stages) & 1) ^ 1)  # a new barrier reads as freed once
        bar = ready.index(slot)
        mbarrier.expect(bar, nbytes)
        for t in gl.static_range(4):
            tma.async_copy_global_to_shared(x_desc, [m0, i * BLOCK_K + t * q], bar, x_bufs.index(4 * slot + t))
        tma.async_copy_global_to_shared(w_desc, [n0, i * q], bar, w_bufs.index(slot))
        if FMT == FULL:
            tma.async_copy_global_to_shared(w2_desc, [n0, i * q], bar, w2_bufs.index(slot))
        if FMT != INT8:
            tma.async_copy_global_to_shared(scale_desc, [i * BLOCK_K // GROUP, n0], bar, affine_bufs.index(2 * slot))
            tma.async_copy_global_to_shared(lo_desc, [i * BLOCK_K // GROUP, n0], bar,
                                            affine_bufs.index(2 * slot + 1))
        if SUMS:
            tma.async_copy_global_to_shared(sums_desc, [i, m0], bar, sums_bufs.index(slot))


@gluon.jit
def _tile_weights(w_bufs, w2_bufs, affine_bufs, slot, row0, layout: gl.constexpr, FMT: gl.constexpr):
    """The bf16 weights at k = 4j + t (t = 0..3) of the warpgroup's rows of ring slot `slot`, in the register layout
    of wgmma's first operand: INT8 codes as they are (the channel scale comes at the end), the nibble formats'
    codes dequantized with the tile's group scale and offset (triton_linear._weight)."""
    rows: gl.constexpr = WARPGROUP_ROWS
    w = w_bufs.index(slot).slice(row0, rows).load(layout)
    if FMT == INT8:  # 32-bit words of four codes
        weights = gl.inline_asm_elementwise(_INT8_WORDS, "=r,=r,=r,=r,r,r", [w],
                                            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True,
                                            pack=2)
    else:
        if FMT == FULL:
            w2 = w2_bufs.index(slot).slice(row0, rows).load(layout)
            codes = gl.inline_asm_elementwise(_PLANE_WORDS, "=r,=r,=r,=r,r,r", [w, w2],
                                              dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                              is_pure=True, pack=2)
        else:
            codes = gl.inline_asm_elementwise(_WORD_NIBBLES, "=r,=r,=r,=r,r", [w],
                                              dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                              is_pure=True, pack=2)
        s = _row(affine_bufs.index(2 * slot), row0, rows, gl.SliceLayout(1, layout))
        lo = _row(affine_bufs.index(2 * slot + 1), row0, rows, gl.SliceLayout(1, layout))
        if FMT == INT4G:  # the group's integers (float32 bits): 16 c - (16 + z) = q - z, times s2 (_code_weight)
            g = lo.to(gl.int32, bitcast=True)
            s = (g & 255).to(gl.float32)
            lo = ((g >> 8) & 255).to(gl.float32) / s
            sixteen = gl.expand_dims(gl.full(lo.shape, 16, gl.bfloat16, lo.type.layout), 1)
            codes = _affine(codes, sixteen, gl.expand_dims((-16 - lo).to(gl.bfloat16), 1))
            lo = s * 0
        if FMT == UPPER:  # triton_linear._group_affine
            lo = (lo + s * 7.5).to(gl.bfloat16).to(gl.float32)
            lo = (lo - s * 256).to(gl.bfloat16).to(gl.float32) + s * 256
            s = s * 16
        if FMT == FULL:  # the codes are q8 - 128: the offset is the weight of code 128 (triton_linear._nibble_chunk)
            lo = lo + s * 128
        elif FMT != INT4G:  # the codes are 1 + q / 16: 16 s times them, plus lo - 16 s
            lo = lo - s * 16
            s = s * 16
        weights = _affine(codes, gl.expand_dims(s.to(gl.bfloat16), 1), gl.expand_dims(lo.to(gl.bfloat16), 1))
    return weights


@gluon.jit
def _affine(codes, s, lo):
    """s c + lo for each of a tile's four bf16 code quarters c, one bf16 fused multiply-add each (ptx.AFFINE)."""
    c0, c1, c2, c3 = codes
    return (gl.inline_asm_elementwise(_AFFINE, "=r,r,r,r", [c0, s, lo], dtype=gl.bfloat16, is_pure=True, pack=2),
            gl.inline_asm_elementwise(_AFFINE, "=r,r,r,r", [c1, s, lo], dtype=gl.bfloat16, is_pure=True, pack=2),
            gl.inline_asm_elementwise(_AFFINE, "=r,r,r,r", [c2, s, lo], dtype=gl.bfloat16, is_pure=True, pack=2),
            gl.inline_asm_elementwise(_AFFINE, "=r,r,r,r", [c3, s, lo], dtype=gl.bfloat16, is_pure=True, pack=2))


@gluon.jit
def _row(buf, start, length: gl.constexpr, layout: gl.constexpr):
    """Values start .. start + length of a one-row ring slot (TMA's box [1, n], unswizzled), as a vector."""
    row = buf._reinterpret(buf.dtype, [buf.type.shape[1]], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return row.slice(start, length).load(layout)


@gluon.jit
def _consumer(x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr,
              bias_ptr, res_ptr, y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm,
              FMT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, IN_PROGRAM: gl.constexpr,
              PARTIAL: gl.constexpr, NARROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
    """One warpgroup: y^T rows n0 + row0 .. + WARPGROUP_ROWS of the tile (weight rows), the BLOCK_M columns from m0;
    with NARROWS, as wide a product as the columns x has there: the last tile of M = 288 holds 32, so its wgmma take
    32 columns instead of 128 (the x tile's other rows are TMA's zeros). Each output's products and adds are the
    same at any width (tests/gpu compares the bits)."""
    live = M - m0
    if not NARROWS:
        _consume(x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr, bias_ptr,
                 res_ptr, y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm, FMT,
                 HAS_BIAS, HAS_RES, IN_PROGRAM, PARTIAL, BLOCK_M, BLOCK_K)
    elif live <= NARROW:
        _consume(x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr, bias_ptr,
                 res_ptr, y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm, FMT,
                 HAS_BIAS, HAS_RES, IN_PROGRAM, PARTIAL, NARROW, BLOCK_K)
    elif live <= 2 * NARROW:
        _consume(x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr, bias_ptr,
                 res_ptr, y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm, FMT,
                 HAS_BIAS, HAS_RES, IN_PROGRAM, PARTIAL, 2 * NARROW, BLOCK_K)
    else:
        _consume(x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr, bias_ptr,
                 res_ptr, y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm, FMT,
                 HAS_BIAS, HAS_RES, IN_PROGRAM, PARTIAL, BLOCK_M, BLOCK_K)


@gluon.jit
def _consume(x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr,
             bias_ptr, res_ptr, y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm,
             FMT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, IN_PROGRAM: gl.constexpr,
             PARTIAL: gl.constexpr, WIDTH: gl.constexpr, BLOCK_K: gl.constexpr):
    """_consumer's product, WIDTH columns from m0, over the CHUNKS chunks of K from k_begin (to k_end); with
    PARTIAL, the fp32 sum of that one chunk, stored as is. While a tile's wgmma runs, the next tile's weights are
    built (one tile ahead)."""
    stages: gl.constexpr = ready.type.shape[0]
    rows: gl.constexpr = WARPGROUP_ROWS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, WIDTH, 16])
    weights_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    total = gl.zeros((rows, WIDTH), gl.float32, acc_layout)  # the chunks' sum (IN_PROGRAM)
    tiles = gl.cdiv(k_end - k_begin, BLOCK_K)
    me = row0 // WARPGROUP_ROWS  # which of the two consumer warpgroups (its turn barrier)
    mbarrier.wait(ready.index(0), 0)
    weights = _tile_weights(w_bufs, w2_bufs, affine_bufs, 0, row0, weights_layout, FMT)
    i = 0
    acc = gl.zeros((rows, WIDTH), gl.float32, acc_layout)  # defined past the loop (one chunk: the total)
    for c in range(0, CHUNKS):
        acc = gl.zeros((rows, WIDTH), gl.float32, acc_layout)
        for k0 in range(k_begin + c * K_CHUNK, gl.minimum(k_end, k_begin + (c + 1) * K_CHUNK), BLOCK_K):
            slot = i % stages
            # The two warpgroups issue their K tiles' wgmma in turn, so that one's group runs while the other waits
            # for its own and turns round (not both groups interleaved, both then idle at once).
            mbarrier.wait(turns.index(me), (i & 1) ^ (1 - me))
            for t in gl.static_range(4):  # one product per chunk, as the decode tiles' dots
                acc = warpgroup_mma(weights[t], x_bufs.index(4 * slot + t).slice(0, WIDTH).permute((1, 0)), acc,
                                    is_async=True)
            mbarrier.arrive(turns.index(1 - me))
            # While the tensor cores work: the next tile's weights.
            if i + 1 < tiles:
                mbarrier.wait(ready.index((i + 1) % stages), ((i + 1) // stages) & 1)
                following = _tile_weights(w_bufs, w2_bufs, affine_bufs, (i + 1) % stages, row0, weights_layout, FMT)
            else:
                following = weights
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(free.index(slot))
            weights = following
            i += 1
        if IN_PROGRAM:
            total = total + acc
    if not IN_PROGRAM:
        total = acc
    offs_n = n0 + row0 + gl.arange(0, rows, layout=gl.SliceLayout(1, acc_layout))
    offs_m = m0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, acc_layout))
    n_mask = offs_n < N
    if PARTIAL:  # this chunk's sum, for sum_chunks to add in order
        gl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], total,
                 mask=n_mask[:, None] & (offs_m < M)[None, :])
    else:
        if FMT == INT8 or FMT == INT4G:  # the channel scale, after the sum (triton_linear._epilogue)
            total = total * gl.load(scale_ptr + offs_n, mask=n_mask, other=0)[:, None]
        _store_transposed(total, offs_n, n_mask, bias_ptr, res_ptr, y_ptr, n0 + row0, m0, M, N, stride_ym, stride_rm,
                          HAS_BIAS, HAS_RES, rows, WIDTH)


@gluon.jit
def _store_transposed(total, offs_n, n_mask, bias_ptr, res_ptr, y_ptr, n_first, m0, M, N, stride_ym, stride_rm,
                      HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, ROWS: gl.constexpr, WIDTH: gl.constexpr):
    """_store's steps for y^T's tile (ROWS weight rows from n_first, WIDTH tokens from m0; offs_n, n_mask: its rows
    in the accumulator's layout): bias, bf16, the residual added to the bf16 product and rounded again. y's rows
    are the accumulator's columns: 8 weights a thread, in a row of y, through shared memory, so that its stores are
    16 bytes wide (the accumulator's own: 2 bytes, 8 lanes apart)."""
    if HAS_BIAS:
        total += gl.load(bias_ptr + offs_n, mask=n_mask, other=0).to(gl.float32)[:, None]
    store_layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    y = gl.convert_layout(total.to(gl.bfloat16), store_layout)
    offs_n = n_first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
    offs_m = m0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, store_layout))
    y_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if HAS_RES:
        r = gl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=y_mask, other=0)
        y = (y.to(gl.float32) + r.to(gl.float32)).to(gl.bfloat16)
    gl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y, mask=y_mask)


TILE_GROUP = gl.constexpr(8)  # M tiles a run of CTAs walks before it moves to the next N tile (_grouped_tile)


@gluon.jit
def _grouped_tile(r, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(m0, n0) of output tile r: M tiles in groups of TILE_GROUP, M fastest within a group, the group's N tiles
    one after the other, so that the CTAs sharing one N tile of W run together and hit it in L2, and a wave of them
    reads a few M tiles of x, not all of it (up to TILE_GROUP M tiles: M fastest, plainly)."""
    m_tiles = gl.cdiv(M, BLOCK_M)
    per_group = TILE_GROUP * gl.cdiv(N, BLOCK_N)
    first = r // per_group * TILE_GROUP
    rows = gl.minimum(m_tiles - first, TILE_GROUP)
    within = r % per_group
    return (first + within % rows) * BLOCK_M, within // rows * BLOCK_N


@gluon.jit(do_not_specialize=["M"])  # one binary for every M
def _nibble_ws_kernel(x_desc, w_desc, w2_desc, scale_desc, lo_desc, scale_ptr, bias_ptr, res_ptr, y_ptr,
                      M, N, K, K_CHUNK, CHUNKS, stride_ym, stride_rm,
                      FMT: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                      IN_PROGRAM: gl.constexpr, PARTIAL: gl.constexpr, NARROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    m0, n0 = _grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    k_begin = gl.program_id(2) * CHUNKS * K_CHUNK  # with PARTIAL, chunk program_id(2); else all of K
    k_end = gl.minimum(K, k_begin + CHUNKS * K_CHUNK)
    if PARTIAL:
        y_ptr += gl.program_id(2) * M * stride_ym
    q: gl.constexpr = BLOCK_K // 4
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, BLOCK_M, q], x_desc.layout)
    if FMT == INT8:  # 32-bit words of four codes; no group affine (the channel scale comes at the end)
        w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, q], w_desc.layout)
        affine_bufs = x_bufs
    else:
        w_bufs = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, q], w_desc.layout)
        affine_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, BLOCK_N], scale_desc.layout)
    if FMT == FULL:
        w2_bufs = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, q], w2_desc.layout)
    else:
        w2_bufs = w_bufs
    ready, free = _ring_barriers(STAGES)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # _consume's wgmma turns
    for r in gl.static_range(2):
        mbarrier.init(turns.index(r), count=1)
    # The partitions' arguments are written out here: a tuple kept in a variable loses its constexprs.
    gl.warp_specialize([
        (_consumer, (x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr,
                     bias_ptr, res_ptr, y_ptr, 0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym,
                     stride_rm, FMT, HAS_BIAS, HAS_RES, IN_PROGRAM, PARTIAL, NARROWS, BLOCK_M, BLOCK_K)),
        (_consumer, (x_bufs, w_bufs, w2_bufs, affine_bufs, ready, free, turns, scale_ptr,
                     bias_ptr, res_ptr, y_ptr, WARPGROUP_ROWS, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS,
                     stride_ym, stride_rm, FMT, HAS_BIAS, HAS_RES, IN_PROGRAM, PARTIAL, NARROWS, BLOCK_M,
                     BLOCK_K)),
        (_loader, (x_desc, w_desc, w2_desc, scale_desc, lo_desc, x_desc, x_bufs, w_bufs, w2_bufs, affine_bufs, x_bufs,
                   ready, free, m0, n0, k_begin, k_end, FMT, GROUP, BLOCK_K, False)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


@gluon.jit
def _act_consume(x_bufs, w_bufs, affine_bufs, sums_bufs, total_bufs, ready, free, turns, xs_ptr, bias_ptr, res_ptr,
                 y_ptr, row0, m0, n0, M, N, k_begin, k_end, K_CHUNK, CHUNKS, stride_ym, stride_rm,
                 HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, IN_PROGRAM: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_K: gl.constexpr):
    """One consumer warpgroup of _nibble_act_ws_kernel: INT4 codes with int8 activations in the decode tiles'
    arithmetic (triton_linear._nibble_chunk with ACT): per K tile (one quant group) the exact int32 dot of the codes
    0..15 with x's int8 codes, on the int8 tensor cores (four wgmma, one a quarter, into a zero accumulator), then
    the group's affine in fp32, total += s * dot + lo * sum(x), x's sums over the tile brought by the loader (the
    integer sum of the decode tiles' pieces: the same value); the chunks added in order; x's row scale, bias and
    residual at the end."""
    stages: gl.constexpr = ready.type.shape[0]
    rows: gl.constexpr = WARPGROUP_ROWS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 32])
    codes_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    tokens_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    weight_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=tokens_layout)
    m_mask = offs_m < M
    me = row0 // WARPGROUP_ROWS
    # The chunks' running total waits in shared memory, each thread's own elements (registers hold the int32 dot
    # and the chunk's sum alone: at 128 tokens a third accumulator spilled).
    total_buf = total_bufs.index(me)
    if IN_PROGRAM:
        total_buf.store(gl.zeros((rows, BLOCK_M), gl.float32, acc_layout))
    chunk = gl.zeros((rows, BLOCK_M), gl.float32, acc_layout)  # defined past the loop (one chunk: the total)
    i = 0
    for c in range(0, CHUNKS):
        chunk = gl.zeros((rows, BLOCK_M), gl.float32, acc_layout)
        for k0 in range(k_begin + c * K_CHUNK, gl.minimum(k_end, k_begin + (c + 1) * K_CHUNK), BLOCK_K):
            slot = i % stages
            mbarrier.wait(ready.index(slot), (i // stages) & 1)
            words = w_bufs.index(slot).slice(row0, rows).load(codes_layout)
            codes = gl.inline_asm_elementwise(_WORD_INT8, "=r,=r,=r,=r,r,r", [words],
                                              dtype=(gl.int8, gl.int8, gl.int8, gl.int8), is_pure=True, pack=4)
            mbarrier.wait(turns.index(me), (i & 1) ^ (1 - me))  # the two warpgroups' wgmma in turn (_consume)
            dot = gl.zeros((rows, BLOCK_M), gl.int32, acc_layout)
            for t in gl.static_range(4):
                dot = warpgroup_mma(codes[t], x_bufs.index(4 * slot + t).permute((1, 0)), dot, is_async=True)
            mbarrier.arrive(turns.index(1 - me))
            # While the tensor cores work: the tile's affine and x's sums.
            s = gl.expand_dims(_row(affine_bufs.index(2 * slot), row0, rows, weight_rows), 1)
            lo = gl.expand_dims(_row(affine_bufs.index(2 * slot + 1), row0, rows, weight_rows), 1)
            x_sum = gl.expand_dims(_row(sums_bufs.index(slot), 0, BLOCK_M, tokens_layout), 0)
            dot = warpgroup_mma_wait(0, deps=(dot, ))
            mbarrier.arrive(free.index(slot))
            chunk += dot.to(gl.float32) * s + x_sum * lo
            i += 1
        if IN_PROGRAM:
            total_buf.store(total_buf.load(acc_layout) + chunk)
    if IN_PROGRAM:
        total = total_buf.load(acc_layout)
    else:
        total = chunk
    offs_n = n0 + row0 + gl.arange(0, rows, layout=weight_rows)
    n_mask = offs_n < N
    total = total * gl.expand_dims(gl.load(xs_ptr + offs_m, mask=m_mask, other=0), 0)
    _store_transposed(total, offs_n, n_mask, bias_ptr, res_ptr, y_ptr, n0 + row0, m0, M, N, stride_ym, stride_rm,
                      HAS_BIAS, HAS_RES, rows, BLOCK_M)


@gluon.jit
def _ints_consume(x_bufs, w_bufs, affine_bufs, ready, free, turns, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, row0,
                  m0, n0, M, N, k_begin, k_end, piece, stride_ym, stride_rm, HAS_BIAS: gl.constexpr,
                  HAS_RES: gl.constexpr, PARTIAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
    """One consumer warpgroup of _nibble_act_ws_kernel for INT4G (triton_linear's INT4G with int8 activations): per
    K tile from k_begin to k_end each code made s2 q - z s2 in registers (the tile's group integers from the ring),
    the int8 tensor cores' dots summed into one int32 accumulator (exact: the decode tiles' sum whatever the tiles
    and pieces), then x's row scale and the channel scale, bias and residual once, as triton_linear._epilogue; with
    PARTIAL the int32 sum of this piece of K into y_ptr's [pieces, M, N] instead (sum_chunks adds and scales them).
    BLOCK_M of 256 tokens: two accumulators of 128 (int8 wgmma takes at most 128 here), one build of the codes."""
    stages: gl.constexpr = ready.type.shape[0]
    rows: gl.constexpr = WARPGROUP_ROWS
    width: gl.constexpr = INTS_WIDTH if BLOCK_M > INTS_WIDTH else BLOCK_M
    two: gl.constexpr = BLOCK_M > INTS_WIDTH
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, width, 32])
    codes_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    me = row0 // WARPGROUP_ROWS
    dot = gl.zeros((rows, width), gl.int32, acc_layout)
    dot2 = gl.zeros((rows, width), gl.int32, acc_layout)  # the second 128 tokens (`two`)
    i = 0
    for k0 in range(k_begin, k_end, BLOCK_K):
        slot = i % stages
        mbarrier.wait(ready.index(slot), (i // stages) & 1)
        words = w_bufs.index(slot).slice(row0, rows).load(codes_layout)
        group = _row(affine_bufs.index(2 * slot + 1), row0, rows, gl.SliceLayout(1, codes_layout))
        group = gl.expand_dims(group.to(gl.int32, bitcast=True).to(gl.int16), 1)  # s2 | z s2 << 8, below 2^16
        codes = gl.inline_asm_elementwise(_WORD_INT8_SCALED, "=r,=r,=r,=r,r,r,r,r",
                                          [words, gl.broadcast(group, words)[0]],
                                          dtype=(gl.int8, gl.int8, gl.int8, gl.int8), is_pure=True, pack=4)
        mbarrier.wait(turns.index(me), (i & 1) ^ (1 - me))  # the two warpgroups' wgmma in turn (_consume)
        for t in gl.static_range(4):
            dot = warpgroup_mma(codes[t], x_bufs.index(4 * slot + t).slice(0, width).permute((1, 0)), dot,
                                is_async=True)
        if two:
            for t in gl.static_range(4):
                dot2 = warpgroup_mma(codes[t], x_bufs.index(4 * slot + t).slice(width, width).permute((1, 0)), dot2,
                                     is_async=True)
        mbarrier.arrive(turns.index(1 - me))
        if two:
            dot, dot2 = warpgroup_mma_wait(0, deps=(dot, dot2))
        else:
            dot = warpgroup_mma_wait(0, deps=(dot, ))
        mbarrier.arrive(free.index(slot))
        i += 1
    _ints_store(dot, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, n0 + row0, m0, M, N, piece, stride_ym, stride_rm,
                HAS_BIAS, HAS_RES, PARTIAL)
    if two:
        _ints_store(dot2, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, n0 + row0, m0 + width, M, N, piece, stride_ym,
                    stride_rm, HAS_BIAS, HAS_RES, PARTIAL)


INTS_WIDTH = gl.constexpr(128)  # tokens of one int32 accumulator of _ints_consume


@gluon.jit
def _ints_store(dot, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, n_first, m0, M, N, piece, stride_ym, stride_rm,
                HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, PARTIAL: gl.constexpr):
    """_ints_consume's int32 sums for weight rows n_first.. and tokens m0..: scaled and stored (or, PARTIAL, stored
    as they are for sum_chunks)."""
    layout: gl.constexpr = dot.type.layout
    rows: gl.constexpr = dot.type.shape[0]
    width: gl.constexpr = dot.type.shape[1]
    offs_m = m0 + gl.arange(0, width, layout=gl.SliceLayout(0, layout))
    offs_n = n_first + gl.arange(0, rows, layout=gl.SliceLayout(1, layout))
    n_mask = offs_n < N
    if PARTIAL:
        mask = gl.expand_dims(n_mask, 1) & gl.expand_dims(offs_m < M, 0)
        ptrs = y_ptr + piece * M * N + gl.expand_dims(offs_m, 0) * N + gl.expand_dims(offs_n, 1)
        gl.store(ptrs, dot, mask=mask)
    else:
        total = dot.to(gl.float32) * gl.expand_dims(gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0), 0)
        total = total * gl.expand_dims(gl.load(scale_ptr + offs_n, mask=n_mask, other=0), 1)
        _store_transposed(total, offs_n, n_mask, bias_ptr, res_ptr, y_ptr, n_first, m0, M, N, stride_ym, stride_rm,
                          HAS_BIAS, HAS_RES, rows, width)


@gluon.jit(do_not_specialize=["M"])
def _nibble_act_ws_kernel(x_desc, w_desc, scale_desc, lo_desc, sums_desc, xs_ptr, scale_ptr, bias_ptr, res_ptr,
                          y_ptr, M, N, K, K_CHUNK, CHUNKS, stride_ym, stride_rm,
                          GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                          IN_PROGRAM: gl.constexpr, INTS: gl.constexpr, PARTIAL: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """_nibble_ws_kernel's skeleton (the loader, the ring, the two consumer warpgroups in turn) for INT4 codes with
    int8 activations (w4a8, w4a4): x's int8 codes quartered, the plane's 16-bit words, the group affine. INTS:
    INT4G's codes (`_ints_consume`), lo_desc over its group integers (read as float32 bits), scale_ptr its channel
    scales; its CTAs the tiles times CHUNKS pieces of K_CHUNK columns (the tiles fastest), PARTIAL where there are
    several."""
    m0, n0 = _grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N)
    q: gl.constexpr = BLOCK_K // 4
    x_bufs = gl.allocate_shared_memory(gl.int8, [4 * STAGES, BLOCK_M, q], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, q], w_desc.layout)
    affine_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, BLOCK_N], scale_desc.layout)
    sums_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], sums_desc.layout)
    ready, free = _ring_barriers(STAGES)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for r in gl.static_range(2):
        mbarrier.init(turns.index(r), count=1)
    if INTS:
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        piece = gl.program_id(0) // tiles
        m0, n0 = _grouped_tile(gl.program_id(0) % tiles, M, N, BLOCK_M, BLOCK_N)
        k_begin = piece * K_CHUNK
        k_end = gl.minimum(K, k_begin + K_CHUNK)
        gl.warp_specialize([
            (_ints_consume, (x_bufs, w_bufs, affine_bufs, ready, free, turns, xs_ptr, scale_ptr, bias_ptr, res_ptr,
                             y_ptr, 0, m0, n0, M, N, k_begin, k_end, piece, stride_ym, stride_rm, HAS_BIAS, HAS_RES,
                             PARTIAL, BLOCK_M, BLOCK_K)),
            (_ints_consume, (x_bufs, w_bufs, affine_bufs, ready, free, turns, xs_ptr, scale_ptr, bias_ptr, res_ptr,
                             y_ptr, WARPGROUP_ROWS, m0, n0, M, N, k_begin, k_end, piece, stride_ym, stride_rm,
                             HAS_BIAS, HAS_RES, PARTIAL, BLOCK_M, BLOCK_K)),
            (_loader, (x_desc, w_desc, w_desc, scale_desc, lo_desc, sums_desc, x_bufs, w_bufs, w_bufs, affine_bufs,
                       sums_bufs, ready, free, m0, n0, k_begin, k_end, INT4, GROUP, BLOCK_K, False)),
        ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])
    else:
        total_bufs = gl.allocate_shared_memory(gl.float32, [2, WARPGROUP_ROWS, BLOCK_M],
                                               gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        gl.warp_specialize([
            (_act_consume, (x_bufs, w_bufs, affine_bufs, sums_bufs, total_bufs, ready, free, turns, xs_ptr, bias_ptr,
                            res_ptr, y_ptr, 0, m0, n0, M, N, 0, K, K_CHUNK, CHUNKS, stride_ym, stride_rm, HAS_BIAS,
                            HAS_RES, IN_PROGRAM, BLOCK_M, BLOCK_K)),
            (_act_consume, (x_bufs, w_bufs, affine_bufs, sums_bufs, total_bufs, ready, free, turns, xs_ptr, bias_ptr,
                            res_ptr, y_ptr, WARPGROUP_ROWS, m0, n0, M, N, 0, K, K_CHUNK, CHUNKS, stride_ym, stride_rm,
                            HAS_BIAS, HAS_RES, IN_PROGRAM, BLOCK_M, BLOCK_K)),
            (_loader, (x_desc, w_desc, w_desc, scale_desc, lo_desc, sums_desc, x_bufs, w_bufs, w_bufs, affine_bufs,
                       sums_bufs, ready, free, m0, n0, 0, K, INT4, GROUP, BLOCK_K, True)),
        ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


@triton.jit
def _quartered_kernel(x_ptr, xq_ptr, K, BLOCK_K: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr):
    """TILES K tiles of one row of x, their columns quartered (column t * BLOCK_K / 4 + j of a tile holds its
    column 4j + t)."""
    wait(PDL)
    row = tl.program_id(0)
    q: tl.constexpr = BLOCK_K // 4
    tile = tl.program_id(1) * TILES + tl.arange(0, TILES)
    live = tile < K // BLOCK_K
    k0 = (tile * BLOCK_K)[:, None, None]
    t = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, q)[None, None, :]
    v = tl.load(x_ptr + row * K + k0 + 4 * j + t, mask=live[:, None, None])
    tl.store(xq_ptr + row * K + k0 + t * q + j, v, mask=live[:, None, None])


def quartered(x2: torch.Tensor, block_k: int) -> torch.Tensor:
    """x2 [M, K] (contiguous) as the nibble kernel reads it: each K tile's columns in the order the decode tiles'
    dots take them (column t * BLOCK_K / 4 + j of a tile holds its column 4j + t)."""
    m, k = x2.shape
    xq = torch.empty_like(x2)
    per_program = 8
    _quartered_kernel[(m, cdiv(k // block_k, per_program))](x2, xq, k, BLOCK_K=block_k, TILES=per_program,
                                                             num_warps=4, **launch_options())
    return xq


def ring_stages(slot: int, most: int = 6, reserved: int = 0) -> int:
    """Ring slots of `slot` bytes that fit in shared memory beside barriers, layout scratch and `reserved` bytes."""
    return min(most, (SHARED_MEMORY - 8192 - reserved) // slot)


def nibble_stages(fmt: int, block_k: int, block_m: int = BLOCK_M) -> int:
    """The nibble kernel's ring: x quarters, the planes' words and the affine per slot (INT8 codes: x quarters and
    the words alone); at most 4."""
    if fmt == INT8.value:
        slot = block_m * block_k * 2 + BLOCK_N * block_k
    else:
        planes = 2 if fmt == FULL.value else 1
        slot = block_m * block_k * 2 + planes * BLOCK_N * block_k // 2 + 2 * BLOCK_N * 4
    return ring_stages(slot, most=4)


def descriptors(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, scale: torch.Tensor,
                lo: torch.Tensor | None, block_k: int, block_m: int = BLOCK_M) -> tuple:
    """TMA descriptors of the quartered x (boxes of one quarter tile), of the planes as 16-bit words and of the
    group scales and offsets ([N, groups] stored group-major: boxes of BLOCK_N rows of one group). INT8 codes (no
    lo): x's and the 32-bit words' alone, the words' standing in for the rest (the kernel does not read them)."""
    q = block_k // 4
    x_type = gl.int8 if x.dtype == torch.int8 else gl.bfloat16  # int8 activations' codes (nibble_act_gemm)
    x_desc = tma_descriptor(x, [block_m, q], x_type)
    if lo is None:
        w_desc = tma_descriptor(w.view(torch.int32), [BLOCK_N, q], gl.int32)
        return x_desc, w_desc, w_desc, w_desc, w_desc
    w_desc, w2_desc = (None if t is None else tma_descriptor(t.view(torch.int16), [BLOCK_N, q], gl.int16)
                       for t in (w, w2))
    scale_desc, lo_desc = (TensorDescriptor.from_tensor(t.t(), [1, BLOCK_N], ROW_LAYOUT) for t in (scale, lo))
    return x_desc, w_desc, w2_desc if w2_desc is not None else w_desc, scale_desc, lo_desc


ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # one row of fp32, as is


def tma_descriptor(t: torch.Tensor, block: list[int], dtype: gl.dtype) -> TensorDescriptor:
    """A TMA descriptor of t in boxes of `block`, in the wgmma's default shared layout for `dtype`."""
    return TensorDescriptor.from_tensor(t, block, shared_layout(tuple(block), dtype))


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: gl.dtype) -> gl.NVMMASharedLayout:
    """The default NVMMA shared layout of a `block` tile: built once, as it costs the host ~4 us a call (eager
    prompt passes issue a GEMM a projection and layer)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def covers(scale: torch.Tensor, n: int) -> bool:
    """Whether the kernel reads this weight's affine by TMA: group-major scales and offsets in rows of 16 bytes."""
    return scale.dtype == torch.float32 and scale.stride(0) == 1 and n % 4 == 0

@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the warp-specialized kernel runs on `device`: Hopper (sm_90), compiled (not under the interpreter)."""
    return device.type == "cuda" and not INTERPRETING and torch.cuda.get_device_capability(device)[0] == 9


# Registers per thread at launch: the SM's 64K over the two consumer warpgroups and the loader's (one warp, but
# registers go by warpgroup), which setmaxnreg then moves from the loader to the consumers.
MAX_REGISTERS = 65536 // (3 * 128) // 8 * 8


def nibble_gemm(x2: torch.Tensor, fmt: int, tensors: tuple, n: int, group: int, block_k: int, chunk: int,
                split_k: int, bias: torch.Tensor | None, r2: torch.Tensor | None,
                x_quartered: bool = False) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ W^T (+ bias, + r2) for a nibble format with bf16 activations (INT4G: lo its group
    integers, scale its channel scales), or for INT8 codes (as 32-bit words, lo None; K a multiple of block_k), in
    the K tile and the K split of the decode config (block_k;
    split_k chunks of `chunk` columns, linear_tiles.k_chunk): the chunks are walked in order, each from zero, and
    added in order (as the split's partial sums are). x_quartered: x2 comes quartered by block_k already."""
    m, k = x2.shape
    w, w2, scale, lo = tensors
    wide = wide_tiles(m, n, fmt, split_k, x2.device)
    block_m = 2 * BLOCK_M if wide else nibble_block_m(m, n, k, block_k, split_k, x2.device)
    affine = (lo.view(torch.float32),) * 2 if fmt == INT4G.value else (scale, lo)  # INT4G: its group integers
    descs = descriptors(x2 if x_quartered else quartered(x2, block_k), w, w2, *affine, block_k, block_m)
    channel = scale if fmt in (INT8.value, INT4G.value) else None
    grid = (cdiv(m, block_m), cdiv(n, BLOCK_N))  # the tiles; launched as one dimension of them
    flags = dict(FMT=fmt, GROUP=group, HAS_BIAS=bias is not None, HAS_RES=r2 is not None, BLOCK_M=block_m,
                 BLOCK_N=BLOCK_N, BLOCK_K=block_k, STAGES=nibble_stages(fmt, block_k, block_m), num_warps=4,
                 maxnreg=MAX_REGISTERS)
    if chunks_apart(grid, split_k, x2.device):
        live = cdiv(k, chunk)  # the split's chunks that hold columns (the decode split may run past K)
        part = torch.empty((live, m, n), dtype=torch.float32, device=x2.device)
        _nibble_ws_kernel[(grid[0] * grid[1], 1, live)](*descs, None, None, None, part, m, n, k, chunk, 1, n, 0,
                                                        IN_PROGRAM=False, PARTIAL=True, NARROWS=True,
                                                        **{**flags, "HAS_BIAS": False, "HAS_RES": False})
        return sum_chunks(part, split_k, bias, r2, channel=channel)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    _nibble_ws_kernel[(grid[0] * grid[1],)](*descs, channel, bias, r2, y, m, n, k, chunk, split_k, y.stride(0),
                                            0 if r2 is None else r2.stride(0), IN_PROGRAM=split_k > 1, PARTIAL=False,
                                            NARROWS=narrows(grid, x2.device), **flags)
    return y


def nibble_act_gemm(x2: torch.Tensor, xs: torch.Tensor, sums: torch.Tensor, tensors: tuple, n: int, group: int,
                    block_k: int, chunk: int, split_k: int, bias: torch.Tensor | None,
                    r2: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] = (x2's int8 codes [M, K] with row scales xs) @ W^T (+ bias, + r2) for INT4 codes with int8
    activations, x's sums per ROW_SUM_COLS columns handed over (`sums` [M, K / ROW_SUM_COLS]), in the decode
    config's K tile (one quant group) and K split (split_k chunks of `chunk` columns, added in order): the decode
    tiles' bits."""
    m, k = x2.shape
    w, _, scale, lo = tensors
    block_m = act_block_m(m)
    x_desc, w_desc, _, scale_desc, lo_desc = descriptors(quartered(x2, block_k), w, None, scale, lo, block_k,
                                                         block_m)
    sums_desc = TensorDescriptor.from_tensor(tile_sums(sums, block_k), [1, block_m], ROW_LAYOUT)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    _nibble_act_ws_kernel[(cdiv(m, block_m) * cdiv(n, BLOCK_N),)](
        x_desc, w_desc, scale_desc, lo_desc, sums_desc, xs, None, bias, r2, y, m, n, k, chunk, split_k, y.stride(0),
        0 if r2 is None else r2.stride(0), GROUP=group, HAS_BIAS=bias is not None, HAS_RES=r2 is not None,
        IN_PROGRAM=split_k > 1, INTS=False, PARTIAL=False, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        STAGES=nibble_act_stages(block_k, block_m), num_warps=4, maxnreg=MAX_REGISTERS)
    return y


def int_scale_gemm(x2: torch.Tensor, xs: torch.Tensor, packed: torch.Tensor, group_ints: torch.Tensor,
                   scale: torch.Tensor, n: int, group: int, block_k: int, bias: torch.Tensor | None,
                   r2: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] = (x2's int8 codes [M, K] with row scales xs) @ W^T * scale (+ bias, + r2) for INT4G (the nibbles
    `packed` [N, K / 2], their group integers [N, K / group] group-major, channel scales `scale`): its INT8 codes
    built in registers a K tile at a time, int32 sums over K (any K tile, any split: the same bits). K goes in
    `int8_pieces` CTAs of whole K tiles, their int32 sums added and scaled by sum_chunks; `ints_block_m` rows of x a
    CTA."""
    m, k = x2.shape
    block_m = ints_block_m(m, n, k, block_k, x2.device)
    grid = (cdiv(m, block_m), cdiv(n, BLOCK_N))
    tiles = grid[0] * grid[1]
    piece, live = k_pieces(k, int8_pieces(grid, k, block_k, x2.device), block_k)
    ints = group_ints.view(torch.float32)  # TMA copies the bits; the consumers read them back as integers
    x_desc, w_desc, _, scale_desc, lo_desc = descriptors(quartered(x2, block_k), packed, None, ints, ints, block_k,
                                                         block_m)
    flags = dict(GROUP=group, HAS_BIAS=bias is not None, HAS_RES=r2 is not None, IN_PROGRAM=False, INTS=True,
                 PARTIAL=live > 1, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                 STAGES=nibble_act_stages(block_k, block_m, ints=True), num_warps=4, maxnreg=MAX_REGISTERS)
    if live > 1:
        part = torch.empty((live, m, n), dtype=torch.int32, device=x2.device)
        _nibble_act_ws_kernel[(tiles * live,)](x_desc, w_desc, scale_desc, lo_desc, lo_desc, None, None, None, None,
                                               part, m, n, k, piece, live, n, 0,
                                               **{**flags, "HAS_BIAS": False, "HAS_RES": False})
        return sum_chunks(part, live, bias, r2, scales=(xs, scale))
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    _nibble_act_ws_kernel[(tiles,)](x_desc, w_desc, scale_desc, lo_desc, lo_desc, xs, scale, bias, r2, y, m, n, k, k,
                                    1, y.stride(0), 0 if r2 is None else r2.stride(0), **flags)
    return y


def tile_sums(sums: torch.Tensor, block_k: int) -> torch.Tensor:
    """x's sums over each K tile, [K tiles, M rounded up to 4] (rows of 16-byte multiples, as TMA reads them): the
    integer sum of the tile's ROW_SUM_COLS pieces, the value the decode tiles add up from them, as float32 (exact:
    a tile's sum of int8 codes is far below 2^24), the type the affine widens it to."""
    m, pieces = sums.shape
    per = block_k // ROW_SUM_COLS
    per_tile = sums.reshape(m, pieces // per, per).sum(-1, dtype=torch.int32)
    out = torch.zeros((per_tile.shape[1], cdiv(m, 4) * 4), dtype=torch.float32, device=sums.device)
    out[:, :m] = per_tile.t()
    return out


# Rows of x per CTA of _nibble_act_ws_kernel: 64, or 128 from ACT_WIDE_ROWS rows, where the grid still fills the
# SMs (a weight tile's codes then built once for 128 tokens: 418 instructions a warp a K tile against 281 for 64).
# A consumer's registers hold the int32 dot and the chunk's fp32 sum, 64 x WIDTH each, and its running total waits
# in shared memory: with the total in registers too, 128 rows spilled 296 bytes (`selfspec.bench.kernel_resources
# --warp-specialized`). The rows a CTA takes do not change a row's products or their order: the same bits.
ACT_BLOCK_M, ACT_WIDE_ROWS = 64, 1024
# INT4G's kernel (`int_scale_gemm`) takes 128 rows a CTA, not 64: its codes, built from nibbles and group integers,
# cost more a tile than INT4's, so building each for 128 tokens paid from 96 rows up (H200, 8B layers, w4a8 against
# 64 rows a CTA: qkv 1.14-1.17x cuBLAS against 1.31-1.93x at 96-256 rows, gate/up 0.80-1.02 against 1.24-1.54,
# down 0.76-0.99 against 1.00-1.39; docs/bench-h200/s28-int4g-paths-pieces.json).
# From INTS_TALL_ROWS rows 256 a CTA where each piece of K still holds INTS_TALL_TILES K tiles (pieces of fewer K
# tiles each stretch the ring's fill and drain over less work and double the pieces' sums through memory): H200, 8B
# layers at 256 rows, w4a8 time / cuBLAS 128 -> 256 rows a CTA: qkv 1.13 -> 1.09, gate/up 0.99 -> 0.83, down 0.98
# -> 0.91, o (8 K tiles a piece) 1.35 -> 1.45 (docs/bench-h200/s29-int4g-paths.log).
INTS_BLOCK_M, INTS_TALL_ROWS, INTS_TALL_TILES = 2 * ACT_BLOCK_M, 193, 16


def fills_sms(n: int, device: torch.device) -> bool:
    """Whether one band of a weight's N tiles fills the SMs."""
    return cdiv(n, BLOCK_N) >= _sm_count(device)


def ints_block_m(m: int, n: int, k: int, block_k: int, device: torch.device) -> int:
    """Rows of x per CTA of `int_scale_gemm`: INTS_BLOCK_M, or twice that (each weight tile's codes built once for
    256 tokens, two int32 accumulators of 64 x 128) where the rule above allows."""
    tall = 2 * INTS_BLOCK_M
    if m < INTS_TALL_ROWS:
        return INTS_BLOCK_M
    pieces = int8_pieces((cdiv(m, tall), cdiv(n, BLOCK_N)), k, block_k, device)
    return tall if k >= pieces * INTS_TALL_TILES * block_k else INTS_BLOCK_M


ACT_MMA_K = 32  # K columns of one int8 wgmma


def takes_act_tiles(block_k: int) -> bool:
    """Whether _nibble_act_ws_kernel takes K tiles of `block_k`: a quarter of x's int8 tile holds whole int8 wgmmas,
    so tiles of 128 (tiles of 64, from quant groups of 64 as SmolLM2's 576 columns take, fail to compile)."""
    return block_k // 4 % ACT_MMA_K == 0


def takes_act_weight(k: int, n: int, block_k: int, affine: torch.Tensor) -> bool:
    """Whether _nibble_act_ws_kernel takes a weight of N rows and K columns in K tiles of `block_k`: tiles it takes,
    K whole tiles (x is quartered by them), its group-wise values `affine` (float32, or INT4G's integers read as
    float32 bits) rows TMA reads (`covers`)."""
    return takes_act_tiles(block_k) and k % block_k == 0 and covers(affine, n)


def act_block_m(m: int) -> int:
    return 2 * ACT_BLOCK_M if m >= ACT_WIDE_ROWS else ACT_BLOCK_M


def nibble_act_stages(block_k: int, block_m: int = BLOCK_M, ints: bool = False) -> int:
    """_nibble_act_ws_kernel's ring: x's int8 quarters, the plane's words, the affine and x's tile sums per slot; at
    most 4, beside the two consumers' running totals (INT4G's: none; its epilogue's bf16 tiles on their way to y)."""
    reserved = 2 * WARPGROUP_ROWS * min(block_m, INTS_WIDTH.value) * 2 if ints else 2 * WARPGROUP_ROWS * block_m * 4
    return ring_stages(block_m * block_k + BLOCK_N * block_k // 2 + 2 * BLOCK_N * 4 + block_m * 4, most=4,
                       reserved=reserved)


def nibble_block_m(m: int, n: int, k: int, block_k: int, split_k: int, device: torch.device) -> int:
    """Rows of x per CTA of the nibble kernel: BLOCK_M, or half that where BLOCK_M-row tiles would send the split's
    chunks to CTAs of their own (`chunks_apart`: few tiles) while half-height ones fill more than half the SMs and
    no more than one wave, and K is at most HALF_HEIGHT_K_TILES K tiles: each CTA then walks all of K and no
    chunk's fp32 sums go through memory. The wgmma's width leaves each output's adds as they are. H200, 8B layers
    (docs/bench-h200/s22-ab-gemm-64-rows.json): o (32 K tiles) at 160 / 256 rows 0.72 / 0.63x the time of its
    chunks apart in w4a16, 0.84 / 0.74x in `full`, 0.77 / 0.67x in w8a16; down (112) 1.00x, 1.17-1.20x, 1.09x.
    With K as one chain (no split: prompt tokens), half-height CTAs wherever BLOCK_M-row ones fill half the SMs or
    fewer and they fill more than half and no more than one wave, whatever K: the alternative is only fewer CTAs
    walking the same K. H100, w4a16 / `upper` at 256 rows (docs/bench-h100/s31-prompt-half-height.log): o 0.84-0.85x
    the time of 128-row CTAs, down 0.83-0.91x."""
    halves = cdiv(m, BLOCK_M // 2) * cdiv(n, BLOCK_N)
    fill_one_wave = _sm_count(device) < 2 * halves <= 2 * _sm_count(device)
    few = half_wave_or_less((cdiv(m, BLOCK_M), cdiv(n, BLOCK_N)), device)  # with a split: where `chunks_apart`
    short = split_k == 1 or cdiv(k, block_k) <= HALF_HEIGHT_K_TILES
    return BLOCK_M // 2 if few and fill_one_wave and short else BLOCK_M


HALF_HEIGHT_K_TILES = 32  # nibble_block_m: the most K tiles a half-height CTA walks

# Where K is one chain (no split: one accumulator a consumer) the INT4 nibbles' kernel (w4a16, `upper`) takes
# 2 * BLOCK_M rows of x a CTA, each weight tile built once for twice the tokens, where the grid's waves of them cost
# less than those of BLOCK_M-row tiles, a wide tile taking WIDE_COST the time of two. H200, 8B layers, K as one chain
# at 1,024 / 4,096 rows (docs/bench-h200/s30-wide-tile-ceiling.log): wide / narrow 0.72-0.88x on o, gate/up and
# down, qkv 0.80-0.89x at 4,096 but 1.06-1.08x at 1,024 (192 wide tiles: two waves for 132 SMs against three of
# narrow ones), as the rule says; `full` and w8a16 0.94-1.32x (their ring two slots deep at that width). With a split
# the chunks' total takes a second accumulator, and 256 tokens of both do not fit in registers (in memory they cost
# more than they win: docs/gpu.md, session 30).
WIDE_FORMATS, WIDE_COST = (INT4.value, UPPER.value), 0.8


def wide_tiles(m: int, n: int, fmt: int, split_k: int, device: torch.device) -> bool:
    """Whether the nibble kernel takes 2 * BLOCK_M rows of x a CTA (above)."""
    if split_k > 1 or fmt not in WIDE_FORMATS:
        return False
    waves = [cdiv(cdiv(m, block_m) * cdiv(n, BLOCK_N), _sm_count(device))
             for block_m in (BLOCK_M, 2 * BLOCK_M)]
    return 2 * WIDE_COST * waves[1] < waves[0]


def narrows(grid: tuple[int, int], device: torch.device) -> bool:
    """Whether a CTA whose M tile holds few rows takes narrower wgmma: where the CTAs (one per SM: shared memory)
    are more than one wave, so that one finishing early lets a waiting one start; within one wave the full tiles
    set the time, and narrowed `full` qkv ran 1.02-1.08x slower at 130-192 rows. H100, 8B layers
    (docs/bench-h100/ab-gemm-narrow*.json): qkv 0.82-0.84x and gate/up 0.88-0.91x at 288 rows, gate/up 0.97x at
    160; with the chunks apart (always narrowed) o and down 0.93-0.98x at 130-192."""
    return grid[0] * grid[1] > _sm_count(device)


def chunks_apart(grid: tuple[int, int], split_k: int, device: torch.device) -> bool:
    """Whether a nibble GEMM's K chunks go to CTAs of their own (their fp32 sums through memory, added in order by
    sum_chunks) instead of one CTA walking them all: where its tiles would fill no more than half the SMs, so that
    the split fills them (down and o at up to 256 rows on an H100)."""
    return split_k > 1 and half_wave_or_less(grid, device)


def half_wave_or_less(grid: tuple[int, int], device: torch.device) -> bool:
    """Whether a grid of one CTA an SM fills no more than half the SMs (nibble chunks apart, bf16 64-column
    tiles)."""
    return 2 * grid[0] * grid[1] <= _sm_count(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------- bf16 weights (and prompt tokens' dequantized ones)


@gluon.jit
def _tile_of(t, M, N, K, K_PIECE, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t of a persistent GEMM: (m0, n0, its piece of K, that piece's columns k_begin .. k_end); the M x N tiles
    in _grouped_tile's order, pieces of K slowest."""
    mn_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    piece = t // mn_tiles
    k_begin = piece * K_PIECE
    m0, n0 = _grouped_tile(t % mn_tiles, M, N, BLOCK_M, BLOCK_N)
    return m0, n0, piece, k_begin, gl.minimum(K, k_begin + K_PIECE)


@gluon.jit
def _tiles_loader(x_desc, w_desc, x_bufs, w_bufs, ready, free, M, N, K, K_PIECE, tiles, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """One warp of a persistent GEMM (bf16, int8): the K tiles of x and W of this CTA's tiles, one tile after the
    other, into the ring as its slots come free (the next tile's while the consumers finish the one before), each
    K tile in as many boxes as a slot holds pieces of it (TMA boxes of a 128-byte swizzle are at most 128 bytes
    wide)."""
    stages: gl.constexpr = ready.type.shape[0]
    parts: gl.constexpr = x_bufs.type.shape[0] // stages
    width: gl.constexpr = BLOCK_K // parts
    nbytes: gl.constexpr = parts * (x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    i = 0
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        m0, n0, piece, k_begin, k_end = _tile_of(t, M, N, K, K_PIECE, BLOCK_M, BLOCK_N)
        for k0 in range(k_begin, k_end, BLOCK_K):
            slot = i % stages
            mbarrier.wait(free.index(slot), ((i // stages) & 1) ^ 1)  # a new barrier reads as freed once
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            for p in gl.static_range(parts):
                tma.async_copy_global_to_shared(x_desc, [m0, k0 + p * width], bar, x_bufs.index(slot * parts + p))
                tma.async_copy_global_to_shared(w_desc, [n0, k0 + p * width], bar, w_bufs.index(slot * parts + p))
            i += 1


@gluon.jit
def _store(total, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, stride_rm, HAS_BIAS: gl.constexpr,
           HAS_RES: gl.constexpr):
    """triton_linear._epilogue's last steps: bias, bf16, the residual added to the bf16 product and rounded again."""
    if HAS_BIAS:
        total += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0).to(gl.float32)[None, :]
    y_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y = total.to(gl.bfloat16)
    if HAS_RES:
        r = gl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=y_mask, other=0)
        y = (y.to(gl.float32) + r.to(gl.float32)).to(gl.bfloat16)
    gl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=y_mask)


@gluon.jit
def _dense_consumer(x_bufs, w_bufs, ready, free, scale_ptr, bias_ptr, res_ptr, y_ptr, row0, M, N, K, K_CHUNK, CHUNKS,
                    tiles, stride_ym, stride_rm, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr,
                    HAS_RES: gl.constexpr, IN_PROGRAM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr):
    """One warpgroup, for each of this CTA's tiles: rows m0 + row0 .. + WARPGROUP_ROWS of y, BLOCK_N columns from
    n0. Each chunk of the split in one accumulator, its K tiles in order (each tile's wgmma in flight while the next
    one's is issued), the chunks added in order: _linear_kernel's bf16 arithmetic. HAS_SCALE: w holds INT8 codes and
    the sum is multiplied by their channel scale, as the INT8 kernels do after theirs."""
    stages: gl.constexpr = ready.type.shape[0]
    rows: gl.constexpr = WARPGROUP_ROWS
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    i = 0
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        m0, n0, piece, k_begin, k_end = _tile_of(t, M, N, K, K, BLOCK_M, BLOCK_N)
        total = gl.zeros((rows, BLOCK_N), gl.float32, layout)
        for c in range(0, CHUNKS):
            acc = gl.zeros((rows, BLOCK_N), gl.float32, layout)
            start = c * K_CHUNK
            first = i  # a chunk past K (a split running past it) holds no K tile
            for k0 in range(start, gl.minimum(K, (c + 1) * K_CHUNK), BLOCK_K):
                slot = i % stages
                mbarrier.wait(ready.index(slot), (i // stages) & 1)
                acc = warpgroup_mma(x_bufs.index(slot).slice(row0, rows), w_bufs.index(slot).permute((1, 0)), acc,
                                    use_acc=k0 > start, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))  # the tile before is done: its slot goes back
                mbarrier.arrive(free.index((i + stages - 1) % stages), pred=i > first)
                i += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(free.index((i + stages - 1) % stages), pred=i > first)
            if IN_PROGRAM:
                total += acc
            else:
                total = acc
        offs_m = m0 + row0 + gl.arange(0, rows, layout=gl.SliceLayout(1, layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if HAS_SCALE:
            total = total * gl.load(scale_ptr + offs_n, mask=offs_n < N, other=0)[None, :]
        _store(total, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, stride_rm, HAS_BIAS, HAS_RES)


@gluon.jit(do_not_specialize=["M"])  # one binary for every M
def _dense_ws_kernel(x_desc, w_desc, scale_ptr, bias_ptr, res_ptr, y_ptr, M, N, K, K_CHUNK, CHUNKS, stride_ym,
                     stride_rm, HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                     IN_PROGRAM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     STAGES: gl.constexpr):
    # A CTA a tile: launched as a persistent GEMM (`int8_ctas`) it ran 0.97-1.07x its time at 160-4096 rows (H100).
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready, free = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_dense_consumer, (x_bufs, w_bufs, ready, free, scale_ptr, bias_ptr, res_ptr, y_ptr, 0, M, N, K, K_CHUNK,
                           CHUNKS, tiles, stride_ym, stride_rm, HAS_SCALE, HAS_BIAS, HAS_RES, IN_PROGRAM, BLOCK_M,
                           BLOCK_N, BLOCK_K)),
        (_dense_consumer, (x_bufs, w_bufs, ready, free, scale_ptr, bias_ptr, res_ptr, y_ptr, WARPGROUP_ROWS, M, N, K,
                           K_CHUNK, CHUNKS, tiles, stride_ym, stride_rm, HAS_SCALE, HAS_BIAS, HAS_RES, IN_PROGRAM,
                           BLOCK_M, BLOCK_N, BLOCK_K)),
        (_tiles_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, free, M, N, K, K, tiles, BLOCK_M, BLOCK_N, BLOCK_K)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def dense_block_n(split_k: int, m: int = 0, n: int = 0, device: torch.device | None = None) -> int:
    """Columns of y per CTA: 256 where K is walked whole (one accumulator a warpgroup), 128 where the split's chunks
    are summed (a second accumulator), 64 where 128 would fill no more than half the SMs and M fills whole tiles
    (twice the CTAs; the wgmma's width leaves each output's adds as they are). H100, 8B layers
    (docs/bench-h100/ab-gemm-dense-64.json): o 0.83x and down 0.88x their time at 256 rows; at 200 rows (a last M
    tile partly past M) 1.10x and 1.35x slower, so those keep 128."""
    if split_k == 1:
        return 256
    if device is not None and m % BLOCK_M == 0 and half_wave_or_less((m // BLOCK_M, cdiv(n, 128)), device):
        return 64
    return 128


def dense_stages(block_k: int, block_n: int) -> int:
    """The bf16 kernel's ring: an x tile and a W tile per slot."""
    return ring_stages((BLOCK_M + block_n) * block_k * 2)


def dense_gemm(x2: torch.Tensor, w: torch.Tensor, block_k: int, chunk: int, split_k: int, bias: torch.Tensor | None,
               r2: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ w^T (* scale, + bias, + r2) for bf16 w, in the K tile and the K split of the tile config
    (block_k; split_k chunks of `chunk` columns): _linear_kernel's bits; with `scale` [N], w's rows are INT8 codes and
    each output's sum is multiplied by its channel's scale before the bias (the INT8 kernels' epilogue)."""
    m, k = x2.shape
    n = w.shape[0]
    block_n = dense_block_n(split_k, m, n, x2.device)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    x_desc = tma_descriptor(x2, [BLOCK_M, block_k], gl.bfloat16)
    w_desc = tma_descriptor(w, [block_n, block_k], gl.bfloat16)
    _dense_ws_kernel[(cdiv(m, BLOCK_M) * cdiv(n, block_n),)](
        x_desc, w_desc, scale, bias, r2, y, m, n, k, chunk, split_k, y.stride(0), 0 if r2 is None else r2.stride(0),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, HAS_RES=r2 is not None, IN_PROGRAM=split_k > 1,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=dense_stages(block_k, block_n), num_warps=4,
        maxnreg=MAX_REGISTERS)
    return y


# ---------------------------------------------------------------- int8 codes with int8 activations (w8a8)


@gluon.jit
def _int8_consumer(x_bufs, w_bufs, ready, free, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, row0, M, N, K, K_PIECE,
                   tiles, stride_ym, stride_rm, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, PARTIAL: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """One warpgroup, for each of this CTA's tiles: rows m0 + row0 .. + WARPGROUP_ROWS of y, BLOCK_N columns from
    n0, in _linear_kernel's int8 arithmetic: the int32 sum of the int8 tensor cores' products over K, exact (each K
    tile's wgmma in flight while the next one's is issued), converted once; then the row scale, the channel scale,
    bias and residual. With PARTIAL, the int32 sum over the tile's piece of K, stored as is (sum_chunks adds the
    pieces)."""
    stages: gl.constexpr = ready.type.shape[0]
    parts: gl.constexpr = x_bufs.type.shape[0] // stages
    rows: gl.constexpr = WARPGROUP_ROWS
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    i = 0
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        m0, n0, piece, k_begin, k_end = _tile_of(t, M, N, K, K_PIECE, BLOCK_M, BLOCK_N)
        acc = gl.zeros((rows, BLOCK_N), gl.int32, layout)
        first = i
        for k0 in range(k_begin, k_end, BLOCK_K):
            slot = i % stages
            mbarrier.wait(ready.index(slot), (i // stages) & 1)
            for p in gl.static_range(parts):
                acc = warpgroup_mma(x_bufs.index(slot * parts + p).slice(row0, rows),
                                    w_bufs.index(slot * parts + p).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the K tile before is done: its slot goes back
            mbarrier.arrive(free.index((i + stages - 1) % stages), pred=i > first)
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(free.index((i + stages - 1) % stages), pred=i > first)
        offs_m = m0 + row0 + gl.arange(0, rows, layout=gl.SliceLayout(1, layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if PARTIAL:
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            gl.store(y_ptr + piece * M * stride_ym + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=mask)
        else:
            total = acc.to(gl.float32)
            total = total * gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0)[:, None]
            total = total * gl.load(scale_ptr + offs_n, mask=offs_n < N, other=0)[None, :]
            _store(total, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, stride_rm, HAS_BIAS, HAS_RES)


@gluon.jit(do_not_specialize=["M"])  # one binary for every M
def _int8_ws_kernel(x_desc, w_desc, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, M, N, K, K_PIECE, PIECES,
                    stride_ym, stride_rm, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, PARTIAL: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    # CTA c takes tiles c, c + CTAs, ... (M x N tiles, times PIECES pieces of K with PARTIAL), the ring running on
    # across them, so that a tile's first K tiles load while the tile before is finished and stored (`int8_ctas`).
    tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N) * PIECES
    parts: gl.constexpr = BLOCK_K // INT8_BOX
    x_bufs = gl.allocate_shared_memory(gl.int8, [STAGES * parts, BLOCK_M, INT8_BOX], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES * parts, BLOCK_N, INT8_BOX], w_desc.layout)
    ready, free = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_int8_consumer, (x_bufs, w_bufs, ready, free, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, 0, M, N, K,
                          K_PIECE, tiles, stride_ym, stride_rm, HAS_BIAS, HAS_RES, PARTIAL, BLOCK_M, BLOCK_N,
                          BLOCK_K)),
        (_int8_consumer, (x_bufs, w_bufs, ready, free, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, WARPGROUP_ROWS,
                          M, N, K, K_PIECE, tiles, stride_ym, stride_rm, HAS_BIAS, HAS_RES, PARTIAL, BLOCK_M,
                          BLOCK_N, BLOCK_K)),
        (_tiles_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, free, M, N, K, K_PIECE, tiles, BLOCK_M, BLOCK_N,
                         BLOCK_K)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


INT8_BOX = gl.constexpr(128)  # columns of int8 per TMA box: 128 bytes, the widest a 128-byte swizzle takes
INT8_BLOCK_N = 128
INT8_BLOCK_K = 256  # K tiles where each SM has many tiles to walk; int8_block_k
INT8_SHORT_BLOCK_K = 128  # where it has few: twice the ring slots, each freed sooner


def int8_stages(block_k: int) -> int:
    """The int8 kernel's ring: an x tile and a W tile of int8 codes per slot."""
    return ring_stages((BLOCK_M + INT8_BLOCK_N) * block_k)


def int8_gemm(xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
              r2: torch.Tensor | None, pieces: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """y [M, N] = (xq [M, K] @ q^T) * xs * scale (+ bias, + r2): int8 activation codes with their row scales, int8
    weight codes with their channel scales: _linear_kernel's bits, which its exact int32 sums give whatever the
    tiles and however K is split. K goes in `pieces` CTAs of whole K tiles (default `int8_pieces`), their int32
    sums added by sum_chunks. K tiles of `block_k` columns (default `int8_block_k`)."""
    m, k = xq.shape
    n = q.shape[0]
    box = INT8_BOX.value
    x_desc = tma_descriptor(xq, [BLOCK_M, box], gl.int8)
    w_desc = tma_descriptor(q, [INT8_BLOCK_N, box], gl.int8)
    grid = (cdiv(m, BLOCK_M), cdiv(n, INT8_BLOCK_N))
    block_k = int8_block_k(grid[0] * grid[1], xq.device) if block_k is None else block_k
    pieces = int8_pieces(grid, k, block_k, xq.device) if pieces is None else pieces
    piece, live = k_pieces(k, pieces, block_k)
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=r2 is not None, BLOCK_M=BLOCK_M, BLOCK_N=INT8_BLOCK_N,
                 BLOCK_K=block_k, STAGES=int8_stages(block_k), num_warps=4, maxnreg=MAX_REGISTERS)
    ctas = (int8_ctas(grid[0] * grid[1] * live, m, xq.device),)
    if live > 1:
        part = torch.empty((live, m, n), dtype=torch.int32, device=xq.device)
        _int8_ws_kernel[ctas](x_desc, w_desc, None, None, None, None, part, m, n, k, piece, live, n, 0, PARTIAL=True,
                              **{**flags, "HAS_BIAS": False, "HAS_RES": False})
        return sum_chunks(part, live, bias, r2, scales=(xs, scale))
    y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    _int8_ws_kernel[ctas](x_desc, w_desc, xs, scale, bias, r2, y, m, n, k, k, 1, y.stride(0),
                          0 if r2 is None else r2.stride(0), PARTIAL=False, **flags)
    return y


PERSISTENT_ROWS = 512  # int8_ctas: from this many rows, one CTA per SM


def int8_ctas(tiles: int, m: int, device: torch.device) -> int:
    """CTAs of the int8 GEMM: past PERSISTENT_ROWS rows one per SM, each walking its share of the tiles (H100, 8B
    layers, docs/bench-h100/ab-gemm-persistent.json: 0.92-0.99x the time of a CTA a tile at 1024 and 4096 rows,
    but 1.03-1.15x at 160-256); else a CTA a tile."""
    return min(tiles, _sm_count(device)) if m >= PERSISTENT_ROWS else tiles


def int8_block_k(tiles: int, device: torch.device) -> int:
    """The int8 GEMM's K tile: 128 columns (6 ring slots) where its tiles are at most 4 a SM, else 256 (3 slots).
    H100, 8B layers (docs/bench-h100/ab-gemm-int8-k128.json): 128 took 0.86-0.94x the time of 256 at 256 rows
    and 0.91-0.97x on qkv, o and down at 1024 (1.9-2.9 tiles a SM), but 1.07x on gate/up at 1024 (13.6 a SM) and
    1.02-1.08x at 4096 rows (7.8-54)."""
    return INT8_SHORT_BLOCK_K if tiles <= 4 * _sm_count(device) else INT8_BLOCK_K


def k_pieces(k: int, pieces: int, block_k: int) -> tuple[int, int]:
    """K in `pieces` pieces of whole K tiles: the columns of each, and how many hold columns."""
    piece = cdiv(cdiv(k, pieces), block_k) * block_k
    return piece, cdiv(k, piece)


def int8_pieces(grid: tuple[int, int], k: int, block_k: int, device: torch.device) -> int:
    """Pieces of K for the int8 GEMM's CTAs: where its tiles would fill no more than half the SMs, as many (a power
    of two, each at least 4 K tiles) as keep them within one wave; else 1."""
    pieces, sms = 1, _sm_count(device)
    while 2 * pieces * grid[0] * grid[1] <= sms and k >= 2 * pieces * 4 * block_k:
        pieces *= 2
    return pieces
