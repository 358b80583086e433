"""Quantized KV cache (QuantSpec): quantized groups of G tokens plus a full-precision buffer of the recent ones.

One copy serves both modes: a draft reads the upper INT4 plane of a hierarchical (`hier`) cache, verify both
planes (INT8); an `int8` cache reads the same either way. Keys are quantized per channel over each group of G
tokens, values per token (quant/kv.py).

Which keys a query reads quantized depends on its position alone: a query at position p reads positions below
`quantized_below(p)` = G * max(0, p // G - 1) from the quantized groups and the rest (between G + 1 and 2G keys,
itself included) at full precision. So a token's logits are the same bits whether it is computed in a verify pass
of several tokens, a plain decoding step or a prefill chunk: greedy speculative decoding equals greedy AR.

The double buffer (`commit`): the buffer holds the previous group (its first half) and the current one (its
second half, where new tokens go) plus room for one pass of up to G tokens past the committed length (drafts,
which verify overwrites: a rejected token is dropped from the buffer only, never quantized). After a prefill,
at least G and fewer than 2G committed tokens stay full precision. When a commit completes the second half, it is
quantized and appended to the groups, the first half dropped and the second moved down: the groups hold every
completed group of committed tokens, and the buffer keeps the last one at full precision until the next group
completes (queries past it read it quantized). This repeats for any length of generation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.cache.kv import LayerKV
from selfspec.errors import SelfspecError
from selfspec.quant.kv import check_kv_format, dequantize_hier, dequantize_int8, quantize_hier, quantize_int8

BUFFER_GROUPS = 3  # first half, second half, and one pass of up to G tokens past the second half


def quantized_below(pos: torch.Tensor, group: int) -> torch.Tensor:
    """Positions [...] -> how many leading keys each query reads quantized: G * max(0, p // G - 1)."""
    return group * (pos // group - 1).clamp_min(0)


@dataclass(frozen=True)
class QuantLayer:
    """One layer's quantized groups. Code planes [B, Hkv, S, D] (int8) or, for hier, the upper and lower INT4
    planes [B, Hkv, S, D/2] (two codes a byte); float16 key scales/zeros [B, Hkv, S/G, D] (per channel and group),
    value scales/zeros [B, Hkv, S, 1] (per token). `start`: the position of the buffer's first slot."""
    fmt: str
    group: int
    keys: tuple[torch.Tensor, ...]
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    values: tuple[torch.Tensor, ...]
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    start: int

    def dequantize(self, n: int, upper: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..n-1 (n a multiple of G) as float32 [B, Hkv, n, D]: the upper plane
        alone where `upper` and the cache is hierarchical, else the INT8 values."""
        b, h, g = self.k_scale.shape[0], self.k_scale.shape[1], self.group
        keys = tuple(p[:, :, :n].reshape(b, h, n // g, g, p.shape[-1]) for p in self.keys)
        k = self.planes(keys, self.k_scale[:, :, :n // g, None], self.k_zero[:, :, :n // g, None], upper)
        v = self.planes(tuple(p[:, :, :n] for p in self.values), self.v_scale[:, :, :n], self.v_zero[:, :, :n],
                        upper)
        return k.reshape(b, h, n, v.shape[-1]), v

    def planes(self, codes: tuple[torch.Tensor, ...], scale: torch.Tensor, zero: torch.Tensor,
               upper: bool) -> torch.Tensor:
        if self.fmt == "int8":
            return dequantize_int8(codes[0], scale, zero)
        return dequantize_hier(codes[0], None if upper else codes[1], scale, zero)


class QuantKVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, fmt: str, group: int):
        check_kv_format(fmt, group)
        if fmt == "bf16":
            raise SelfspecError("a bf16 KV cache is the plain KVCache; QuantKVCache holds int8 or hier")
        if fmt == "hier" and head_dim % 2:
            raise SelfspecError(f"a hier KV cache packs two channels a byte: head_dim must be even, got {head_dim}")
        self.fmt, self.group, self.max_len = fmt, group, max_len
        s = -(-max_len // group) * group
        lead = (n_layers, batch, n_kv_heads)
        self.k = torch.zeros(*lead, BUFFER_GROUPS * group, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        width = head_dim if fmt == "int8" else head_dim // 2
        n_planes = 1 if fmt == "int8" else 2
        self.k_planes = [torch.zeros(*lead, s, width, dtype=torch.uint8, device=device) for _ in range(n_planes)]
        self.v_planes = [torch.zeros_like(p) for p in self.k_planes]
        self.k_scale = torch.zeros(*lead, s // group, head_dim, dtype=torch.float16, device=device)
        self.k_zero = torch.zeros_like(self.k_scale)
        self.v_scale = torch.zeros(*lead, s, 1, dtype=torch.float16, device=device)
        self.v_zero = torch.zeros_like(self.v_scale)
        self.table = torch.arange(batch, device=device)[:, None]
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
        lo, hi = int(pos.min()), int(pos.max())
        if lo < self.start or hi >= self.start + self.block_size:
            raise SelfspecError(
                f"a pass over positions {lo}..{hi} does not fit the KV buffer (positions {self.start}.."
                f"{self.start + self.block_size - 1}): a pass may write at most {self.group} tokens (the KV group "
                f"size) past the committed length; draft fewer tokens (gamma < {self.group}) or use a larger group")
        return self.table * self.block_size + pos - self.start

    def layer(self, layer: int) -> LayerKV:
        quant = QuantLayer(self.fmt, self.group, tuple(p[layer] for p in self.k_planes), self.k_scale[layer],
                           self.k_zero[layer], tuple(p[layer] for p in self.v_planes), self.v_scale[layer],
                           self.v_zero[layer], self.start)
        return LayerKV(self.k[layer], self.v[layer], self.table, quant)

    def commit(self, length: int) -> None:
        """Keep positions 0..length-1 (later ones are dropped from the buffer); quantize every group the committed
        tokens complete, and move the buffer down to start at the previous group."""
        if length == 0:  # emptied for reuse
            self.quantized = self.start = 0
        if length < self.quantized:
            raise SelfspecError(f"cannot roll back to {length} tokens: positions below {self.quantized} are "
                                "already quantized")
        self.length = length
        g = self.group
        while self.quantized + g <= length:
            self.quantize_group(self.quantized)
            self.quantized += g
        start = int(quantized_below(torch.tensor(length), g))
        if start > self.start:
            shift = start - self.start
            self.k[..., :-shift, :] = self.k[..., shift:, :].clone()
            self.v[..., :-shift, :] = self.v[..., shift:, :].clone()
            self.start = start

    def quantize_group(self, first: int) -> None:
        """Quantize positions first..first+G-1 (in the buffer) into the groups, every layer at once."""
        g, at = self.group, first - self.start
        k, v = self.k[..., at:at + g, :], self.v[..., at:at + g, :]
        if self.fmt == "int8":
            kq, ks, kz = quantize_int8(k, -2)
            vq, vs, vz = quantize_int8(v, -1)
            k_codes, v_codes = (kq,), (vq,)
        else:
            *k_codes, ks, kz = quantize_hier(k, -2)
            *v_codes, vs, vz = quantize_hier(v, -1)
        for plane, codes in zip(self.k_planes, k_codes):
            plane[..., first:first + g, :] = codes
        for plane, codes in zip(self.v_planes, v_codes):
            plane[..., first:first + g, :] = codes
        self.k_scale[..., first // g, :], self.k_zero[..., first // g, :] = ks[..., 0, :], kz[..., 0, :]
        self.v_scale[..., first:first + g, :], self.v_zero[..., first:first + g, :] = vs, vz

    def nbytes(self) -> int:
        tensors = [self.k, self.v, *self.k_planes, *self.v_planes, self.k_scale, self.k_zero, self.v_scale,
                   self.v_zero]
        return sum(t.numel() * t.element_size() for t in tensors)
