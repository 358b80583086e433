"""Triton GEMM y = x @ W^T (+ bias) read straight from every stored weight format.

_linear_kernel, specialised at compile time by how it reads W (FMT) and whether activations are quantized (ACT):
- weight-only modes (bf16, w8a16) dequantize the weight tile in registers and run a bf16 tl.dot with fp32
  accumulation;
- activation-quantized modes on INT8 and both planes quantize x per token (`act_quant`: int8 codes and a row
  scale, or the same codes from the norm or swiglu that wrote x: kernels/ops.py `Handover`) and run int8 tl.dots
  with int32 accumulation. INT8 codes (per-channel scales) sum them in int32 over all of K, exactly, and convert
  once (y = sx * s * dot(xq, q)): any tiles, K split or instruction give every bit. Grouped codes (both planes)
  apply the group's affine per K tile:
      y = sx * sum_tiles(s * dot(xq, q - shift) + (lo + shift * s) * sum(xq))
  where unsigned weight codes are shifted into the signed int8 range and the shift is folded into the offset.
_nibble_kernel covers the nibble formats (w4a16, upper, full; w4a8 and w4a4 with the same act_quant). With bf16
activations it reads the planes as 16-bit words, builds the bf16 codes in one asm block (in mma.sync's natural k
order: from 8-bit values Triton builds dot operands in another order, kWidth 4, which rounds a dot's sums otherwise
than wgmma does) and makes each weight lo + s * q with a bf16 fused multiply-add, exactly the weight the reference
dequantizes (quant/formats.fma_grid), then runs bf16 dots as the bf16 GEMM does. With int8
activations it feeds the int8 tensor cores the codes and applies each group's affine after the dot.
Both kernels read their weight tiles by TMA (tensor descriptors, zeros past the edges): Hopper's copy engine keeps
more bytes in flight per SM than per-thread loads do.

Batch invariance (a row's output never depends on M): what orders a row's adds (BLOCK_K, the number of K splits, the
swap) is a function of (format, mode, N, K) only, and the tiles that may follow M keep every row's bits
(kernels/linear_tiles.py picks both); each program walks its K range in order, and the SPLIT_K partial sums of a
tile are added in split order by whichever of its programs finishes last (kernels/semaphores.py; the sum never
depends on who adds it). Splitting K is what lets a decode GEMM (M = 1..64) put enough programs on the GPU to stream
the weight at memory speed; adding the partials in the GEMM itself saves a second launch per linear. Past 16 rows
one program may walk all K chunks of the split in turn (IN_PROGRAM), each from zero, adding them in split order as
the partials are: the same sum without the partials' trip through memory.

The epilogue can add a residual (y = x @ W^T + r, rounded as the bf16 product and then the bf16 sum would be),
which saves the separate add after each block's output projection.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from selfspec.kernels import gluon_linear, ptx, register
from selfspec.kernels.launch import INTERPRETING, cdiv, launch_options, next_power_of_2, wait
from selfspec.kernels.linear_tiles import (DENSE, FULL, INT4, INT4G, INT8, UPPER, TileConfig, decode_config, k_chunk,
                                           many_tokens, reads_words, takes_row_sums, tile_config, uses_nibble_kernel,
                                           x_by_tma)
from selfspec.kernels.reference import linear as reference_linear
from selfspec.kernels.reference import rotate as reference_rotate
from selfspec.kernels.semaphores import group_counts, last_to_arrive
from selfspec.kernels.ops import Handover
from selfspec.kernels.triton_small import ROW_SUM_COLS, qmax, row_warps, store_row_codes
from selfspec.quant.formats import STORAGES, DenseWeight, QuantWeight
from selfspec.quant.modes import MODES, Mode


INT8_ACT_MAX_K = 1 << 16  # int8 dots summed in int32 over all of K: |sum| <= 128 * 128 * K stays below 2^31


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, sums_ptr, K, stride_xm, QMAX: tl.constexpr, BLOCK: tl.constexpr,
                      SUMS: tl.constexpr, PDL: tl.constexpr):
    """One row, read once and held whole: scale = max|x| / QMAX, q = round(x / scale) (quant/act.py, exactly), with
    SUMS the codes' sums per ROW_SUM_COLS columns too (store_row_codes, as the norms hand them over)."""
    wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0)
    store_row_codes(x, q_ptr, s_ptr, sums_ptr, row, K, offs, mask, QMAX, SUMS)


# At most 8 warps a row: K = 4,096 at 256-4,096 rows took 2.8 / 18.2 us against 16 warps' 2.9 / 22.4 (2.8 TB/s),
# 1.7 against 1.5 us at one row (H200, docs/bench-h200/s29-act-quant-warps.log).
ACT_QUANT_WARPS = 8


