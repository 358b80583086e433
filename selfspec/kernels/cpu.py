"""CPU linear of the stored formats (and, at the end, attention: query by query for decode and verify passes, and
the rows of packed prefills). An integer format's
stored copy is dequantized a block of output rows at a time into a reused float32 scratch buffer and multiplied
there (no float copy of the weight is kept between calls); a dense float32 weight (the head, the fp32 recipe) is
multiplied as stored.

Why not the reference (dequantize the whole weight, then F.linear): on the CPU its cost is the dequantization,
not the product. Fresh [N, K] temporaries page-fault on every call, the nibbles are interleaved by strided
writes, and group scales broadcast from their group-major layout run at a third of the speed of contiguous ones.
Here the INT8-plane format holds its codes as one byte each in place of the two planes (quant/formats.py: its
CPU layout), so `full` converts them as they are and `upper` is one shift and mask on 32-bit words (four bytes
per op); the INT4 format's nibbles are split the same way. The codes lie deinterleaved (every even k of a row,
then every odd k: K permuted, the activations permuted alike, the product unchanged), and the scales are
broadcast from contiguous [rows, 2G] copies. The float weight of a mode is bitwise the
reference's (`dequantize`, permuted); only the order of the float32 sums in the product differs.

Batch invariance: a row's result must not depend on how many rows the call has (a verify pass runs gamma + 1
tokens per row, plain decoding 1; greedy speculative output equals AR output only if each token's logits are
the same bits either way). MKL's sgemm is not invariant on this (an M = 1 product takes another path than
M >= 2, measured on SmolLM2's shapes and its head), so up to ROW_BY_ROW_MAX rows are multiplied one row at a
time, each as an M = 1 product; larger calls (prefills) take one GEMM.
PyTorch's own CPU weight-only kernels were measured and not used: _weight_int8pack_mm and
_weight_int4pack_mm_for_cpu are 10-20x slower than F.linear in float32 (fast only in bfloat16, whose rounding of
the activations and the scales is as large as the INT8 step itself), and int4pack has no asymmetric INT8 form.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

import torch.nn.functional as F

from selfspec.kernels import register
from selfspec.kernels.ops import Handover
from selfspec.kernels.reference import attention as reference_attention, row_keys
from selfspec.quant.act import fake_quantize_per_token
from selfspec.quant.formats import (DenseWeight, Int4Weight, Int8PlanesWeight, Int8Weight, QuantWeight, doubled,
                                    permute_k, upper_affine)
from selfspec.quant.modes import Mode

if TYPE_CHECKING:
    from selfspec.model import Packed

ROW_BY_ROW_MAX = 64  # rows multiplied one at a time (decode, verify); more (prefill) take one GEMM
BLOCK_FLOATS = 1 << 20  # scratch floats per block of output rows (4 MiB; 1 and 16 MiB measured no faster)

_local = threading.local()


def scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer of at least numel elements (per thread): fresh large tensors page-fault on every call."""
    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: an inference tensor could not be written outside it
            buf = torch.empty(numel, dtype=dtype)
        setattr(_local, name, buf)
    return buf[:numel]


def word_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Bytes as 32-bit words where the layout allows (four bytes per op), with the mask of the low nibble of
    every byte: (view, mask). Byte-wise ops stay byte-wise: the mask drops what a shift carries across a byte
    boundary (and the sign bits an int32 shift brings in)."""
    if t.is_contiguous() and t.shape[-1] % 4 == 0:
        return t.view(torch.int32), 0x0F0F0F0F
    return t, 0x0F


def nibble_codes(packed: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, 2, K/2] uint8 (a strided view) of a packed block [N, K/2] (even k in the low nibble): every
    even k of a row, then every odd k."""
    words, lo = word_view(packed)
    out = scratch("codes", 2 * packed.numel(), torch.uint8).view(2, *packed.shape)
    o = out.view(torch.int32) if words.dtype == torch.int32 else out
    torch.bitwise_and(words, lo, out=o[0])
    torch.bitwise_and(words >> 4, lo, out=o[1])
    return out.transpose(0, 1)


def high_nibbles(q8: torch.Tensor) -> torch.Tensor:
    """q8 >> 4 of a block of 8-bit codes, into a scratch buffer."""
    words, lo = word_view(q8)
    out = scratch("codes", q8.numel(), torch.uint8).view(q8.shape)
    o = out.view(torch.int32) if words.dtype == torch.int32 else out
    torch.bitwise_right_shift(words, 4, out=o).bitwise_and_(lo)
    return out


def dequantize_codes(codes: torch.Tensor, scale2: torch.Tensor, lo2: torch.Tensor) -> torch.Tensor:
    """codes [N, K] or [N, 2, K/2] in the permuted K order (even k, then odd k) -> float32 weight [N, K],
    w = lo + scale * q group-wise, scale2/lo2 [N, 2G] contiguous (`doubled`): a float32 multiply, then a float32
    add, as the reference."""
    n = codes.shape[0]
    w = scratch("weight", codes.numel(), torch.float32).view(codes.shape)
    w.copy_(codes)
    groups = w.view(n, scale2.shape[1], -1)  # both halves hold the groups in order, each half-group g/2 wide
    groups.mul_(scale2[..., None]).add_(lo2[..., None])
    return w.view(n, -1)


