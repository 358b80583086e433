"""The nibble GEMM for many tokens on Hopper, warp-specialized (Gluon): codes built by some warps while others run
the tensor cores.

_nibble_kernel (kernels/triton_linear.py) builds each K tile's bf16 codes in the same warps that then run wgmma on
them, so the build and the MMA take turns. Here three partitions share a CTA through mbarrier rings in shared
memory:
- a loader warp issues the TMA copies: the x tile (as four quarter tiles, below) and the planes' 16-bit words;
- four builder warps turn the words into bf16 codes (the same PTX as _nibble_kernel) and write them to a second
  ring of shared memory;
- the consumer warpgroups (the default partition) run wgmma on x and the codes and apply each K tile's group affine
  to a fresh product, in _nibble_chunk's arithmetic:  acc += d * s + x_sum * (lo - s * offset).

The same bits as the decode tiles: _nibble_kernel reads a word's four codes as four dots, over the columns
k = 4j + t of x for t = 0..3, K tile by K tile, chunk by chunk. Here x comes in with each K tile's columns already
in that order (`quartered`: column t * BLOCK_K / 4 + j holds x's column 4j + t), so the quarters are four TMA
boxes and the four dots the same wgmma instructions in the same order. The K tile, the chunks of the decode
config's split and every add's order are the decode config's; only the M and N tiles differ, which the wgmma tiles
were measured to leave bit for bit (tests/gpu/test_gpu_kernels.py).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from selfspec.kernels import ptx
from selfspec.kernels.launch import INTERPRETING
from selfspec.kernels.triton_small import ROW_SUM_COLS

# The nibble formats, as kernels/triton_linear.py numbers them.
INT4, UPPER, FULL = gl.constexpr(2), gl.constexpr(3), gl.constexpr(4)
BLOCK_N = 128
X_STAGES = 2  # x tiles in flight (32 KB each; the words' stages: 2 of 16 KB for both planes, 4 of 8 KB for one)
CODE_STAGES = 2  # built code tiles in flight (32 KB each)
BUILDER_WARPS = gl.constexpr(4)
BUILDER_REGISTERS = gl.constexpr(40)
CONSUMER_REGISTERS = gl.constexpr(232)  # the second consumer warpgroup's; the first (default) gets the rest
WARPGROUP_ROWS = gl.constexpr(64)  # rows of x per consumer warpgroup
_WORD_NIBBLES = gl.constexpr(ptx.WORD_NIBBLES)
_PLANE_WORDS = gl.constexpr(ptx.PLANE_WORDS)


@gluon.jit
def _load_words(w_desc, w2_desc, w_bufs, w2_bufs, w_ready, i, n0, FMT: gl.constexpr, BLOCK_K: gl.constexpr):
    """TMA: the planes' words of K tile i into their ring slot."""
    planes: gl.constexpr = 2 if FMT == FULL else 1
    slot = i % w_ready.type.shape[0]
    bar = w_ready.index(slot)
    mbarrier.expect(bar, planes * w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [n0, i * (BLOCK_K // 4)], bar, w_bufs.index(slot))
    if FMT == FULL:
        tma.async_copy_global_to_shared(w2_desc, [n0, i * (BLOCK_K // 4)], bar, w2_bufs.index(slot))


@gluon.jit
def _builder(w_desc, w2_desc, w_bufs, w2_bufs, w_ready, code_bufs, affine_bufs, code_ready, code_free, scale_ptr,
             lo_ptr, n0, N, K, stride_sn, stride_sg, FMT: gl.constexpr, GROUP: gl.constexpr, BLOCK_K: gl.constexpr):
    """BUILDER_WARPS warps: each K tile's words -> the bf16 codes at k = 4j + t, one [BLOCK_N, BLOCK_K / 4] tile per
    t, in the code ring, beside the tile's group scale and offset (what multiplies x's row sums: lo - s * code
    offset); each word slot is refilled as soon as it is read. The consumer reads the affine from shared memory:
    its own per-column pointers, kept across the loop, spilled."""
    stages: gl.constexpr = w_ready.type.shape[0]
    code_stages: gl.constexpr = code_ready.type.shape[0]
    rows: gl.constexpr = 32  # a slice of rows at a time keeps few registers
    block_n: gl.constexpr = w_bufs.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
    offs_n = n0 + gl.arange(0, block_n, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    offset: gl.constexpr = -128.0 if FMT == FULL else 128.0
    tiles = gl.cdiv(K, BLOCK_K)
    for i in gl.static_range(stages):
        if i < tiles:
            _load_words(w_desc, w2_desc, w_bufs, w2_bufs, w_ready, i, n0, FMT, BLOCK_K)
    for i in range(tiles):
        slot = i % stages
        c = i % code_stages
        s, lo = _group_affine(scale_ptr, lo_ptr, offs_n, i * BLOCK_K // GROUP, N, stride_sn, stride_sg, FMT)
        mbarrier.wait(w_ready.index(slot), (i // stages) & 1)
        mbarrier.wait(code_free.index(c), ((i // code_stages) & 1) ^ 1)  # a new barrier reads as freed once
        affine_bufs.index(2 * c).store(s)
        affine_bufs.index(2 * c + 1).store(lo - s * offset)
        for r in gl.static_range(0, block_n, rows):
            w = w_bufs.index(slot).slice(r, rows).load(layout)
            if FMT == FULL:
                w2 = w2_bufs.index(slot).slice(r, rows).load(layout)
                codes = gl.inline_asm_elementwise(_PLANE_WORDS, "=r,=r,=r,=r,r,r", [w, w2],
                                                  dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                                  is_pure=True, pack=2)
            else:
                codes = gl.inline_asm_elementwise(_WORD_NIBBLES, "=r,=r,=r,=r,r", [w],
                                                  dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                                  is_pure=True, pack=2)
            for t in gl.static_range(4):
                code_bufs.index(4 * c + t).slice(r, rows).store(codes[t])
        fence_async_shared()  # the codes are written (and the words read) before the async proxy goes on
        mbarrier.arrive(code_ready.index(c))
        if i + stages < tiles:
            _load_words(w_desc, w2_desc, w_bufs, w2_bufs, w_ready, i + stages, n0, FMT, BLOCK_K)


@gluon.jit
def _load_x(x_desc, x_bufs, x_ready, i, m0, BLOCK_K: gl.constexpr):
    """TMA: the four quarter tiles of x's K tile i into their ring slot."""
    q: gl.constexpr = BLOCK_K // 4
    slot = i % x_ready.type.shape[0]
    bar = x_ready.index(slot)
    mbarrier.expect(bar, 4 * x_desc.block_type.nbytes)
    for t in gl.static_range(4):
        tma.async_copy_global_to_shared(x_desc, [m0, i * BLOCK_K + t * q], bar, x_bufs.index(4 * slot + t))


@gluon.jit
def _group_affine(scale_ptr, lo_ptr, offs_n, g, N, stride_sn, stride_sg, FMT: gl.constexpr):
    """(scale, lo) of quant group g: triton_linear._group_affine."""
    mask = offs_n < N
    s = gl.load(scale_ptr + offs_n * stride_sn + g * stride_sg, mask=mask, other=0)
    lo = gl.load(lo_ptr + offs_n * stride_sn + g * stride_sg, mask=mask, other=0)
    if FMT == UPPER:
        lo = lo + s * 7.5
        s = s * 16
    return s, lo


@gluon.jit
def _consumer(x_desc, x_bufs, code_bufs, affine_bufs, total_smem, x_ready, code_ready, code_free, sums_ptr, bias_ptr,
              res_ptr, y_ptr, m0, n0, M, N, K, K_CHUNK, CHUNKS, stride_ym, stride_rm, HAS_BIAS: gl.constexpr,
              HAS_RES: gl.constexpr, IN_PROGRAM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              ROW_SUM_COLS: gl.constexpr):
    """One warpgroup, its own WARPGROUP_ROWS rows from m0: their x tiles' TMA copies, wgmma per K tile, the group
    affine, the epilogue. Each warpgroup is a partition of its own, so one's affine runs beside the other's wgmma."""
    BLOCK_M: gl.constexpr = WARPGROUP_ROWS
    stages: gl.constexpr = x_ready.type.shape[0]
    code_stages: gl.constexpr = code_ready.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    row_mask = offs_m < M
    if IN_PROGRAM:  # the chunks' sum waits in shared memory: three accumulators in registers would spill
        total_smem.store(gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout))
    sum_ptrs = sums_ptr + offs_m * (K // ROW_SUM_COLS)
    tiles = gl.cdiv(K, BLOCK_K)
    for i in gl.static_range(stages):
        if i < tiles:
            _load_x(x_desc, x_bufs, x_ready, i, m0, BLOCK_K)
    i = 0
    for c in range(0, CHUNKS):
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        for k0 in range(c * K_CHUNK, gl.minimum(K, (c + 1) * K_CHUNK), BLOCK_K):
            slot = i % stages
            cs = i % code_stages
            mbarrier.wait(x_ready.index(slot), (i // stages) & 1)
            mbarrier.wait(code_ready.index(cs), (i // code_stages) & 1)
            d = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
            for t in gl.static_range(4):
                d = warpgroup_mma(x_bufs.index(4 * slot + t), code_bufs.index(4 * cs + t).permute((1, 0)), d,
                                  use_acc=t > 0, is_async=True)
            # The tile's affine and row sums load while the tensor cores work.
            s = affine_bufs.index(2 * cs).load(gl.SliceLayout(0, acc_layout))
            off = affine_bufs.index(2 * cs + 1).load(gl.SliceLayout(0, acc_layout))
            x_sum = gl.load(sum_ptrs + k0 // ROW_SUM_COLS, mask=row_mask, other=0)
            for j in gl.static_range(1, BLOCK_K // ROW_SUM_COLS):
                x_sum += gl.load(sum_ptrs + k0 // ROW_SUM_COLS + j, mask=row_mask, other=0)
            d = warpgroup_mma_wait(0, deps=(d, ))
            mbarrier.arrive(code_free.index(cs))
            if i + stages < tiles:  # the slot's x is read: refill it
                _load_x(x_desc, x_bufs, x_ready, i + stages, m0, BLOCK_K)
            acc += d * s[None, :] + x_sum[:, None] * off[None, :]
            i += 1
        if IN_PROGRAM:
            total_smem.store(total_smem.load(acc_layout) + acc)
    if IN_PROGRAM:
        total = total_smem.load(acc_layout)
    else:
        total = acc
    if HAS_BIAS:
        total += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0).to(gl.float32)[None, :]
    y_mask = row_mask[:, None] & (offs_n < N)[None, :]
    y = total.to(gl.bfloat16)
    if HAS_RES:
        r = gl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=y_mask, other=0)
        y = (y.to(gl.float32) + r.to(gl.float32)).to(gl.bfloat16)
    gl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=y_mask)


@gluon.jit
def _nibble_ws_kernel(x_desc, w_desc, w2_desc, sums_ptr, scale_ptr, lo_ptr, bias_ptr, res_ptr, y_ptr,
                      M, N, K, K_CHUNK, CHUNKS, stride_sn, stride_sg, stride_ym, stride_rm,
                      FMT: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                      IN_PROGRAM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, ROW_SUM_COLS: gl.constexpr, X_STAGES: gl.constexpr,
                      W_STAGES: gl.constexpr, CODE_STAGES: gl.constexpr):
    """BLOCK_M = 64 or 128 rows: one or two consumer warpgroups (the default partition, and a worker for the second)
    and the builder warps, sharing each code tile."""
    # M tiles vary fastest, so the programs sharing one N tile of W run together and hit it in L2.
    m0 = gl.program_id(0) * BLOCK_M
    n0 = gl.program_id(1) * BLOCK_N
    q: gl.constexpr = BLOCK_K // 4
    groups: gl.constexpr = BLOCK_M // WARPGROUP_ROWS
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [4 * X_STAGES, WARPGROUP_ROWS, q], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int16, [W_STAGES, BLOCK_N, q], w_desc.layout)
    if FMT == FULL:
        w2_bufs = gl.allocate_shared_memory(gl.int16, [W_STAGES, BLOCK_N, q], w2_desc.layout)
    else:
        w2_bufs = w_bufs
    code_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, q], gl.bfloat16)
    code_bufs = gl.allocate_shared_memory(gl.bfloat16, [4 * CODE_STAGES, BLOCK_N, q], code_layout)
    affine_bufs = gl.allocate_shared_memory(gl.float32, [2 * CODE_STAGES, BLOCK_N],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
    total_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WARPGROUP_ROWS, BLOCK_N], gl.float32)
    total_smem = gl.allocate_shared_memory(gl.float32, [groups, WARPGROUP_ROWS, BLOCK_N], total_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    code_ready = gl.allocate_shared_memory(gl.int64, [CODE_STAGES, 1], mbarrier.MBarrierLayout())
    code_free = gl.allocate_shared_memory(gl.int64, [CODE_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(X_STAGES):
        mbarrier.init(x_ready.index(s), count=1)
    if groups == 2:  # the second warpgroup's x ring
        x_bufs2 = gl.allocate_shared_memory(gl.bfloat16, [4 * X_STAGES, WARPGROUP_ROWS, q], x_desc.layout)
        x_ready2 = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(X_STAGES):
            mbarrier.init(x_ready2.index(s), count=1)
    for s in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(s), count=1)
    for s in gl.static_range(CODE_STAGES):
        mbarrier.init(code_ready.index(s), count=1)
        mbarrier.init(code_free.index(s), count=groups)  # every consumer warpgroup has read the tile
    # The partitions' arguments are written out in each call: a tuple kept in a variable loses its constexprs.
    if groups == 2:  # the second warpgroup: its rows, its x ring, its share of the chunks' sum
        gl.warp_specialize([
            (_consumer, (x_desc, x_bufs, code_bufs, affine_bufs, total_smem.index(0),
                         x_ready, code_ready, code_free, sums_ptr, bias_ptr, res_ptr, y_ptr, m0,
                         n0, M, N, K, K_CHUNK, CHUNKS, stride_ym, stride_rm, HAS_BIAS, HAS_RES, IN_PROGRAM, BLOCK_N,
                         BLOCK_K, ROW_SUM_COLS)),
            (_consumer, (x_desc, x_bufs2, code_bufs, affine_bufs,
                         total_smem.index(1), x_ready2, code_ready, code_free, sums_ptr,
                         bias_ptr, res_ptr, y_ptr, m0 + WARPGROUP_ROWS, n0, M, N, K, K_CHUNK, CHUNKS, stride_ym,
                         stride_rm, HAS_BIAS, HAS_RES, IN_PROGRAM, BLOCK_N, BLOCK_K, ROW_SUM_COLS)),
            (_builder, (w_desc, w2_desc, w_bufs, w2_bufs, w_ready, code_bufs, affine_bufs, code_ready, code_free,
                        scale_ptr, lo_ptr, n0, N, K, stride_sn, stride_sg, FMT, GROUP, BLOCK_K)),
        ], [4, BUILDER_WARPS], [CONSUMER_REGISTERS, BUILDER_REGISTERS])
    else:
        gl.warp_specialize([
            (_consumer, (x_desc, x_bufs, code_bufs, affine_bufs, total_smem.index(0), x_ready, code_ready, code_free,
                         sums_ptr, bias_ptr, res_ptr, y_ptr, m0, n0, M, N, K, K_CHUNK, CHUNKS, stride_ym, stride_rm,
                         HAS_BIAS, HAS_RES, IN_PROGRAM, BLOCK_N, BLOCK_K, ROW_SUM_COLS)),
            (_builder, (w_desc, w2_desc, w_bufs, w2_bufs, w_ready, code_bufs, affine_bufs, code_ready, code_free,
                        scale_ptr, lo_ptr, n0, N, K, stride_sn, stride_sg, FMT, GROUP, BLOCK_K)),
        ], [BUILDER_WARPS], [BUILDER_REGISTERS])


def quartered(x2: torch.Tensor, block_k: int) -> torch.Tensor:
    """x2 [M, K] with each K tile's columns in the order the nibble kernels' dots take them: column t * BLOCK_K / 4
    + j of a tile holds its column 4j + t."""
    m, k = x2.shape
    return x2.view(m, k // block_k, block_k // 4, 4).transpose(2, 3).reshape(m, k)


def descriptors(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, block_k: int) -> tuple:
    """TMA descriptors of the quartered x (boxes of one quarter tile) and of the planes as 16-bit words."""
    q = block_k // 4
    rows = WARPGROUP_ROWS.value
    x_desc = TensorDescriptor.from_tensor(x, [rows, q], gl.NVMMASharedLayout.get_default_for([rows, q], gl.bfloat16))
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, q], gl.int16)
    w_desc, w2_desc = (None if t is None else TensorDescriptor.from_tensor(t.view(torch.int16), [BLOCK_N, q], w_layout)
                       for t in (w, w2))
    return x_desc, w_desc, w2_desc if w2_desc is not None else w_desc


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether the warp-specialized kernel runs on `device`: Hopper (sm_90), compiled (not under the interpreter)."""
    return device.type == "cuda" and not INTERPRETING and torch.cuda.get_device_capability(device)[0] == 9


def max_registers(block_m: int) -> int:
    """Registers per thread at launch: all the CTA's warps (consumers and builders) share the SM's 64K, which
    setmaxnreg then moves from the builders to the consumers."""
    threads = 32 * (block_m // 16 + BUILDER_WARPS.value)  # 4 warps per consumer warpgroup
    return 65536 // threads // 8 * 8


def nibble_gemm(x2: torch.Tensor, sums: torch.Tensor, fmt: int, tensors: tuple, n: int, group: int, block_k: int,
                split_k: int, bias: torch.Tensor | None, r2: torch.Tensor | None, block_m: int = 128) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ W^T (+ bias, + r2) for a nibble format with bf16 activations and their row sums per
    ROW_SUM_COLS columns, in the K tile and the K split of the decode config (block_k, split_k): the split's chunks
    are walked in order, each from zero, and added in order (as the split's partial sums are)."""
    m, k = x2.shape
    w, w2, scale, lo = tensors
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    x_desc, w_desc, w2_desc = descriptors(quartered(x2, block_k), w, w2, block_k)
    chunk = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k  # triton_linear.k_chunk
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _nibble_ws_kernel[grid](
        x_desc, w_desc, w2_desc, sums, scale, lo, bias, r2, y, m, n, k, chunk, split_k, *lo.stride(), y.stride(0),
        0 if r2 is None else r2.stride(0), FMT=fmt, GROUP=group, HAS_BIAS=bias is not None, HAS_RES=r2 is not None,
        IN_PROGRAM=split_k > 1, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, ROW_SUM_COLS=ROW_SUM_COLS.value,
        X_STAGES=X_STAGES, W_STAGES=2 if fmt == FULL.value else 4, CODE_STAGES=CODE_STAGES,
        num_warps=4, maxnreg=max_registers(block_m))
    return y