def act_quant(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale float32 [M, 1]): quant.act.quantize_per_token on the GPU."""
    return _act_quant(x, bits, sums=False)[:2]


def _act_quant(x: torch.Tensor, bits: int, sums: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """act_quant, and with `sums` the codes' row sums per ROW_SUM_COLS columns [M, K / ROW_SUM_COLS] (None where K
    is not a multiple of that)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = next_power_of_2(k)
    row_sums = None
    if sums and k % ROW_SUM_COLS.value == 0 and block >= ROW_SUM_COLS.value:
        row_sums = torch.empty((m, k // ROW_SUM_COLS.value), dtype=torch.float32, device=x.device)
    _act_quant_kernel[(m,)](x, q, scale, row_sums, k, x.stride(0), QMAX=qmax(bits), BLOCK=block,
                            SUMS=row_sums is not None, num_warps=min(row_warps(block), ACT_QUANT_WARPS),
                            **launch_options())
    return q, scale, row_sums


@triton.jit
def _load_weight(w_desc, w2_desc, n0, k0, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of W at row n0, column k0, by TMA (zeros past the edges): stored floats, int8
    codes, or unsigned codes unpacked from nibbles in registers (each stored byte is loaded once)."""
    if FMT == DENSE or FMT == INT8:
        q = w_desc.load([n0, k0])
    else:
        b = w_desc.load([n0, k0 // 2])  # byte b holds k = 2b (low nibble) and 2b + 1 (high)
        q = tl.interleave(b & 15, b >> 4)
        if FMT == FULL:  # the lower plane has the upper plane's layout
            b = w2_desc.load([n0, k0 // 2])
            q = (q << 4) | tl.interleave(b & 15, b >> 4)
    return q


_NIBBLES_I8_SCALED_ASM = tl.constexpr(ptx.NIBBLES_I8_SCALED)


@triton.jit
def _weight_codes(w_desc, w2_desc, lo_ptr, offs_n, n0, k0, N, stride_sn, stride_sg, FMT: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """_load_weight's tile, but INT4G's as its int8 codes w8 = s2 q - z s2 (quant/formats.Int4IntScaleWeight; the
    group's s2 | z s2 << 8 from lo_ptr, group-major), read by INT8's path from there on."""
    if FMT == INT4G:  # BLOCK_K divides GROUP, so the tile lies in one group
        b = w_desc.load([n0, k0 // 2])  # byte b holds k = 2b (low nibble) and 2b + 1 (high)
        g = tl.load(lo_ptr + offs_n * stride_sn + (k0 // GROUP) * stride_sg, mask=offs_n < N, other=0)
        s2, zs = (g & 255).to(tl.uint8), (g >> 8).to(tl.uint8)
        if ASM:  # four codes a register by byte arithmetic (kernels/ptx.py)
            s2, zs = tl.broadcast_to(s2[:, None], b.shape), tl.broadcast_to(zs[:, None], b.shape)
            lo, hi = tl.inline_asm_elementwise(_NIBBLES_I8_SCALED_ASM, "=r,=r,r,r,r", [b, s2, zs],
                                               dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
        else:  # the same integers, element by element
            s2, zs = s2.to(tl.int16)[:, None], zs.to(tl.int16)[:, None]
            lo = ((b & 15).to(tl.int16) * s2 - zs).to(tl.int8)
            hi = ((b >> 4).to(tl.int16) * s2 - zs).to(tl.int8)
        q = tl.interleave(lo, hi)
    else:
        q = _load_weight(w_desc, w2_desc, n0, k0, FMT, BLOCK_K)
    return q


@triton.jit
def _group_affine(scale_ptr, lo_ptr, offs_n, g, N, stride_sn, stride_sg, FMT: tl.constexpr):
    """(scale, lo) [BLOCK_N] of quant group g, for the codes _load_weight returns: w = lo + scale * q. The
    formats store them group-major (stride_sn == 1), so a tile's values are one contiguous run."""
    mask = offs_n < N
    s = tl.load(scale_ptr + offs_n * stride_sn + g * stride_sg, mask=mask, other=0)
    lo = tl.load(lo_ptr + offs_n * stride_sn + g * stride_sg, mask=mask, other=0)
    if FMT == UPPER:  # quant/formats.upper_affine: scale 16 s, lo + 7.5 s rounded, its lo - 256 s a bf16 value
        lo = (lo + s * 7.5).to(tl.bfloat16).to(tl.float32)
        lo = (lo - s * 256).to(tl.bfloat16).to(tl.float32) + s * 256
        s = s * 16
    return s, lo


@triton.jit
def _signed(q, SHIFT: tl.constexpr):
    """Weight codes as int8 dot operands: unsigned codes move down by SHIFT (folded into the offset)."""
    if SHIFT != 0:
        q = (q.to(tl.int16) - SHIFT).to(tl.int8)
    return q


@triton.jit
def _epilogue(acc, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, stride_rm,
              FMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """Row (activation) scale, per-channel INT8 scale, bias; store bf16 (plus the residual, added to the bf16
    product in fp32 and rounded again: what `y + r` on bf16 tensors does). INT8 codes with int8 activations come
    as their exact int32 sums, converted here once."""
    acc = acc.to(tl.float32)
    if ACT:
        acc = acc * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0)[:, None]
    if FMT == INT8 or FMT == INT4G:
        acc = acc * tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)[None, :]
    y_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y = acc.to(tl.bfloat16)
    if HAS_RES:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=y_mask, other=0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=y_mask)


@triton.jit
def _zeros(ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr, ACT: tl.constexpr):
    """A tile's zero accumulator: int32 for INT8 codes with int8 activations, whose dots are summed exactly over all
    of K (INT8_ACT_MAX_K) and converted once, so that no K tile, split or instruction changes a bit; else fp32."""
    if ACT and (FMT == INT8 or FMT == INT4G):
        z = tl.zeros((ROWS, COLS), dtype=tl.int32)
    else:
        z = tl.zeros((ROWS, COLS), dtype=tl.float32)
    return z


@triton.jit
def _finish(acc, part_ptr, count_ptr, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N,
            stride_ym, stride_rm, FMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store the tile, or with SPLIT_K > 1 store this program's fp32 partial [SPLIT_K, M, N] and let the tile's
    last program to finish add all partials, in split order, and store the tile."""
    if SPLIT_K == 1:
        _epilogue(acc, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, stride_rm,
                  FMT, ACT, HAS_BIAS, HAS_RES)
    else:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tile_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(tile_ptrs + tl.program_id(2) * M * N, acc, mask=mask)
        if last_to_arrive(count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLIT_K):
            total = tl.zeros(acc.shape, dtype=acc.dtype)
            for s in tl.static_range(SPLIT_K):  # fixed order: the same sum whatever M is and whoever adds it
                total += tl.load(tile_ptrs + s * M * N, mask=mask, other=0, cache_modifier=".cg")
            _epilogue(total, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
                      stride_rm, FMT, ACT, HAS_BIAS, HAS_RES)


@triton.jit
def _linear_chunk(x_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, offs_m, offs_n, n0, k_start, k_end, M, N, K,
                  stride_xm, stride_sn, stride_sg, FMT: tl.constexpr, ACT: tl.constexpr, SHIFT: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """One K chunk [k_start, k_end) of a [BLOCK_M, BLOCK_N] tile, walked in order from a zero accumulator."""
    if SWAP:  # y^T = W x^T: the weight tile is the dot's left operand, fed to the tensor cores from registers
        acc = _zeros(BLOCK_N, BLOCK_M, FMT, ACT)
    else:
        acc = _zeros(BLOCK_M, BLOCK_N, FMT, ACT)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0)
        acc = _tile_dot(x, acc, w_desc, w2_desc, scale_ptr, lo_ptr, offs_n, n0, k0, N, stride_sn, stride_sg, FMT, ACT,
                        SHIFT, GROUP, BLOCK_K, SWAP, WORDS, ASM)
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _rows_by_bits(t, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """t [R, X] with its rows 8i + 4a + 2b + c taken in a new order: the rows of the permute (0, A, B, C, 4) of
    [R / 8, 2, 2, 2, X]. Tiles whose shared-memory reads would meet the same banks take their rows in an order that
    meets different ones (`kernel_resources.shared_loads` says which), the accumulator's rows or columns put back
    after:
    - w8a16's word tiles [N, 32 words] read 8 bytes a thread, a half-warp rows n .. n + 3 at 32 bytes each; under the
      128-byte swizzle rows n and n + 1 share banks (Nsight Compute on an H100: 2-way conflicts), rows n, n + 2,
      n + 4, n + 6 do not: (3, 1, 2), put back by (2, 3, 1);
    - the 64-row tiles read x's TMA box (128-byte swizzle) 16 or 8 bytes a thread, a quarter- or half-warp 64 bytes
      of rows m and m + 1, which share banks; rows m and m + 4 do not: (3, 2, 1), its own inverse."""
    return tl.reshape(tl.permute(tl.reshape(t, (t.shape[0] // 8, 2, 2, 2, t.shape[1])), (0, A, B, C, 4)), t.shape)


@triton.jit
def _tile_dot(x, acc, w_desc, w2_desc, scale_ptr, lo_ptr, offs_n, n0, k0, N, stride_sn, stride_sg,
              FMT: tl.constexpr, ACT: tl.constexpr, SHIFT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """acc + the K tile at k0 of x @ W^T (W x^T where SWAP) as read by TMA (zeros past the edges): bytes, or with
    WORDS INT8 codes as 32-bit words of four."""
    if WORDS:
        q = w_desc.load([n0, k0 // 4])
        if FMT == INT8 and not ACT and not SWAP:
            q = _rows_by_bits(q, 3, 1, 2)
    else:
        q = _weight_codes(w_desc, w2_desc, lo_ptr, offs_n, n0, k0, N, stride_sn, stride_sg, FMT, GROUP, BLOCK_K, ASM)
    if FMT >= INT4 and FMT <= FULL:  # BLOCK_K divides GROUP, so the tile lies in one group
        s, lo = _group_affine(scale_ptr, lo_ptr, offs_n, k0 // GROUP, N, stride_sn, stride_sg, FMT)
    if ACT and (FMT == INT8 or FMT == INT4G):  # exact int32 sums over all of K (`_zeros`)
        if SWAP:
            acc = tl.dot(q, tl.trans(x), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(x, tl.trans(q), acc, out_dtype=tl.int32)
    elif ACT:  # group-wise codes: exact int32 dots per K tile, then the group's affine in fp32
        if SWAP:
            d = tl.dot(_signed(q, SHIFT), tl.trans(x), out_dtype=tl.int32).to(tl.float32)
        else:
            d = tl.dot(x, tl.trans(_signed(q, SHIFT)), out_dtype=tl.int32).to(tl.float32)
        x_sum = tl.sum(x.to(tl.int32), axis=1).to(tl.float32)
        if SWAP:
            acc += d * s[:, None] + (lo + SHIFT * s)[:, None] * x_sum[None, :]
        else:
            acc += d * s[None, :] + x_sum[:, None] * (lo + SHIFT * s)[None, :]
    elif FMT == INT8 and WORDS:  # four dots over x's columns k = 4j + t, as the warp-specialized kernel takes them
        x0, x1, x2, x3 = _quarters(x)
        c0, c1, c2, c3 = _int8_word_codes(q, ASM)
        if SWAP:
            acc = tl.dot(c0, tl.trans(x0), acc)
            acc = tl.dot(c3, tl.trans(x3), tl.dot(c2, tl.trans(x2), tl.dot(c1, tl.trans(x1), acc)))
        else:
            acc = tl.dot(x0, tl.trans(c0), acc)
            acc = tl.dot(x3, tl.trans(c3), tl.dot(x2, tl.trans(c2), tl.dot(x1, tl.trans(c1), acc)))
    else:
        if FMT == INT8 or FMT == INT4G:
            w = q.to(tl.float32).to(tl.bfloat16)  # via fp32: exact for int8 codes
        else:
            w = q.to(tl.bfloat16)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # one binary for every M (no M == 1 or M % 16 variant)
def _linear_kernel(
    x_ptr, xs_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, K_CHUNK, CHUNKS, stride_xm, stride_sn, stride_sg, stride_ym, stride_rm,
    FMT: tl.constexpr, ACT: tl.constexpr, SHIFT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, IN_PROGRAM: tl.constexpr, SWAP: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    # M tiles vary fastest, so the programs sharing one N tile of W run together and hit it in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wait(PDL)
    if IN_PROGRAM:  # all CHUNKS K chunks here, each from zero, added in order: the split-K sum, bit for bit
        acc = _zeros(BLOCK_M, BLOCK_N, FMT, ACT)
        for c in range(0, CHUNKS):
            acc += _linear_chunk(x_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, offs_m, offs_n, pid_n * BLOCK_N,
                                 c * K_CHUNK, tl.minimum(K, (c + 1) * K_CHUNK), M, N, K, stride_xm, stride_sn,
                                 stride_sg, FMT, ACT, SHIFT, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, SWAP, WORDS, ASM)
    else:  # the loop of _linear_chunk written out here: through the helper, decode ran up to 10% slower (H100)
        if SWAP:  # y^T = W x^T: the weight tile is the dot's left operand, fed to the tensor cores from registers
            acc = _zeros(BLOCK_N, BLOCK_M, FMT, ACT)
        else:
            acc = _zeros(BLOCK_M, BLOCK_N, FMT, ACT)
        k_end = tl.minimum(K, (pid_k + 1) * K_CHUNK)
        for k0 in range(pid_k * K_CHUNK, k_end, BLOCK_K):  # this program's K range, in order
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x_mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0)
            acc = _tile_dot(x, acc, w_desc, w2_desc, scale_ptr, lo_ptr, offs_n, pid_n * BLOCK_N, k0, N, stride_sn,
                            stride_sg, FMT, ACT, SHIFT, GROUP, BLOCK_K, SWAP, WORDS, ASM)
        if SWAP:
            acc = tl.trans(acc)
    if WORDS and FMT == INT8 and not ACT and not SWAP:  # the columns back in the weight's order
        acc = tl.trans(_rows_by_bits(tl.trans(acc), 2, 3, 1))
    _finish(acc, part_ptr, count_ptr, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
            stride_rm, FMT, ACT, HAS_BIAS, HAS_RES, SPLIT_K)


_NIBBLES_ASM = tl.constexpr(ptx.NIBBLES)


@triton.jit
def _codes(b, ASM: tl.constexpr):
    """bf16 1 + c / 16 of the low and the high nibbles of bytes b (exact; byte permutes on the GPU; the
    interpreter, which runs no PTX, computes the same values with float ops)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        lo = _one_code(b & 15)
        hi = _one_code(b >> 4)
    return lo, hi


@triton.jit
def _one_code(c):
    """Codes 0..15 as bf16 1 + c / 16, exact: what the builds put under 1.0's bits (kernels/ptx.py NIBBLES)."""
    return (c.to(tl.float32) * 0.0625 + 1).to(tl.bfloat16)


_PLANES_ASM = tl.constexpr(ptx.PLANES)


@triton.jit
def _plane_codes(u, l, ASM: tl.constexpr):
    """bf16 q8 - 128 (q8 = 16 upper + lower) at the even and the odd k of the plane bytes u and l."""
    if ASM:
        even, odd = tl.inline_asm_elementwise(_PLANES_ASM, "=r,=r,r,r", [u, l], dtype=(tl.int8, tl.int8),
                                              is_pure=True, pack=4)
        return even.to(tl.bfloat16), odd.to(tl.bfloat16)  # int8 -> bf16 is a cheap conversion
    even = ((u & 15).to(tl.float32) * 16 + (l & 15).to(tl.float32) - 128).to(tl.bfloat16)
    odd = ((u >> 4).to(tl.float32) * 16 + (l >> 4).to(tl.float32) - 128).to(tl.bfloat16)
    return even, odd


_WORD_NIBBLES_ASM = tl.constexpr(ptx.WORD_NIBBLES)


@triton.jit
def _word_codes(w, ASM: tl.constexpr):
    """bf16 1 + c / 16 of the codes at k = 4j + t (t = 0..3) of a nibble plane's 16-bit words w."""
    if ASM:
        return tl.inline_asm_elementwise(_WORD_NIBBLES_ASM, "=r,=r,=r,=r,r", [w],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=2)
    v = w.to(tl.int32) & 0xFFFF
    return _one_code(v & 15), _one_code((v >> 4) & 15), _one_code((v >> 8) & 15), _one_code((v >> 12) & 15)


_PLANE_WORDS_ASM = tl.constexpr(ptx.PLANE_WORDS)


@triton.jit
def _plane_word_codes(u, l, ASM: tl.constexpr):
    """bf16 q8 - 128 (q8 = 16 upper + lower) at k = 4j + t (t = 0..3) of the two planes' 16-bit words u and l."""
    if ASM:
        return tl.inline_asm_elementwise(_PLANE_WORDS_ASM, "=r,=r,=r,=r,r,r", [u, l],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=2)
    a = u.to(tl.int32) & 0xFFFF
    b = l.to(tl.int32) & 0xFFFF
    return ((((a & 15) << 4) + (b & 15) - 128).to(tl.float32).to(tl.bfloat16),
            (((a >> 4) & 15) * 16 + ((b >> 4) & 15) - 128).to(tl.float32).to(tl.bfloat16),
            (((a >> 8) & 15) * 16 + ((b >> 8) & 15) - 128).to(tl.float32).to(tl.bfloat16),
            (((a >> 12) & 15) * 16 + ((b >> 12) & 15) - 128).to(tl.float32).to(tl.bfloat16))


@triton.jit
def _quarters(x):
    """x [M, K] -> its columns k = 4j, 4j + 1, 4j + 2 and 4j + 3, each [M, K / 4]."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 4, 2, 2)))  # k = 4j + 2i, 4j + 2i + 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


_INT8_WORDS_ASM = tl.constexpr(ptx.INT8_WORDS)


@triton.jit
def _int8_word_codes(w, ASM: tl.constexpr):
    """bf16 of the signed INT8 codes at k = 4j + t (t = 0..3) of 32-bit words w (word j holds k = 4j .. 4j + 3)."""
    if ASM:
        return tl.inline_asm_elementwise(_INT8_WORDS_ASM, "=r,=r,=r,=r,r,r", [w],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=2)
    return (((w << 24) >> 24).to(tl.float32).to(tl.bfloat16), ((w << 16) >> 24).to(tl.float32).to(tl.bfloat16),
            ((w << 8) >> 24).to(tl.float32).to(tl.bfloat16), (w >> 24).to(tl.float32).to(tl.bfloat16))


_NIBBLES_I8_ASM = tl.constexpr(ptx.NIBBLES_I8)


@triton.jit
def _int8_codes(b, ASM: tl.constexpr):
    """int8 codes 0..15 of the low and the high nibbles of bytes b."""
    if ASM:
        return tl.inline_asm_elementwise(_NIBBLES_I8_ASM, "=r,=r,r", [b], dtype=(tl.int8, tl.int8), is_pure=True,
                                         pack=4)
    return (b & 15).to(tl.int8), (b >> 4).to(tl.int8)


_AFFINE_ASM = tl.constexpr(ptx.AFFINE)


@triton.jit
def _weight(c, s, lo, ASM: tl.constexpr):
    """The bf16 weight c * s + lo of codes c as the builds give them, s and lo [BLOCK_N, 1] (the caller's affine
    for those codes), in one fused multiply-add. lo is a bf16 value on quant/formats' grids and the weight exact in
    float32 before its one rounding: the reference's dequantized weight (a bf16 fused multiply-add on the GPU; its
    twin in float32 here)."""
    s2 = tl.broadcast_to(s.to(tl.bfloat16), c.shape)
    lo2 = tl.broadcast_to(lo.to(tl.bfloat16), c.shape)
    if ASM:
        return tl.inline_asm_elementwise(_AFFINE_ASM, "=r,r,r,r", [c, s2, lo2], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
    return (c.to(tl.float32) * s2.to(tl.float32) + lo2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _group_ints(lo_ptr, offs_n, g, N, stride_sn, stride_sg):
    """INT4G's integers of quant group g for weight rows offs_n, stored as s2 | z s2 << 8: (s2, z s2), int32 (rows
    past N: 1 and 0)."""
    ints = tl.load(lo_ptr + offs_n * stride_sn + g * stride_sg, mask=offs_n < N, other=1)
    return ints & 255, ints >> 8


@triton.jit
def _act_affine(scale_ptr, lo_ptr, offs_n, g, N, stride_sn, stride_sg, FMT: tl.constexpr):
    """The affine of quant group g that follows a K tile's int32 dot of the codes 0..15 with int8 activations: the
    affine formats' (scale, lo) in fp32 (`_group_affine`); INT4G's integers (s2, z s2), int32."""
    if FMT == INT4G:
        s, lo = _group_ints(lo_ptr, offs_n, g, N, stride_sn, stride_sg)
    else:
        s, lo = _group_affine(scale_ptr, lo_ptr, offs_n, g, N, stride_sn, stride_sg, FMT)
    return s, lo


@triton.jit
def _code_weight(c, s, lo, FMT: tl.constexpr, ASM: tl.constexpr):
    """The bf16 weight of codes c as the builds give them (1 + q / 16, or both planes' q8 - 128): `_weight` of the
    affine formats; INT4G's int8 value s2 (q - z) (s, lo: s2 and z, [BLOCK_N, 1]), exact, in two fused
    multiply-adds: 16 c - (16 + z) = q - z, then times s2 (every operand a small integer, exact in bf16); its channel
    scale comes after the sum."""
    if FMT == INT4G:
        return _weight(_weight(c, tl.full(s.shape, 16, tl.float32), -16 - lo, ASM), s, tl.zeros_like(s), ASM)
    return _weight(c, s, lo, ASM)


@triton.jit
def _nibble_chunk(x_ptr, sums_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, offs_m, offs_n, n0, k_start, k_end, M,
                  N, K, stride_xm, stride_sn, stride_sg, FMT: tl.constexpr, ACT: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_SUMS: tl.constexpr,
                  WORDS: tl.constexpr, ASM: tl.constexpr, X_DESC: tl.constexpr):
    """One K chunk [k_start, k_end) of a [BLOCK_M, BLOCK_N] tile of _nibble_kernel, from a zero accumulator. X_DESC:
    x_ptr is x's tensor descriptor (x's tiles by TMA, rows past M zeros), not a pointer."""
    # K is a multiple of GROUP and BLOCK_K divides GROUP: no K mask.
    if X_DESC:  # x's rows in bank order (_rows_by_bits), the row sums and the accumulator's rows with them
        offs_m = tl.reshape(_rows_by_bits(offs_m[:, None], 3, 2, 1), (BLOCK_M,))
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_start + tl.arange(0, BLOCK_K)[None, :]
        x_mask = (offs_m < M)[:, None]
    if ROW_SUMS:  # act_quant's sums of the codes per ROW_SUM_COLS columns [M, K / ROW_SUM_COLS]
        sum_ptrs = sums_ptr + offs_m * (K // ROW_SUM_COLS) + k_start // ROW_SUM_COLS
    if ACT and not ROW_SUMS:
        ones = tl.full((BLOCK_K // 2, BLOCK_N), 1, tl.int8)
    acc = _zeros(BLOCK_M, BLOCK_N, FMT, ACT)
    last_group = K // GROUP - 1
    # int8 activations: the affine, used after the dot, loaded one tile ahead (at once, its load would stall every
    # tile), its group clamped to the last one: a program's last tile loads a group it does not use.
    if ACT:
        s_next, lo_next = _act_affine(scale_ptr, lo_ptr, offs_n, tl.minimum(k_start // GROUP, last_group), N,
                                      stride_sn, stride_sg, FMT)
    # The weights' rows as a column of their own arange: the group affine is then loaded straight into the layout
    # the weight tile is built in (the pipeliner prefetches it with the words), not moved there through shared
    # memory from the epilogue's.
    rows = (n0 + tl.arange(0, BLOCK_N))[:, None]
    for k0 in range(k_start, k_end, BLOCK_K):  # this program's K range, in order
        if X_DESC:  # one TMA copy a tile (`x_by_tma`): no per-thread addresses, which a 64-row tile spilled
            x = _rows_by_bits(x_ptr.load([tl.min(offs_m, axis=0), k0]), 3, 2, 1)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0)
        if ACT:  # int8 codes 0..15 on int8 tensor cores, exact int32 sums per tile, then the group's affine
            s, lo = s_next, lo_next  # BLOCK_K divides GROUP: one group per tile
            s_next, lo_next = _act_affine(scale_ptr, lo_ptr, offs_n, tl.minimum((k0 + BLOCK_K) // GROUP, last_group),
                                          N, stride_sn, stride_sg, FMT)
            xe, xo = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            lo_c, hi_c = _int8_codes(w_desc.load([n0, k0 // 2]), ASM)
            d = tl.dot(xo, tl.trans(hi_c), tl.dot(xe, tl.trans(lo_c), out_dtype=tl.int32), out_dtype=tl.int32)
            if ROW_SUMS:  # the tile's sums, its ROW_SUM_COLS-column pieces added in order
                x_sum = tl.load(sum_ptrs, mask=offs_m < M, other=0)[:, None]
                for j in tl.static_range(1, BLOCK_K // ROW_SUM_COLS):
                    x_sum += tl.load(sum_ptrs + j, mask=offs_m < M, other=0)[:, None]
                sum_ptrs += BLOCK_K // ROW_SUM_COLS
            else:  # exact int32 sums from the int8 tensor cores (a dot with ones) measured faster here
                x_sum = tl.dot(xo, ones, tl.dot(xe, ones, out_dtype=tl.int32), out_dtype=tl.int32).to(tl.float32)
            if FMT == INT4G:  # x . s2 (q - z) = s2 (x . q) - z s2 sum(x): exact integers, summed over all of K
                acc += d * s[None, :] - x_sum.to(tl.int32) * lo[None, :]
            else:
                acc += d.to(tl.float32) * s[None, :] + x_sum * lo[None, :]
        else:
            if FMT == INT4G:  # the group's integers s2 and z: [BLOCK_N, 1] each
                s, lo = _group_ints(lo_ptr, rows, k0 // GROUP, N, stride_sn, stride_sg)
                s = s.to(tl.float32)
                lo = lo.to(tl.float32) / s
            else:
                s, lo = _group_affine(scale_ptr, lo_ptr, rows, k0 // GROUP, N, stride_sn, stride_sg, FMT)
            if FMT == FULL:  # the builds give q8 - 128: the offset is the weight of code 128 (a bf16 value)
                lo = lo + s * 128
            elif FMT != INT4G:  # the builds give 1 + q / 16: 16 s times it, plus lo - 16 s (a bf16 value)
                lo = lo - s * 16
                s = s * 16
            if WORDS:  # the planes as 16-bit words, four codes each, met by x's columns k = 4j + t
                x0, x1, x2, x3 = _quarters(x)
                w = w_desc.load([n0, k0 // 4])
                if FMT == FULL:
                    c0, c1, c2, c3 = _plane_word_codes(w, w2_desc.load([n0, k0 // 4]), ASM)
                else:
                    c0, c1, c2, c3 = _word_codes(w, ASM)
                acc = tl.dot(x0, tl.trans(_code_weight(c0, s, lo, FMT, ASM)), acc)
                acc = tl.dot(x1, tl.trans(_code_weight(c1, s, lo, FMT, ASM)), acc)
                acc = tl.dot(x2, tl.trans(_code_weight(c2, s, lo, FMT, ASM)), acc)
                acc = tl.dot(x3, tl.trans(_code_weight(c3, s, lo, FMT, ASM)), acc)
            else:  # bytes (K tiles under 64): the even and the odd columns of x meet the low and the high nibbles
                xe, xo = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
                b = w_desc.load([n0, k0 // 2])
                if FMT == FULL:  # the lower plane has the upper plane's layout
                    even, odd = _plane_codes(b, w2_desc.load([n0, k0 // 2]), ASM)
                else:
                    even, odd = _codes(b, ASM)
                acc = tl.dot(xe, tl.trans(_code_weight(even, s, lo, FMT, ASM)), acc)
                acc = tl.dot(xo, tl.trans(_code_weight(odd, s, lo, FMT, ASM)), acc)
        if not X_DESC:
            x_ptrs += BLOCK_K
    if X_DESC:
        acc = _rows_by_bits(acc, 3, 2, 1)
    return acc


@triton.jit(do_not_specialize=["M"])
def _nibble_kernel(
    x_ptr, xs_ptr, sums_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, K_CHUNK, CHUNKS, stride_xm, stride_sn, stride_sg, stride_ym, stride_rm,
    FMT: tl.constexpr, ACT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IN_PROGRAM: tl.constexpr, ROW_SUMS: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    X_DESC: tl.constexpr = False,
):
    """Nibble formats: INT4, UPPER and FULL with bf16 activations, INT4 and UPPER with int8 activation codes
    (ACT). A K tile lies in one quant group.
    - bf16 activations: each weight tile dequantized in registers to the bf16 the reference rounds (`_weight`: one
      bf16 fused multiply-add per two codes), then bf16 dots into one fp32 accumulator per chunk, as a bf16 GEMM:
      no per-tile affine, so the warp-specialized kernel can chain its wgmma over K the same way.
    - int8 activations: exact int32 dots of the codes per K tile, then the group's affine in fp32,
          x . (lo + s q) = s (x . q) + lo sum(x)
      sum(x) per K tile read from sums_ptr with ROW_SUMS (act_quant's sums of the codes per ROW_SUM_COLS columns),
      else exact from an int8 dot with ones.
    The weight tiles come by TMA (w_desc, w2_desc: the descriptors of the nibble planes), which keeps more bytes in
    flight than per-thread loads. Same grid, split-K and chunks in a program as _linear_kernel; every row goes
    through the same instructions whatever M is."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n0 = pid_n * BLOCK_N
    wait(PDL)
    if IN_PROGRAM:  # as _linear_kernel: the CHUNKS chunks in order, the split-K sum bit for bit
        acc = _zeros(BLOCK_M, BLOCK_N, FMT, ACT)
        for c in range(0, CHUNKS):
            acc += _nibble_chunk(x_ptr, sums_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, offs_m, offs_n, n0,
                                 c * K_CHUNK, tl.minimum(K, (c + 1) * K_CHUNK), M, N, K, stride_xm, stride_sn,
                                 stride_sg, FMT, ACT, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, ROW_SUMS, WORDS, ASM, X_DESC)
    else:
        acc = _nibble_chunk(x_ptr, sums_ptr, w_desc, w2_desc, scale_ptr, lo_ptr, offs_m, offs_n, n0, pid_k * K_CHUNK,
                            tl.minimum(K, (pid_k + 1) * K_CHUNK), M, N, K, stride_xm, stride_sn, stride_sg, FMT, ACT,
                            GROUP, BLOCK_M, BLOCK_N, BLOCK_K, ROW_SUMS, WORDS, ASM, X_DESC)
    _finish(acc, part_ptr, count_ptr, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
            stride_rm, FMT, ACT, HAS_BIAS, HAS_RES, SPLIT_K)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can read t's rows: a 16-byte aligned base and row stride, contiguous rows."""
    return t.data_ptr() % 16 == 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0


def kernel_format(weight: QuantWeight, mode: Mode) -> int | None:
    """How the kernels read `weight` in `mode`, or None where they do not cover the pair."""
    if weight.storage == "dense":
        fmt = DENSE.value if mode.name == "bf16" else None  # fp32: the reference's fp32 GEMM
    elif weight.storage == "int8":
        fmt = INT8.value if mode.act_bits is None or weight.shape[1] <= INT8_ACT_MAX_K else None
    elif weight.group_size < 32 or weight.group_size & (weight.group_size - 1):
        fmt = None  # a tile must fit in a group and int8 dots need K >= 32
    elif weight.storage == "int4":
        fmt = INT4.value
    elif weight.storage == "int4g":  # its int32 sums as INT8's (INT8_ACT_MAX_K)
        fmt = INT4G.value if mode.act_bits is None or weight.shape[1] <= INT8_ACT_MAX_K else None
    else:
        fmt = UPPER.value if mode.weight_bits == 4 else FULL.value
    if fmt is None or not all(_tma_ready(t) for t in _tensors(weight, fmt)[:2] if t is not None):
        return None
    return fmt


def _shift(fmt: int) -> int:
    """What moves a format's unsigned codes into the int8 range."""
    return {INT8.value: 0, INT4.value: 8, UPPER.value: 8, FULL.value: 128, INT4G.value: 0}[fmt]


def _tensors(weight: QuantWeight, fmt: int) -> tuple:
    """(w, w2, scale, lo) pointers the kernel reads for a format."""
    if fmt == DENSE.value:
        return weight.weight, None, None, None
    if fmt == INT8.value:
        return weight.q, None, weight.scale, None
    if fmt == INT4.value:
        return weight.packed, None, weight.scale, weight.lo
    if fmt == INT4G.value:  # the group's integers where the affine formats keep lo
        return weight.packed, None, weight.scale, weight.group
    upper, lower = weight.planes()  # as stored on a GPU; made from the CPU layout for Triton's interpreter
    return upper, lower if fmt == FULL.value else None, weight.scale, weight.lo


def linear(x: torch.Tensor, weight: QuantWeight, mode: Mode, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None, handover: Handover | None = None) -> torch.Tensor:
    """The reference `linear` (any leading dims), on the Triton kernel where it covers the case. handover (from the
    kernel that wrote x, kernels/ops.py): x's int8 codes (and their row sums), taken in place of act_quant's."""
    weight.check(mode)
    fmt = kernel_format(weight, mode)
    if fmt is None or x.dtype != torch.bfloat16 or (residual is not None and residual.dtype != torch.bfloat16):
        # Not covered (fp32 mode, float32/fp16 activations, odd group sizes, weights TMA cannot read): the
        # reference, explicitly.
        return reference_linear(x, weight, mode, bias, residual)
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    r2 = None if residual is None else residual.reshape(-1, n)
    if r2 is not None and r2.stride(-1) != 1:
        r2 = r2.contiguous()
    act = mode.act_bits is not None
    quartered = 0 if handover is None else handover.quartered
    if quartered and quartered != quarters_x(weight, mode, x2.shape[0], x2.device):  # else read in the wrong order
        raise ValueError(f"x came quartered by K tiles of {quartered} for a linear that does not quarter it so "
                         "(`quarters_input`)")
    if mode.prompt and fmt != DENSE.value and not act:
        return prompt_linear(x2, weight, fmt, bias, r2, quartered > 0).view(*x.shape[:-1], n)
    group = getattr(weight, "group_size", 0)
    cfg = tile_config(fmt, act, n, k, group, x2.shape[0])
    if takes_scratch(fmt, act, group, cfg, x2.shape, x2.device):
        return scratch_linear(x2, weight, fmt, bias, r2, cfg, quartered > 0).view(*x.shape[:-1], n)
    x2, xs, sums = kernel_inputs(x2, mode, fmt, group, cfg, handover)
    if takes_int_scale_kernels(fmt, act, x2):
        return int_scale_linear(x2, xs, weight, cfg, bias, r2).view(*x.shape[:-1], n)
    return _launch(x2, xs, weight, fmt, act, bias, cfg, r2, sums, quartered > 0).view(*x.shape[:-1], n)


def kernel_inputs(x2: torch.Tensor, mode: Mode, fmt: int, group: int, cfg: TileConfig,
                  handover: Handover | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What the kernel reads for activations x2 under cfg: (x2 or its int8 codes, their row scales, the codes' row
    sums where the kernel takes them (`takes_row_sums`), else None): the codes and their sums from the kernel that
    wrote x2 (`handover`), else from act_quant; bf16 activations as they are."""
    if mode.act_bits is None:
        return x2, None, None
    row_sums = takes_row_sums(fmt, True, group, cfg)
    if handover is not None and handover.codes_for(mode.act_bits):
        if handover.codes.shape != x2.shape:
            raise ValueError(f"codes of shape {tuple(handover.codes.shape)} for x of {tuple(x2.shape)}")
        return handover.codes, handover.scale, handover.sums if row_sums else None
    return _act_quant(x2, mode.act_bits, sums=row_sums)


def _launch(x2: torch.Tensor, xs: torch.Tensor | None, weight: QuantWeight, fmt: int, act: bool,
            bias: torch.Tensor | None, cfg: TileConfig, r2: torch.Tensor | None = None,
            sums: torch.Tensor | None = None, x_quartered: bool = False) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ W^T (+ r2 [M, N]) under one tile config (the benchmark's tuner calls this).
    x_quartered: x2 comes quartered by cfg's K tile, where `quarters_in_run` says the run quarters it."""
    return _run(x2, xs, _tensors(weight, fmt), weight.shape[0], getattr(weight, "group_size", 0), fmt, act, bias,
                cfg, r2, sums, x_quartered)


def quarters_in_run(fmt: int, act: bool, group: int, cfg: TileConfig, scale: torch.Tensor | None, n: int, k: int,
                    device: torch.device) -> bool:
    """Whether `_run` quarters x (by cfg's K tile) for the warp-specialized nibble kernel: a nibble format's planes
    as words, or INT8's words over whole K tiles."""
    if not (cfg.warp_specialized and gluon_linear.runs_on(device) and reads_words(fmt, act, group, cfg)):
        return False
    if uses_nibble_kernel(fmt, act, group, cfg.block_m):
        return gluon_linear.covers(scale, n)
    return fmt == INT8.value and k % cfg.block_k == 0  # the quartered x holds whole K tiles


def _run(x2: torch.Tensor, xs: torch.Tensor | None, tensors: tuple, n: int, group: int, fmt: int, act: bool,
         bias: torch.Tensor | None, cfg: TileConfig, r2: torch.Tensor | None,
         sums: torch.Tensor | None = None, x_quartered: bool = False) -> torch.Tensor:
    """_launch on the tensors the kernel reads: (w, w2, scale, lo) of a weight of N rows in quant groups of `group`."""
    m, k = x2.shape
    if sums is not None:
        if sums.shape != (m, k // ROW_SUM_COLS.value):
            raise ValueError(f"row sums of shape {tuple(sums.shape)} for x of {m} x {k}: expected "
                             f"[{m}, {k // ROW_SUM_COLS.value}]")
        sums = sums.contiguous()  # the kernel reads row r's sums at r * K / ROW_SUM_COLS
    w, w2, scale, lo = tensors
    chunk = k_chunk(k, cfg.split_k, cfg.block_k)
    nibble = uses_nibble_kernel(fmt, act, group, cfg.block_m)
    words = reads_words(fmt, act, group, cfg)
    if quarters_in_run(fmt, act, group, cfg, scale, n, k, x2.device):  # INT8's words: no planes, no affine
        return gluon_linear.nibble_gemm(x2, fmt, (w, w2, scale, lo) if nibble else (w, None, scale, None), n,
                                        group if nibble else 0, cfg.block_k, chunk, cfg.split_k, bias, r2,
                                        x_quartered=x_quartered)
    if x_quartered:
        raise ValueError("x came quartered for a run that does not quarter it")
    if cfg.warp_specialized and gluon_linear.runs_on(x2.device):  # before this path's output and partials
        if fmt == DENSE.value and w.dtype == torch.bfloat16:  # with a scale: INT8 codes (`scratch_linear`)
            return gluon_linear.dense_gemm(x2, w, cfg.block_k, chunk, cfg.split_k, bias, r2, scale)
        if fmt == INT8.value and act:
            return gluon_linear.int8_gemm(x2, xs, w, scale, bias, r2)
        if (fmt == INT4.value and act and sums is not None and cfg.block_k == min(group, 128)
                and cfg.block_k % ROW_SUM_COLS.value == 0 and gluon_linear.takes_act_weight(k, n, cfg.block_k, scale)):
            return gluon_linear.nibble_act_gemm(x2, xs, sums, tensors, n, group, cfg.block_k, chunk, cfg.split_k,
                                                bias, r2)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x2.device)
    grid_split = 1 if cfg.in_program else cfg.split_k
    grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), grid_split)
    part = counts = None
    if grid_split > 1:
        exact = fmt in (INT8.value, INT4G.value) and act  # int32 partial sums (`_zeros`)
        part = torch.empty((grid_split, m, n), dtype=torch.int32 if exact else torch.float32, device=x2.device)
        counts = group_counts(x2.device, grid[0] * grid[1])
    flags = dict(FMT=fmt, ACT=act, GROUP=group, HAS_BIAS=bias is not None, HAS_RES=r2 is not None,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=grid_split,
                 IN_PROGRAM=cfg.in_program, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options())
    stride_sn, stride_sg = (0, 0) if lo is None else lo.stride()  # scale has lo's layout
    args = (y, part, counts, m, n, k, chunk, cfg.split_k if cfg.in_program else 1, x2.stride(0), stride_sn,
            stride_sg, y.stride(0), 0 if r2 is None else r2.stride(0))
    if words:  # the planes' bytes as 16-bit words, four nibble codes each; INT8 codes as 32-bit words of four
        word = torch.int32 if fmt == INT8.value else torch.int16
        w, w2 = (None if t is None else t.view(word) for t in (w, w2))
        block = [cfg.block_n, cfg.block_k // 4]
    else:
        block = [cfg.block_n, cfg.block_k // 2 if fmt >= INT4.value else cfg.block_k]
    descs = [None if t is None else TensorDescriptor.from_tensor(t, block) for t in (w, w2)]
    if nibble:
        x_desc = x_by_tma(fmt, act, cfg) and _tma_ready(x2)
        x_arg = TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k]) if x_desc else x2
        _nibble_kernel[grid](x_arg, xs, sums, *descs, scale, lo, bias, r2, *args, ROW_SUMS=sums is not None,
                             WORDS=words, ASM=not INTERPRETING, X_DESC=x_desc, **flags)
    else:
        _linear_kernel[grid](x2, xs, *descs, scale, lo, bias, r2, *args, SHIFT=_shift(fmt) if act else 0,
                             SWAP=cfg.swap, WORDS=words, ASM=not INTERPRETING, **flags)
    return y


# ---------------------------------------------------------------- prompt tokens (Mode.prompt)
# A prompt's tokens go through one order of adds and generated tokens through another, each batch invariant: integer
# weights with bf16 activations are dequantized to bf16 (as the reference rounds them) into a scratch and run through
# the bf16 GEMM above, whose tiles keep every row's bits from 1 to 8192 rows, mma.sync or wgmma alike. So a prompt
# prefilled in one piece or in chunks of any size, alone or packed with others, gets the same bits; decode and verify
# passes multiply by the same bf16 weights in the integer kernels (their K tiles, split and k order).

# Per device and dtype (bf16 weights, int8 codes): the largest weight dequantized so far, reused.
_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@triton.jit
def _dequantize_kernel(w_desc, w2_desc, scale_ptr, lo_ptr, out_ptr, N, K, stride_sn, stride_sg,
                       FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       QUARTERED: tl.constexpr, CODES: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of W in bf16: scale * code, + lo for the group-wise formats, in float32 (launched
    without FMA contraction, so it rounds as quant/formats.affine_dequant_ does), then rounded once; CODES: the INT8
    codes alone (INT8's or INT4G's, exact in bf16, or stored as int8 where out_ptr is). QUARTERED: its columns in
    the order the nibble kernels read x (column t * BLOCK_K / 4 + j of the tile holds its column 4j + t)."""
    wait(PDL)  # the previous GEMM may still read the scratch this overwrites
    n0 = tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(1) * BLOCK_K
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    q = _weight_codes(w_desc, w2_desc, lo_ptr, offs_n, n0, k0, N, stride_sn, stride_sg, FMT, GROUP, BLOCK_K,
                      ASM).to(tl.float32)
    if (FMT == INT8 or FMT == INT4G) and CODES:
        w = q
    elif FMT == INT8 or FMT == INT4G:
        w = q * tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0)[:, None]
    else:  # BLOCK_K divides GROUP
        s, lo = _group_affine(scale_ptr, lo_ptr, offs_n, k0 // GROUP, N, stride_sn, stride_sg, FMT)
        w = q * s[:, None] + lo[:, None]
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    if QUARTERED:  # reordered in registers, so that the stores stay contiguous
        w = tl.reshape(tl.permute(tl.reshape(w, (BLOCK_N, BLOCK_K // 4, 4)), (0, 2, 1)), (BLOCK_N, BLOCK_K))
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_scratch(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The scratch buffers `dequantize` writes on this device. A larger weight replaces one, so a CUDA graph that
    dequantizes holds on to those it was captured with."""
    return tuple(buf for (dev, _), buf in _SCRATCH.items() if dev == device)


def dequantize_block_k(fmt: int, group: int) -> int:
    """The K tile `dequantize` writes (and, `quartered`, quarters) the scratch by: a nibble format's group, at most
    128."""
    return min(group, 128) if fmt >= INT4.value else 128


def dequantize(weight: QuantWeight, fmt: int, quartered: bool = False, codes: bool = False,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] in bf16, bit for bit `weight.dequantize(mode).bfloat16()` for the mode `fmt` reads, in a scratch
    buffer the next call overwrites (one per device and dtype, as large as the largest weight: 235 MB for an 8B
    model's fused gate/up); `quartered`: each of its K tiles (`dequantize_block_k`) with its columns in the nibble
    kernels' order (`gluon_linear.quartered`); `codes`: the INT8 codes without their channel scale (INT8's or
    INT4G's), in `dtype` (bf16 or int8)."""
    (n, k), dev = weight.shape, weight.scale.device
    buf = _SCRATCH.get((dev, dtype))
    if buf is None or buf.numel() < n * k:
        buf = _SCRATCH[dev, dtype] = torch.empty(n * k, dtype=dtype, device=dev)
    out = buf[:n * k].view(n, k)
    w, w2, scale, lo = _tensors(weight, fmt)
    group = getattr(weight, "group_size", 0)
    block_n, block_k = 64, dequantize_block_k(fmt, group)
    block = [block_n, block_k // 2 if fmt >= INT4.value else block_k]
    descs = [None if t is None else TensorDescriptor.from_tensor(t, block) for t in (w, w2)]
    stride_sn, stride_sg = (0, 0) if lo is None else lo.stride()
    _dequantize_kernel[(cdiv(n, block_n), cdiv(k, block_k))](
        *descs, scale, lo, out, n, k, stride_sn, stride_sg, FMT=fmt, GROUP=group, BLOCK_N=block_n,
        BLOCK_K=block_k, QUARTERED=quartered, CODES=codes, ASM=not INTERPRETING, enable_fp_fusion=False,
        **launch_options())
    return out


def prompt_linear(x2: torch.Tensor, weight: QuantWeight, fmt: int, bias: torch.Tensor | None,
                  r2: torch.Tensor | None, quartered: bool = False) -> torch.Tensor:
    """y [M, N] (+ r2 [M, N]) of prompt tokens x2 [M, K]: the weight dequantized to bf16, then the bf16 GEMM; or
    where `takes_prompt_kernel`, the nibble kernel over all of K in one chain (from PROMPT_SCRATCH_ROWS rows, its
    sums from the quartered scratch). quartered: x2 came quartered by the kernel's K tile (`quarters_x`)."""
    n, k = weight.shape
    if takes_prompt_kernel(weight, fmt, x2.device):
        group = getattr(weight, "group_size", 0)
        block_k = dequantize_block_k(fmt, group)
        xq = x2 if quartered else gluon_linear.quartered(x2, block_k)
        if x2.shape[0] >= PROMPT_SCRATCH_ROWS.get(fmt, 1 << 62):  # the same sums from the quartered scratch
            w, scale = quartered_scratch(weight, fmt)
            return gluon_linear.dense_gemm(xq, w, PROMPT_SCRATCH_BLOCK_K, k, 1, bias, r2, scale)
        return gluon_linear.nibble_gemm(xq, fmt, _tensors(weight, fmt), n, group, block_k, k, 1, bias, r2,
                                        x_quartered=True)
    cfg = tile_config(DENSE.value, False, n, k, 0, x2.shape[0])
    return _run(x2, None, (dequantize(weight, fmt), None, None, None), n, 0, DENSE.value, False, bias, cfg, r2)


# Prompt tokens on Hopper (`takes_prompt_kernel`) take the warp-specialized nibble kernel with K as one chain of K
# tiles from zero: the weight built in registers (no dequantize pass), x quartered, one accumulator a consumer (256
# tokens a CTA where the waves favour it: `gluon_linear.wide_tiles`); INT8 and INT4G sum their codes and apply the
# channel scale after the sum. Its adds are the bf16 GEMM's over the quartered columns of x and of the dequantized
# weight, so from PROMPT_SCRATCH_ROWS rows, where building the weight once a band of rows costs more than one
# dequantize pass, a format runs that GEMM on the quartered scratch: the same bits (tests/gpu), so the row count may
# choose. The INT4 nibbles keep the kernel at every row count. H100, 8B layers (docs/gpu.md, sessions 30-32): the
# kernel 0.40-0.62x the scratch's time at 256 rows, 1.05-1.22x at 4,096; the engine's TTFT for one 512-token
# `planes` prompt 0.87x.
PROMPT_KERNEL_FORMATS = (INT4.value, UPPER.value, FULL.value, INT8.value, INT4G.value)
PROMPT_SCRATCH_ROWS = {FULL.value: 2048, INT8.value: 2048, INT4G.value: 2048}
# The scratch's bf16 GEMM in K tiles of 64: 128 gives the same bits but ran 1.4x slower (H100,
# docs/bench-h100/s32-prompt-scratch-probe.log).
PROMPT_SCRATCH_BLOCK_K = 64


def takes_prompt_kernel(weight: QuantWeight, fmt: int, device: torch.device) -> bool:
    """Whether prompt tokens take the nibble kernel's sums (above): a format it reads, on Hopper, K whole K tiles of
    `dequantize_block_k` (x is quartered by them) of 64 columns or more (each quarter a dot of K >= 16, as
    `reads_words`), its affine rows TMA reads."""
    if fmt not in PROMPT_KERNEL_FORMATS or not gluon_linear.runs_on(device):
        return False
    (n, k), block_k = weight.shape, dequantize_block_k(fmt, getattr(weight, "group_size", 0))
    return block_k >= 64 and k % block_k == 0 and gluon_linear.covers(weight.scale, n)


@register("quarters_input", "", "cuda")
def quarters_x(weight: QuantWeight, mode: Mode, rows: int, device: torch.device) -> int:
    """The K tile by which `linear` quarters x of `rows` rows in `mode` (0: none), which the op writing x may do for
    it: bf16 activations read by the nibble kernels, prompt tokens (`takes_prompt_kernel`, any row count) or
    generated ones (past SCRATCH_ROWS `scratch_linear`, else where `_run` takes the warp-specialized kernel)."""
    fmt = kernel_format(weight, mode)
    if fmt is None or fmt == DENSE.value or mode.act_bits is not None:
        return 0
    group = getattr(weight, "group_size", 0)
    if mode.prompt:
        return dequantize_block_k(fmt, group) if takes_prompt_kernel(weight, fmt, device) else 0
    n, k = weight.shape
    cfg = tile_config(fmt, False, n, k, group, rows)
    if takes_scratch(fmt, False, group, cfg, (rows, k), device):
        return cfg.block_k
    return cfg.block_k if quarters_in_run(fmt, False, group, cfg, weight.scale, n, k, device) else 0


# ---------------------------------------------------------------- generated tokens at many rows
# The nibble formats with bf16 activations multiply x by the bf16 weight the reference rounds (their kernels build
# it in registers), one dot per quarter of each K tile (columns 4j + t), the split's chunks each from zero and added
# in order. Past SCRATCH_ROWS rows a decode or verify pass takes that weight from the dequantize scratch instead, its
# columns quartered as x's are, through the bf16 GEMM in the same K tile and chunks: the same products added in the
# same order, one dequantization a weight instead of one per M tile of CTAs. Worth it where the build costs most:
# `full` from 2,048 rows (H200, 8B layers, against today's nibble kernel with its wgmma in turns: 0.86-0.96x the
# time at 2,048 rows, 0.77-0.86x at 4,096, but 0.99-1.08x at 1,024; docs/gpu.md, session 24); w4a16 took
# 1.17-1.24x at 1,024 and 1.02-1.06x at 4,096, so the INT4 nibbles (and `upper`, as cheap to build) keep their
# kernel (session 23). w8a16 (INT8 codes as words, the same kernel and x quartered alike) takes its codes from the
# scratch, unscaled (exact in bf16), the channel scale in the bf16 kernel's epilogue after the sum, as its own
# kernel applies it: from 2,048 rows (H200, 8B layers: 0.99-1.04x the time of its word kernel at 2,048 rows, the
# spread; 0.83-0.95x at 4,096; docs/gpu.md, session 26).
SCRATCH_ROWS = {FULL.value: 2048, INT8.value: 2048}


def takes_scratch(fmt: int, act: bool, group: int, cfg: TileConfig, shape: tuple[int, int],
                  device: torch.device) -> bool:
    """Whether a GEMM of generated tokens goes through the quartered scratch (`scratch_linear`): a nibble format
    with bf16 activations, or INT8 codes on Hopper (their scale needs the warp-specialized bf16 kernel's epilogue),
    past its SCRATCH_ROWS, its K whole K tiles (x is quartered by whole tiles) of the size `dequantize` quarters the
    scratch by (every decode config of the shapes we know)."""
    m, k = shape
    kernel = uses_nibble_kernel(fmt, act, group) or (fmt == INT8.value and gluon_linear.runs_on(device))
    return (not act and kernel and m >= SCRATCH_ROWS.get(fmt, 1 << 62) and k % cfg.block_k == 0
            and cfg.block_k == dequantize_block_k(fmt, group))


# INT4G with int8 activations from INT_SCALE_ROWS rows, on Hopper: exact int32 sums over all of K, so the decode
# tiles' bits whatever the kernel. Below INT_SCALE_SCRATCH_ROWS rows the warp-specialized int8 kernel builds its INT8
# codes in registers a K tile at a time for 128 or 256 rows of x (gluon_linear.int_scale_gemm, K in pieces where its
# tiles leave SMs idle) where it takes the K tile (128: quant groups of 128 and more); so does a weight whose 256-row
# band of tiles fills the SMs by itself (gate/up's N), up to INT_SCALE_WIDE_ROWS; from there (and where it does not)
# the codes are built once a GEMM into an int8 scratch for w8a8's int8 GEMM with the channel scale. H200, 8B layers,
# w4a8, time / cuBLAS BF16 (docs/bench-h200/s28-*, s29-int4g-paths.log): at 96-128 rows the kernel 0.74-1.24, the
# scratch 1.29-1.60; at 256 the kernel (256 rows a CTA) 0.83-1.45, the scratch 1.12-1.51; at 384 mixed, 1.0-1.7
# either way; at 512 the scratch 0.85-1.19 against 0.90-1.29, at 1,024-4,096 0.64-1.02 against 0.69-1.06, where
# gate/up's kernel reads 0.91 / 0.78 against 1.02 / 0.82 at 512 / 1,024.
INT_SCALE_ROWS, INT_SCALE_SCRATCH_ROWS, INT_SCALE_WIDE_ROWS = 65, 257, 1024


def takes_int_scale_kernels(fmt: int, act: bool, x2: torch.Tensor) -> bool:
    """Whether a GEMM goes to `int_scale_linear`: INT4G with int8 activations from INT_SCALE_ROWS rows, on Hopper,
    rows TMA can read (K a multiple of 16 bytes)."""
    m, k = x2.shape
    return (fmt == INT4G.value and act and m >= INT_SCALE_ROWS and k % 16 == 0 and gluon_linear.runs_on(x2.device))


def int_scale_linear(x2: torch.Tensor, xs: torch.Tensor, weight: QuantWeight, cfg: TileConfig,
                     bias: torch.Tensor | None, r2: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] (+ r2) of INT4G with x2's int8 codes and row scales xs, on the int8 tensor cores (above)."""
    (n, k), block_k, m = weight.shape, cfg.block_k, x2.shape[0]
    in_registers = m < INT_SCALE_SCRATCH_ROWS or (m <= INT_SCALE_WIDE_ROWS and gluon_linear.fills_sms(n, x2.device))
    if in_registers and gluon_linear.takes_act_weight(k, n, block_k, weight.group.view(torch.float32)):
        return gluon_linear.int_scale_gemm(x2, xs, weight.packed, weight.group, weight.scale, n, weight.group_size,
                                           block_k, bias, r2)
    codes = dequantize(weight, INT4G.value, codes=True, dtype=torch.int8)
    return gluon_linear.int8_gemm(x2, xs, codes, weight.scale, bias, r2)


def scratch_linear(x2: torch.Tensor, weight: QuantWeight, fmt: int, bias: torch.Tensor | None,
                   r2: torch.Tensor | None, cfg: TileConfig, x_quartered: bool = False) -> torch.Tensor:
    """y [M, N] (+ r2) of generated tokens: the weight dequantized (INT8: its codes, the channel scale applied after
    the sum), columns quartered, times quartered x in the bf16 GEMM's tiles for M rows, with cfg's (the weight's
    decode config's) K tile and split."""
    (n, k), m = weight.shape, x2.shape[0]
    dense = replace(decode_config(DENSE.value, False, n, k, 0), block_k=cfg.block_k, split_k=cfg.split_k)
    dense = many_tokens(dense, DENSE.value, False, 0, m, n, k)
    dense = replace(dense, warp_specialized=True)  # Gluon's: the chunks' total in registers (Triton's tiles spill)
    w, scale = quartered_scratch(weight, fmt)
    xq = x2 if x_quartered else gluon_linear.quartered(x2, cfg.block_k)
    return _run(xq, None, (w, None, scale, None), n, 0, DENSE.value, False, bias, dense, r2)


def quartered_scratch(weight: QuantWeight, fmt: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight dequantized into the scratch, its K tiles' columns quartered, and the channel scale the bf16 GEMM
    applies after the sum: INT8's and INT4G's, whose scratch holds their codes (exact in bf16), as their kernels
    apply it; None for the affine formats."""
    codes = fmt in (INT8.value, INT4G.value)
    return dequantize(weight, fmt, quartered=True, codes=codes), weight.scale if codes else None


for _storage in STORAGES:
    register("linear", _storage, "cuda")(linear)

_SIGNS: dict[tuple[int, torch.device], DenseWeight] = {}  # the +-1 Hadamard matrix of each order, per device


@register("rotate", "", "cuda")
def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The Hadamard rotation through the batch-invariant GEMM above: cuBLAS chooses its kernel by M, which would
    make a verify pass rotate its rows differently from the AR step. The +-1 entries are exact in bf16; the
    1/sqrt(n) scale follows."""
    if x.dtype != torch.bfloat16:
        return reference_rotate(x, h)
    n = h.shape[0]
    key = (n, h.device)  # a Sylvester matrix is determined by its order
    signs = _SIGNS.get(key)
    if signs is None:
        signs = _SIGNS[key] = DenseWeight(torch.sign(h).bfloat16())
    y = linear(x.reshape(-1, n), signs, MODES["bf16"], None)
    return (y.float() * n**-0.5).to(x.dtype).view(x.shape)