def product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ w^T, each row on its own (batch invariant) unless there are many."""
    if x.shape[0] > ROW_BY_ROW_MAX:
        out.copy_(x @ w.t())
        return
    wt = w.t()
    for r in range(x.shape[0]):
        torch.mm(x[r:r + 1], wt, out=out[r:r + 1])


def block_rows(n: int, k: int) -> int:
    return max(1, min(n, BLOCK_FLOATS // k))


def affine(weight: QuantWeight, mode: Mode) -> tuple[torch.Tensor, ...]:
    """The per-row or per-group tensors the mode's dequantization reads, laid out for `weight_block`."""
    if isinstance(weight, DenseWeight):
        return ()
    if isinstance(weight, Int8Weight):
        return (weight.scale[:, None],)
    if isinstance(weight, Int8PlanesWeight):  # the CPU layout: scales doubled once, when the layout was made
        return upper_affine(weight.scale2, weight.lo2) if mode.weight_bits == 4 else (weight.scale2, weight.lo2)
    return doubled(weight.scale), doubled(weight.lo)


def weight_block(weight: QuantWeight, mode: Mode, scales: tuple[torch.Tensor, ...], i: int, j: int) -> torch.Tensor:
    """Rows i..j-1 of the mode's float32 weight (the nibble formats in the permuted K order)."""
    if isinstance(weight, DenseWeight):
        return weight.weight[i:j]
    if isinstance(weight, Int8Weight):
        w = scratch("weight", (j - i) * weight.q.shape[1], torch.float32).view(j - i, -1)
        return w.copy_(weight.q[i:j]).mul_(scales[0][i:j])
    if isinstance(weight, Int8PlanesWeight):
        codes = high_nibbles(weight.q8[i:j]) if mode.weight_bits == 4 else weight.q8[i:j]
    else:
        codes = nibble_codes(weight.packed[i:j])
    return dequantize_codes(codes, *(t[i:j] for t in scales))


def linear(x: torch.Tensor, weight: QuantWeight, mode: Mode, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None, handover: Handover | None = None) -> torch.Tensor:
    """The reference linear (kernels/reference.py) on float32 activations, by blocks of output rows (handover: not
    needed)."""
    weight.check(mode)
    dense = isinstance(weight, DenseWeight)
    if x.dtype != torch.float32 or dense and (mode.name != "fp32" or weight.weight.dtype != torch.float32):
        from selfspec.kernels.reference import linear as reference_linear

        return reference_linear(x, weight, mode, bias, residual)
    if mode.act_bits is not None:
        x = fake_quantize_per_token(x, mode.act_bits)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if not isinstance(weight, (DenseWeight, Int8Weight)):
        rows = permute_k(rows)
    out = x.new_empty(rows.shape[0], n)
    scales = affine(weight, mode)
    step = block_rows(n, k)  # dense too: each block stays in cache while the rows go through it one by one
    for i in range(0, n, step):
        j = min(n, i + step)
        product(rows, weight_block(weight, mode, scales, i, j), out[:, i:j])
    if bias is not None:
        out += bias
    y = out.view(*x.shape[:-1], n)
    return y if residual is None else y + residual


for _fmt in (DenseWeight, Int8Weight, Int4Weight, Int8PlanesWeight):
    register("linear", _fmt.storage, "cpu")(linear)


@register("attention", "", "cpu")
def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              q_pos: torch.Tensor, prompt: bool = False, tails: torch.Tensor | None = None) -> torch.Tensor:
    """The reference attention, query by query up to ROW_BY_ROW_MAX queries: each over exactly its keys 0..pos,
    unmasked. torch's CPU attention gives a query other bits with another number of keys (even masked ones: the
    table's width, or a contiguous cache's length, which differ between a verify pass and a plain step) and with
    other queries beside it; so a query's result here depends on its own position and keys alone (prompt tokens
    too: `prompt` makes no difference on the CPU)."""
    b, h, t, _ = q.shape
    if b * t > ROW_BY_ROW_MAX:
        return reference_attention(q, k_pool, v_pool, table, q_pos, tails=tails)
    k, v = row_keys(k_pool, table, q_pos, tails), row_keys(v_pool, table, q_pos, tails)
    out = torch.empty_like(q)
    for i, positions in enumerate(q_pos.tolist()):
        for j, pos in enumerate(positions):
            end = min(pos, k.shape[2] - 1) + 1
            out[i:i + 1, :, j:j + 1] = F.scaled_dot_product_attention(
                q[i:i + 1, :, j:j + 1], k[i:i + 1, :, :end].to(q.dtype), v[i:i + 1, :, :end].to(q.dtype),
                enable_gqa=True)
    return out


@register("packed_attention", "", "cpu")
def packed_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     q_pos: torch.Tensor, packed: Packed, prompt: bool = False) -> torch.Tensor:
    """One attention call per row, over its own queries and the blocks its keys fill: torch's CPU attention costs
    rows x longest row x keys, masked or not (one long prompt beside short ones pads them all to it)."""
    bs, out, start = k_pool.shape[2], [], 0
    for b, (n, keys) in enumerate(zip(packed.lengths, packed.keys)):
        rows = slice(start, start + n)
        out.append(attention(q[:, :, rows], k_pool, v_pool, table[b:b + 1, :-(-keys // bs)], q_pos[:, rows]))
        start += n
    return torch.cat(out, 2)
