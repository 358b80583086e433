"""Quantized KV cache (QuantSpec): quantized groups of G tokens plus a full-precision buffer of the recent ones.

One copy serves both modes: a draft reads the upper INT4 plane of a hierarchical (`hier`) cache, verify both
planes (INT8); an `int8` cache reads the same either way. Keys are quantized per channel over each group of G
tokens, values per token (quant/kv.py).

Which keys a query reads quantized depends on its position alone: a query at position p reads positions below
`quantized_below(p)` = G * max(0, p // G - 1) from the quantized groups and the rest (between G + 1 and 2G keys,
itself included) at full precision. So a token's logits are the same bits whether it is computed in a verify pass
of several tokens, a plain decoding step or a prefill chunk: greedy speculative decoding equals greedy AR.

The double buffer (`settle`: each row's commit, in the contiguous cache of solo decoding here as in the paged cache
of the serving engine, cache/paged_quant.py): the buffer holds the previous group (its first half) and the current
one (its second half, where new tokens go) plus room for one pass of up to G tokens past the committed length
(drafts, which verify overwrites: a rejected token is dropped from the buffer only, never quantized). After a
prefill, at least G and fewer than 2G committed tokens stay full precision. When a commit completes the second half,
it is quantized and appended to the groups, the first half dropped and the second moved down: the groups hold every
completed group of committed tokens, and the buffer keeps the last one at full precision until the next group
completes (queries past it read it quantized). This repeats for any length of generation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from selfspec.cache.kv import LayerKV
from selfspec.cache.paged import gather_blocks
from selfspec.errors import SelfspecError
from selfspec.quant.kv import check_kv_format, dequantize_hier, dequantize_int8, quantize_hier, quantize_int8

BUFFER_GROUPS = 3  # first half, second half, and one pass of up to G tokens past the second half


def quantized_below(pos: torch.Tensor, group: int) -> torch.Tensor:
    """Positions [...] -> how many leading keys each query reads quantized: G * max(0, p // G - 1)."""
    return group * (pos // group - 1).clamp_min(0)


@dataclass(frozen=True)
class QuantLayer:
    """One layer's quantized groups, in blocks of bs positions (bs a multiple of G) that each row reads through its
    block table, as the paged bf16 pools are read (a contiguous cache: one block of S positions per row). Code
    planes [N, Hkv, bs, D] (int8) or, for hier, the upper and lower INT4 planes [N, Hkv, bs, D/2] (two codes a
    byte); float16 key scales/zeros [N, Hkv, bs/G, D] (per channel and group), value scales/zeros [N, Hkv, bs, 1]
    (per token). table [B, W]: each row's blocks in position order; start [B]: the position of each row's buffer
    slot 0."""
    fmt: str
    group: int
    keys: tuple[torch.Tensor, ...]
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    values: tuple[torch.Tensor, ...]
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    table: torch.Tensor
    start: torch.Tensor

    def dequantize(self, n: int, upper: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values of positions 0..n-1 (n a multiple of G) as float32 [B, Hkv, n, D]: the upper
        plane alone where `upper` and the cache is hierarchical, else the INT8 values."""
        g, table = self.group, self.table[:, :-(-n // self.keys[0].shape[2])]

        def rows(pool: torch.Tensor, length: int) -> torch.Tensor:
            return gather_blocks(pool, table)[:, :, :length]

        keys = tuple(rows(p, n) for p in self.keys)
        b, h, width = keys[0].shape[0], keys[0].shape[1], keys[0].shape[-1]
        keys = tuple(k.reshape(b, h, n // g, g, width) for k in keys)
        k = self.planes(keys, rows(self.k_scale, n // g)[:, :, :, None], rows(self.k_zero, n // g)[:, :, :, None],
                        upper)
        v = self.planes(tuple(rows(p, n) for p in self.values), rows(self.v_scale, n), rows(self.v_zero, n), upper)
        return k.reshape(b, h, n, v.shape[-1]), v

    def planes(self, codes: tuple[torch.Tensor, ...], scale: torch.Tensor, zero: torch.Tensor,
               upper: bool) -> torch.Tensor:
        if self.fmt == "int8":
            return dequantize_int8(codes[0], scale, zero)
        return dequantize_hier(codes[0], None if upper else codes[1], scale, zero)


class QuantPools:
    """Every layer's quantized groups, in n_blocks blocks of block_size positions (a multiple of G): the storage
    of QuantLayer, shared by the contiguous cache (a block per row) and the paged one (cache/paged_quant.py)."""

    def __init__(self, n_layers: int, n_blocks: int, n_kv_heads: int, block_size: int, head_dim: int,
                 device: torch.device | str, fmt: str, group: int):
        check_kv_format(fmt, group)
        if fmt == "bf16":
            raise SelfspecError("a bf16 KV cache is the plain KVCache; a quantized one holds int8 or hier")
        if fmt == "hier" and head_dim % 2:
            raise SelfspecError(f"a hier KV cache packs two channels a byte: head_dim must be even, got {head_dim}")
        if block_size % group:
            raise SelfspecError(f"a quantized KV block holds whole groups: block size {block_size} is not a "
                                f"multiple of the KV group {group}")
        self.fmt, self.group = fmt, group
        lead = (n_layers, n_blocks, n_kv_heads)
        width = head_dim if fmt == "int8" else head_dim // 2
        n_planes = 1 if fmt == "int8" else 2
        self.k_planes = [torch.zeros(*lead, block_size, width, dtype=torch.uint8, device=device)
                         for _ in range(n_planes)]
        self.v_planes = [torch.zeros_like(p) for p in self.k_planes]
        self.k_scale = torch.zeros(*lead, block_size // group, head_dim, dtype=torch.float16, device=device)
        self.k_zero = torch.zeros_like(self.k_scale)
        self.v_scale = torch.zeros(*lead, block_size, 1, dtype=torch.float16, device=device)
        self.v_zero = torch.zeros_like(self.v_scale)

    def store(self, k: torch.Tensor, v: torch.Tensor, blocks: slice, offset: int) -> None:
        """Quantize one group of keys and values [L, b, Hkv, G, D] (every layer, b rows) into `blocks` (b of them)
        at positions offset..offset+G-1 of each (offset a multiple of G)."""
        g = self.group
        if self.fmt == "int8":
            kq, ks, kz = quantize_int8(k, -2)
            vq, vs, vz = quantize_int8(v, -1)
            k_codes, v_codes = (kq,), (vq,)
        else:
            *k_codes, ks, kz = quantize_hier(k, -2)
            *v_codes, vs, vz = quantize_hier(v, -1)
        at = slice(offset, offset + g)
        for plane, codes in zip(self.k_planes, k_codes):
            plane[:, blocks, :, at] = codes
        for plane, codes in zip(self.v_planes, v_codes):
            plane[:, blocks, :, at] = codes
        self.k_scale[:, blocks, :, offset // g], self.k_zero[:, blocks, :, offset // g] = ks[..., 0, :], kz[..., 0, :]
        self.v_scale[:, blocks, :, at], self.v_zero[:, blocks, :, at] = vs, vz

    def layer(self, layer: int, table: torch.Tensor, start: torch.Tensor) -> QuantLayer:
        return QuantLayer(self.fmt, self.group, tuple(p[layer] for p in self.k_planes), self.k_scale[layer],
                          self.k_zero[layer], tuple(p[layer] for p in self.v_planes), self.v_scale[layer],
                          self.v_zero[layer], table, start)

    def nbytes(self) -> int:
        tensors = [*self.k_planes, *self.v_planes, self.k_scale, self.k_zero, self.v_scale, self.v_zero]
        return sum(t.numel() * t.element_size() for t in tensors)


def settle(k: torch.Tensor, v: torch.Tensor, start: int, quantized: int, length: int, group: int,
           store: Callable[[torch.Tensor, torch.Tensor, int], None]) -> tuple[int, int]:
    """Commit positions 0..length-1 of one buffer k, v [L, b, Hkv, BUFFER_GROUPS * G, D] (slot 0 holds position
    `start`; positions below `quantized` are in the groups): every group the committed tokens complete goes to
    store(keys, values, its first position), then the buffer moves down to start at quantized_below(length).
    Later positions are dropped (rejected drafts leave the buffer only). -> the new (start, quantized)."""
    if length < quantized:
        raise SelfspecError(f"cannot roll back to {length} tokens: positions below {quantized} are already quantized")
    while quantized + group <= length:
        at = quantized - start
        store(k[..., at:at + group, :], v[..., at:at + group, :], quantized)
        quantized += group
    new_start = int(quantized_below(torch.tensor(length), group))
    if new_start > start:
        shift = new_start - start
        k[..., :-shift, :] = k[..., shift:, :].clone()
        v[..., :-shift, :] = v[..., shift:, :].clone()
    return max(start, new_start), quantized


def check_pass_fits(pos: torch.Tensor, start: torch.Tensor, slots: int, group: int) -> torch.Tensor:
    """Positions [B, T] -> their offsets in each row's buffer of `slots` slots whose slot 0 holds position start [B];
    refused where a pass runs past the buffer. Not checked while a CUDA graph captures the pass (the check reads the
    offsets on the host): a graph's pass has the tokens of the eager pass before its capture, which was checked,
    and any pass of at most G tokens past the committed length fits."""
    offset = pos - start[:, None]
    if pos.is_cuda and torch.cuda.is_current_stream_capturing():
        return offset
    outside = ((offset < 0) | (offset >= slots)).any(1)
    if outside.any():
        row = int(outside.nonzero()[0])
        lo, hi, first = int(pos[row].min()), int(pos[row].max()), int(start[row])
        raise SelfspecError(
            f"a pass over positions {lo}..{hi} does not fit the KV buffer (positions {first}..{first + slots - 1}): "
            f"a pass may write at most {group} tokens (the KV group size) past the committed length; draft fewer "
            f"tokens (gamma < {group}) or use a larger group")
    return offset


class QuantKVCache:
    """The contiguous quantized cache of solo decoding: every row at one length (a block of the groups per row)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, fmt: str, group: int):
        self.fmt, self.group, self.max_len = fmt, group, max_len
        s = -(-max_len // group) * group
        self.pools = QuantPools(n_layers, batch, n_kv_heads, s, head_dim, device, fmt, group)
        self.k = torch.zeros(n_layers, batch, n_kv_heads, BUFFER_GROUPS * group, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.table = torch.arange(batch, device=device)[:, None]
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)  # self.start, per row (what kernels read)
        self.length = 0  # positions 0..length-1 hold committed tokens' KV
        self.start = 0  # the position in the buffer's first slot
        self.quantized = 0  # positions 0..quantized-1 are in the groups

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def max_pass(self) -> int:
        """The most tokens one pass may write past the committed length (a prefill runs in chunks of this)."""
        return self.group

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions [B, T] -> buffer slots [B, T] (row b's buffer is block b)."""
        return self.table * self.block_size + check_pass_fits(pos, self.starts, self.block_size, self.group)

    def layer(self, layer: int) -> LayerKV:
        return LayerKV(self.k[layer], self.v[layer], self.table, self.pools.layer(layer, self.table, self.starts))

    def commit(self, length: int) -> None:
        """Keep positions 0..length-1 (later ones are dropped from the buffer); quantize every group the committed
        tokens complete, and move the buffer down to start at the previous group."""
        if length == 0:  # emptied for reuse
            self.quantized = self.start = 0
        self.start, self.quantized = settle(self.k, self.v, self.start, self.quantized, length, self.group,
                                            lambda k, v, first: self.pools.store(k, v, slice(None), first))
        self.starts.fill_(self.start)
        self.length = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + self.pools.nbytes()
