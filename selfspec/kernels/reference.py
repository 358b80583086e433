"""Torch reference ops: plain, device-agnostic, the semantics every fast kernel must reproduce."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from selfspec.cache.paged import gather_blocks
from selfspec.cache.quant_kv import quantized_below
from selfspec.kernels import lookup, register
from selfspec.kernels.ops import Handover
from selfspec.quant.act import fake_quantize_per_token
from selfspec.quant.formats import STORAGES, QuantWeight
from selfspec.quant.modes import Mode

if TYPE_CHECKING:
    from selfspec.cache.kv import LayerKV
    from selfspec.model import Packed, TreeLayout


def linear(x: torch.Tensor, weight: QuantWeight, mode: Mode, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None, handover: Handover | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) in the mode's precision, returned in x's dtype (+ residual, added in that dtype). handover
    (kernels/ops.py `Handover`): not needed here."""
    weight.check(mode)
    if mode.name == "fp32":
        dtype = torch.float32
    elif mode.name == "bf16":
        dtype = torch.bfloat16
    else:
        dtype = x.dtype
    if mode.act_bits is not None:
        x = fake_quantize_per_token(x, mode.act_bits)
    w = weight.dequantize(mode).to(dtype)
    y = F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype)).to(x.dtype)
    return y if residual is None else y + residual


for _storage in STORAGES:
    register("linear", _storage)(linear)


@register("rotate")
def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    # In float32 whatever x's dtype: the rotation adds no rounding of its own.
    blocks = x.float().reshape(*x.shape[:-1], -1, h.shape[0])
    return (blocks @ h.float()).reshape(x.shape).to(x.dtype)


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout); x [B, H, T, D], cos/sin [B, T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # one angle per row and position, shared by the heads
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@register("rope_and_store")
def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    bs = k_pool.shape[2]
    blocks, offsets = slots // bs, slots % bs
    # Index pair (block, offset) around the head slice gives [B, T, Hkv, D], the layout of k.transpose(1, 2).
    k_pool[blocks, :, offsets] = rope(k, cos, sin).transpose(1, 2).to(k_pool.dtype)
    v_pool[blocks, :, offsets] = v.transpose(1, 2).to(v_pool.dtype)
    return rope(q, cos, sin)


@register("swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# The references' GEMMs sum and quantize x themselves: no handover (kernels/ops.py says what it is for).
@register("rms_norm_handover")
def rms_norm_handover(x: torch.Tensor, weight: torch.Tensor, eps: float, act_bits: int | None = None,
                      quartered: int = 0) -> tuple:
    return rms_norm(x, weight, eps), None


@register("swiglu_handover")
def swiglu_handover(gate: torch.Tensor, up: torch.Tensor, act_bits: int | None = None, quartered: int = 0) -> tuple:
    return swiglu(gate, up), None


@register("quarters_input")
def quarters_input(weight: QuantWeight, mode: Mode, rows: int, device: torch.device) -> int:
    return 0  # the references read x in order


def row_keys(pool: torch.Tensor, table: torch.Tensor, q_pos: torch.Tensor,
             tails: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's keys (or values) in logical order [B, Hkv, W * bs, D]: gathered through the block table, and with
    `tails`, the keys from a row's first query's position on read from the positions tails[b] (kernels/ops.py)."""
    x = gather_blocks(pool, table)
    if tails is None:
        return x
    b, s = x.shape[0], x.shape[2]
    at = q_pos[:, :1] + torch.arange(tails.shape[1], device=x.device)  # logical positions of the row's queries
    index = torch.arange(s, device=x.device).repeat(b, 1)
    index.scatter_(1, at.clamp(max=s - 1), tails.clamp(max=s - 1))
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


@register("attention")
def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              q_pos: torch.Tensor, prompt: bool = False, tails: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/ops.py `attention` (one arithmetic for every query: `prompt` makes no difference here)."""
    k, v = row_keys(k_pool, table, q_pos, tails), row_keys(v_pool, table, q_pos, tails)
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    # Causal, offset by each row's positions: [B, 1, T, S], broadcast over heads.
    mask = torch.arange(k.shape[2], device=q.device) <= q_pos[:, None, :, None]
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)


@register("tree_attention")
def tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                   q_pos: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
    """The device's `attention` over every branch row (each node's query run in every row holding it)."""
    return lookup("attention", "", q.device.type)(q, k_pool, v_pool, table, q_pos, tails=tree.tails)


@register("packed_attention")
def packed_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     q_pos: torch.Tensor, packed: Packed, prompt: bool = False) -> torch.Tensor:
    """The rows padded to [B, T] for the device's `attention` (one call; padding repeats a row's last query, and
    its output is dropped)."""
    out = lookup("attention", "", q.device.type)(packed.pad_heads(q), k_pool, v_pool, table, packed.pad(q_pos), prompt)
    return packed.unpad_heads(out)


@register("quantized_attention")
def quantized_attention(q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, upper: bool) -> torch.Tensor:
    """Query by query over exactly its keys (as the CPU `attention`, so a query's bits depend on its position and
    the cache alone): its row's dequantized groups below quantized_below(p), then its row's buffer up to p."""
    quant = kv.quant
    below = quantized_below(q_pos, quant.group)
    k_groups, v_groups = quant.dequantize(int(below.max()), upper)
    out = torch.empty_like(q)
    rows = zip(q_pos.tolist(), below.tolist(), kv.table[:, 0].tolist(), quant.start.tolist())
    for b, (positions, firsts, buf, start) in enumerate(rows):
        for t, (pos, first) in enumerate(zip(positions, firsts)):
            lo, hi = first - start, pos - start + 1
            k = torch.cat((k_groups[b:b + 1, :, :first].to(q.dtype), kv.k[buf:buf + 1, :, lo:hi].to(q.dtype)), 2)
            v = torch.cat((v_groups[b:b + 1, :, :first].to(q.dtype), kv.v[buf:buf + 1, :, lo:hi].to(q.dtype)), 2)
            out[b:b + 1, :, t:t + 1] = F.scaled_dot_product_attention(q[b:b + 1, :, t:t + 1], k, v, enable_gqa=True)
    return out
