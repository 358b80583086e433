"""Stored weight formats. Each holds one copy of a linear's weight; every mode it supports reads that copy.

Integer formats are group-wise affine, w = lo + scale * q, with K split into groups of `group_size`.
The INT8-plane format stores q8 = 16 * upper + lower as two packed 4-bit planes: the upper plane alone
is an INT4 weight (scale 16*s, offset lo + 7.5*s: the midpoint of the lower plane's range, which makes
the truncation round-to-nearest), and both planes give the INT8 weight back exactly.
"""
from __future__ import annotations

import torch
from torch import nn

from selfspec.errors import SelfspecError
from selfspec.quant.modes import Mode

STORAGES = ("dense", "int8", "int4", "planes")


def fit_group_size(k: int, group_size: int) -> int:
    """The largest power-of-two group size <= group_size that divides k (576 = 9 x 64, say)."""
    g = group_size
    while g > 1 and k % g:
        g //= 2
    return g


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values in 0..15 -> [N, K/2] uint8, even k in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 values in 0..15."""
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)


def affine_dequant(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """w = lo + scale * q, group-wise along K; q [N, K], scale/lo [N, K/g]."""
    n, k = q.shape
    g = k // scale.shape[1]
    w = q.view(n, -1, g).float() * scale.float()[..., None] + lo.float()[..., None]
    return w.view(n, k)


def minmax_quant(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per group: returns (q uint8 [N, K], scale [N, G], lo [N, G])."""
    n, k = w.shape
    wg = w.float().view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-10)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, qmax)
    return q.view(n, k).to(torch.uint8), scale, lo


class QuantWeight(nn.Module):
    """Base: a stored weight [out_features, in_features] and the modes it can run."""

    storage: str

    def supports(self, mode: Mode) -> bool:
        return storage_supports(self.storage, mode)

    def dequantize(self, mode: Mode) -> torch.Tensor:
        """The float weight that `mode` computes with (the reference semantics of every kernel)."""
        raise NotImplementedError

    def check(self, mode: Mode) -> None:
        if not self.supports(mode):
            raise SelfspecError(f"stored format '{self.storage}' cannot run mode '{mode.name}'")

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class DenseWeight(QuantWeight):
    storage = "dense"

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", w)
        self.shape = tuple(w.shape)


    def dequantize(self, mode: Mode) -> torch.Tensor:
        return self.weight


class Int8Weight(QuantWeight):
    """Per-channel symmetric INT8."""

    storage = "int8"

    def __init__(self, w: torch.Tensor):
        super().__init__()
        scale = (w.float().abs().amax(1) / 127).clamp_min(1e-10)
        self.register_buffer("q", (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.shape = tuple(w.shape)


    def dequantize(self, mode: Mode) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


class Int4Weight(QuantWeight):
    """Group-wise asymmetric INT4, two values per byte."""

    storage = "int4"

    def __init__(self, w: torch.Tensor, group_size: int = 128):
        super().__init__()
        self.group_size = fit_group_size(w.shape[1], group_size)
        q, scale, lo = minmax_quant(w, 4, self.group_size)
        self.register_buffer("packed", pack_nibbles(q))
        self.register_buffer("scale", scale)
        self.register_buffer("lo", lo)
        self.shape = tuple(w.shape)


    def dequantize(self, mode: Mode) -> torch.Tensor:
        return affine_dequant(unpack_nibbles(self.packed), self.scale, self.lo)


class Int8PlanesWeight(QuantWeight):
    """Group-wise asymmetric INT8 stored as an upper and a lower 4-bit plane."""

    storage = "planes"

    def __init__(self, w: torch.Tensor, group_size: int = 128):
        super().__init__()
        self.group_size = fit_group_size(w.shape[1], group_size)
        q8, scale, lo = minmax_quant(w, 8, self.group_size)
        self.register_buffer("upper", pack_nibbles(q8 >> 4))
        self.register_buffer("lower", pack_nibbles(q8 & 15))
        self.register_buffer("scale", scale)
        self.register_buffer("lo", lo)
        self.shape = tuple(w.shape)


    def upper_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, lo) of the upper plane read alone as an INT4 weight."""
        return self.scale * 16, self.lo + self.scale * 7.5

    def dequantize(self, mode: Mode) -> torch.Tensor:
        upper = unpack_nibbles(self.upper)
        if mode.weight_bits == 4:
            return affine_dequant(upper, *self.upper_affine())
        q8 = (upper.to(torch.int16) << 4) | unpack_nibbles(self.lower)
        return affine_dequant(q8, self.scale, self.lo)


def quantize_weight(w: torch.Tensor, storage: str, group_size: int = 128) -> QuantWeight:
    if storage == "dense":
        return DenseWeight(w)
    if storage == "int8":
        return Int8Weight(w)
    if storage == "int4":
        return Int4Weight(w, group_size)
    if storage == "planes":
        return Int8PlanesWeight(w, group_size)
    raise SelfspecError(f"unknown storage '{storage}'; choose one of: {', '.join(STORAGES)}")


def storage_supports(storage: str, mode: Mode) -> bool:
    """Whether a stored format can run a mode, without building a weight."""
    return {
        "dense": mode.dense,
        "int8": mode.weight_bits == 8 and not mode.planes_only,
        "int4": mode.weight_bits == 4 and not mode.planes_only,
        "planes": mode.weight_bits in (4, 8),
    }[storage]
