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
from selfspec.quant.rotation import BlockHadamard

STORAGES = ("dense", "int8", "int4", "int4g", "planes")


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


def unpack_nibbles(p: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] values in 0..15 as `dtype`. Each half is written straight into its slots of
    the result: on the CPU, stacking the halves cost as much as the rest of the dequantization."""
    out = torch.empty(*p.shape, 2, dtype=dtype, device=p.device)
    out[..., 0] = p & 15  # computed in uint8, cast on the copy: CUDA has no bitwise ops in float
    out[..., 1] = p >> 4
    return out.flatten(-2)


def affine_dequant_(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """In place: float32 codes q [N, K] -> w = lo + scale * q, group-wise along K; scale/lo [N, K/g].

    In place because on the CPU fresh [N, K] temporaries cost more than the arithmetic. The rounding is a
    float32 multiply, then a float32 add (no fused multiply-add): what every kernel reproduces."""
    n, k = q.shape
    q.view(n, scale.shape[1], -1).mul_(scale[..., None]).add_(lo[..., None])
    return q


def group_major(t: torch.Tensor) -> torch.Tensor:
    """t [N, G] stored group by group (strides (1, N)): a GEMM tile reads one group's values for a run of
    adjacent rows, which then lie side by side in memory."""
    return t.t().contiguous().t()


def minmax_quant(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per group: returns (q uint8 [N, K], scale [N, G], lo [N, G]), scale and lo
    group-major, float32, on a grid where every w = lo + scale * q is exact in float32 and rounds once to bf16: the
    value a bf16 fused multiply-add gives, which the GPU kernels dequantize with (`fma_grid`): 4 bits, scale and
    lo - 16 scale bf16 values; 8 bits, scale and lo + 128 scale."""
    n, k = w.shape
    wg = w.float().view(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    qmax = 2**bits - 1
    scale, lo = fma_grid(lo, hi, qmax, -16 if bits == 4 else 128)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, qmax)
    return q.view(n, k).to(torch.uint8), group_major(scale), group_major(lo)


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance between bf16 values at x's magnitude (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def fma_grid(lo: torch.Tensor, hi: torch.Tensor, qmax: int, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, lo) covering [lo, hi] in qmax steps with the scale and lo + at * scale bf16 values: the GPU builds a
    code as a bf16 c that is q - at times a power of two, and one bf16 fused multiply-add c * scale' + (lo + at *
    scale) gives the weight, with nothing subtracted first. INT8 planes: at = 128, c = q8 - 128 (`full`'s decode:
    one instruction per two weights less). INT4: at = -16, c = 1 + q / 16 (the nibble under the bits of 1.0) times
    16 scale. lo + at * scale is the bf16 nearest to where the grid centres the range (code qmax / 2 at its middle),
    on a multiple of 2^(e - 9) (e: the scale's exponent), so lo + scale * q spans at most 19 bits and stays exact in
    float32 (the scale at least 2^-10 |lo|); where that rounding leaves an end of the range more than half a step
    out, the scale grows by a bf16 step until none does (no group of SmolLM2's weights needed it). Centring the
    range's slack, not flooring the offset, took 3% off the INT8 squared error of SmolLM2's weights; for INT4 it
    costs 0.12% against bf16 offsets floored and the 128 subtracted on the GPU (docs/bench-cpu/int4_grid_error.py)."""
    span, centre = hi - lo, (lo + hi) / 2
    s0 = torch.maximum(span / qmax, lo.abs() * 2.0**-10).clamp_min(1e-10)
    scale = torch.round(s0 / bf16_spacing(s0)) * bf16_spacing(s0)
    for _ in range(1024):  # a scale too small grows a bf16 step a round: a few rounds at most in practice
        ideal = centre + (at - qmax / 2) * scale  # lo + at * scale with the range centred
        step = torch.maximum(torch.exp2(torch.floor(torch.log2(scale)) - 9), bf16_spacing(ideal))
        low = torch.round(ideal / step) * step - at * scale
        covered = (low <= lo + scale / 2) & (low + qmax * scale >= hi - scale / 2)
        if covered.all():
            return scale, low
        scale = torch.where(covered, scale, scale + bf16_spacing(scale))
    raise SelfspecError("fma_grid: no scale covered a group's range")  # not reached: a scale grows each round


class QuantWeight(nn.Module):
    """Base: a stored weight [out_features, in_features] and the modes it can run.

    `rotation` (None, or a BlockHadamard shared with other weights): the weight is stored as quantize(W H),
    and every mode rotates its activations by the same H before the product (kernels/ops.py::linear)."""

    storage: str

    def __init__(self):
        super().__init__()
        self.rotation: BlockHadamard | None = None

    def supports(self, mode: Mode) -> bool:
        return storage_supports(self.storage, mode)

    def dequantize(self, mode: Mode) -> torch.Tensor:
        """The float weight that `mode` computes with (the reference semantics of every kernel)."""
        raise NotImplementedError

    def for_mode(self, mode: Mode) -> QuantWeight:
        """The stored weight `mode` reads: this one, but for a format that keeps one copy per mode."""
        return self

    def check(self, mode: Mode) -> None:
        if not self.supports(mode):
            raise SelfspecError(f"stored format '{self.storage}' cannot run mode '{mode.name}'")

    def nbytes(self) -> int:
        """Bytes of this weight's own tensors; a shared rotation is counted once, by the model."""
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))

    def nbytes_read(self, mode: Mode) -> int:
        """Bytes a product in `mode` reads: all of them, but for the planes' 4-bit view (below)."""
        return self.nbytes()


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
        return affine_dequant_(unpack_nibbles(self.packed, torch.float32), self.scale, self.lo)


class Int4IntScaleWeight(QuantWeight):
    """INT4 codes whose group scales are integers over a per-channel INT8 grid (QServe's progressive group
    quantization): w = s[n] * w8 with w8 = s2 * (q - z) an integer in [-127, 127], q the 4-bit code, s2 (1..16)
    and z (0..15) integers per group. A group's weights are then INT8 codes of one channel scale, so with int8
    activations the int32 dot runs over all of K and is exact (no group affine per K tile, any tiling the same
    bits) and the scale comes once an output; with bf16 activations w8 is exact in bf16 and the channel scale
    comes after the sum too. The INT8 grid is 119 steps a side so that a group's step rounding stays within int8."""

    storage = "int4g"

    def __init__(self, w: torch.Tensor, group_size: int = 128):
        super().__init__()
        self.group_size = fit_group_size(w.shape[1], group_size)
        q, group, scale = int_scale_quant(w, self.group_size)
        self.register_buffer("packed", pack_nibbles(q))
        self.register_buffer("group", group)  # int32 [N, G] group-major: s2 | (z * s2) << 8
        self.register_buffer("scale", scale)  # float32 [N]
        self.shape = tuple(w.shape)

    def int8_codes(self) -> torch.Tensor:
        """w8 = s2 * q - z * s2 as float32 [N, K] (exact integers)."""
        n, k = self.shape
        q = unpack_nibbles(self.packed, torch.float32).view(n, self.group.shape[1], -1)
        s2 = (self.group & 0xFF).float()[..., None]
        zs = (self.group >> 8).float()[..., None]
        return (q * s2 - zs).view(n, k)

    def dequantize(self, mode: Mode) -> torch.Tensor:
        return self.int8_codes() * self.scale[:, None]


def int_scale_quant(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4IntScaleWeight's codes: (q uint8 [N, K], group int32 [N, G] group-major packing s2 | (z * s2) << 8,
    scale float32 [N]). Per channel the INT8 grid scale = max|w| / 119; per group the step s2 (1..16) and zero z
    (0..15) of least squared error against w / scale among s2 = ceil(range / 15) (the range on the grid, widened to
    hold 0) or one less, and z = round(-min / s2) or one either side, with every s2 (q - z) inside [-127, 127]
    (ceil and round always are: within s2 / 2 <= 8 of a range inside [-119, 119]); q = round(w8 / s2) + z clamped
    to 0..15, w8 the weight rounded to the grid. The search took SmolLM2's squared error from 1.39x int4's to 1.17x
    (1.01x on its groups of 128; docs/gpu.md, session 27)."""
    n, k = w.shape
    scale = (w.float().abs().amax(1) / 119).clamp_min(1e-10)
    exact = (w.float() / scale[:, None]).view(n, k // group_size, group_size)
    w8 = exact.round().clamp(-119, 119)
    lo, hi = w8.amin(-1).clamp(max=0), w8.amax(-1).clamp(min=0)  # codes q - z span 0: so does the range
    ceil = ((hi - lo) / 15).ceil().clamp(1, 16)
    best = None
    for s2 in (ceil, (ceil - 1).clamp(min=1)):
        for dz in (0, -1, 1):
            z = ((-lo / s2).round() + dz).clamp(0, 15)
            q = ((w8 / s2[..., None]).round() + z[..., None]).clamp(0, 15)
            r = s2[..., None] * (q - z[..., None])
            err = ((r - exact) ** 2).sum(-1).masked_fill((r.abs() > 127).any(-1), float("inf"))
            if best is None:
                best = (err, q, s2, z)
            else:
                take = err < best[0]
                best = (torch.minimum(err, best[0]), torch.where(take[..., None], q, best[1]),
                        torch.where(take, s2, best[2]), torch.where(take, z, best[3]))
    _, q, s2, z = best
    group = s2.to(torch.int32) | ((z * s2).to(torch.int32) << 8)
    return q.reshape(n, k).to(torch.uint8), group_major(group), scale


class Int8PlanesWeight(QuantWeight):
    """Group-wise asymmetric INT8 stored as an upper and a lower 4-bit plane.

    On the CPU the same codes are held as one [N, K] uint8 tensor `q8` in their place (one copy either way, the
    same bytes): the CPU kernels combine no planes then, and the upper plane is q8 >> 4. Each row holds every
    even k, then every odd k (the K order of the CPU kernels), and the group scales and offsets are kept again
    as `scale2`/`lo2` [N, 2G] contiguous, once for each half of the row. Moving the weight (`.to`) switches to
    the layout of the device it lands on: the GPU kernels read the planes."""

    storage = "planes"

    def __init__(self, w: torch.Tensor, group_size: int = 128):
        super().__init__()
        self.group_size = fit_group_size(w.shape[1], group_size)
        q8, scale, lo = minmax_quant(w, 8, self.group_size)
        self.register_buffer("scale", scale)
        self.register_buffer("lo", lo)
        self.shape = tuple(w.shape)
        self.store(q8)

    @property
    def cpu_layout(self) -> bool:
        return "q8" in self._buffers

    def store(self, q8: torch.Tensor) -> None:
        """Hold the codes q8 [N, K] (natural k order) in the layout of their device, dropping the other one."""
        for name in ("upper", "lower", "q8", "scale2", "lo2"):
            self._buffers.pop(name, None)
        if q8.device.type == "cpu":
            self.register_buffer("q8", permute_k(q8))
            self.register_buffer("scale2", doubled(self.scale), persistent=False)
            self.register_buffer("lo2", doubled(self.lo), persistent=False)
        else:
            self.register_buffer("upper", pack_nibbles(q8 >> 4))
            self.register_buffer("lower", pack_nibbles(q8 & 15))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cpu_layout != (self.scale.device.type == "cpu"):
            self.store(self.int8_codes(torch.uint8))
        return self

    def nbytes_read(self, mode: Mode) -> int:
        """The 4-bit view reads the upper plane (and the scales) only: the point of the format. The CPU layout
        reads every code byte and the doubled scales in every mode."""
        if self.cpu_layout:
            return self.nbytes() - 2 * self.scale.numel() * self.scale.element_size()
        return self.nbytes() - (self.lower.numel() if mode.weight_bits == 4 else 0)

    def upper_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, lo) of the upper plane read alone as an INT4 weight."""
        return upper_affine(self.scale, self.lo)

    def dequantize(self, mode: Mode) -> torch.Tensor:
        if mode.weight_bits == 4:
            return affine_dequant_(self.upper_codes(), *self.upper_affine())
        return affine_dequant_(self.int8_codes(), self.scale, self.lo)

    def planes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed (upper, lower) planes, as stored or (CPU layout) as they would be."""
        if self.cpu_layout:
            q8 = unpermute_k(self.q8)
            return pack_nibbles(q8 >> 4), pack_nibbles(q8 & 15)
        return self.upper, self.lower

    def upper_codes(self) -> torch.Tensor:
        """q8 >> 4 as float32 [N, K]."""
        if self.cpu_layout:
            return unpermute_k(self.q8 >> 4).float()
        return unpack_nibbles(self.upper, torch.float32)

    def int8_codes(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q8 = 16 * upper + lower as `dtype` [N, K]. From the planes, combined byte-wise on the packed planes
        (half the elements) and written straight into the interleaved result, as `unpack_nibbles` does."""
        if self.cpu_layout:
            return unpermute_k(self.q8).to(dtype)
        q8 = torch.empty(*self.upper.shape, 2, dtype=dtype, device=self.upper.device)
        q8[..., 0] = (self.upper << 4) | (self.lower & 15)  # even k; uint8 << 4 drops the high nibble
        q8[..., 1] = (self.upper & 0xF0) | (self.lower >> 4)  # odd k: the high nibbles
        return q8.flatten(-2)


def upper_affine(scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, lo) of the INT8 codes' upper nibbles read as INT4 codes: 16 s, and about lo + 7.5 s (the midpoint of
    the lower nibble's range, which makes the truncation round-to-nearest): that rounded to bf16, less 256 s (16 times
    the upper scale) rounded to bf16 again, plus 256 s, so that lo - 16 (16 s) is the bf16 value the kernels' fused
    multiply-add of the codes 1 + q / 16 takes (as `fma_grid`'s INT4; within a sixteenth of an upper step of the
    midpoint: +2% squared error on SmolLM2, drafts only)."""
    midpoint = (lo + scale * 7.5).bfloat16().float()
    return scale * 16, (midpoint - scale * 256).bfloat16().float() + scale * 256


def permute_k(t: torch.Tensor) -> torch.Tensor:
    """t [M, K] in the CPU kernels' K order: every even k, then every odd k."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), 1)


def unpermute_k(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `permute_k`."""
    m, k = t.shape
    return t.view(m, 2, k // 2).transpose(1, 2).reshape(m, k)


def doubled(t: torch.Tensor) -> torch.Tensor:
    """Group-wise [N, G] -> [N, 2G] contiguous, once for each half of the permuted K order."""
    return torch.cat((t, t), 1)


class DenseAndInt4Weight(QuantWeight):
    """QuantSpec's weights: the dense weight for verify and a second, INT4 copy (a quarter of bf16's bytes) for
    the draft. The one format here that stores two copies; `for_mode` hands the kernels the one a mode reads."""

    storage = "dense+int4"

    def __init__(self, w: torch.Tensor, group_size: int):
        super().__init__()
        self.dense = DenseWeight(w)
        self.int4 = Int4Weight(w, group_size)
        self.shape = tuple(w.shape)

    def for_mode(self, mode: Mode) -> QuantWeight:
        self.check(mode)
        return self.dense if mode.dense else self.int4

    def dequantize(self, mode: Mode) -> torch.Tensor:
        return self.for_mode(mode).dequantize(mode)

    def nbytes(self) -> int:
        return self.dense.nbytes() + self.int4.nbytes()


def quantize_weight(w: torch.Tensor, storage: str, group_size: int = 128,
                    rotations: dict[int, BlockHadamard] | None = None) -> QuantWeight:
    """Store w [N, K] in a format. With `rotations` (a model's shared rotations by block order, filled as
    needed; None: no rotation), store w H instead, H block-diagonal Hadamard with blocks of the group size."""
    rotation = None
    if rotations is not None:
        block = fit_group_size(w.shape[1], group_size)
        if block not in rotations:
            rotations[block] = BlockHadamard(block).to(w.device)  # where the weights are (GPU-built models)
        rotation = rotations[block]
        w = rotation(w)
    if storage == "dense":
        qw = DenseWeight(w)
    elif storage == "int8":
        qw = Int8Weight(w)
    elif storage == "int4":
        qw = Int4Weight(w, group_size)
    elif storage == "int4g":
        qw = Int4IntScaleWeight(w, group_size)
    elif storage == "planes":
        qw = Int8PlanesWeight(w, group_size)
    elif storage == "dense+int4":
        qw = DenseAndInt4Weight(w, group_size)
    else:
        raise SelfspecError(f"unknown storage '{storage}'; choose one of: {', '.join(STORAGES)}")
    qw.rotation = rotation
    return qw


def storage_supports(storage: str, mode: Mode) -> bool:
    """Whether a stored format can run a mode, without building a weight."""
    return {
        "dense": mode.dense,
        "int8": mode.weight_bits == 8 and not mode.planes_only,
        "int4": mode.weight_bits == 4 and not mode.planes_only,
        "int4g": mode.weight_bits == 4 and not mode.planes_only,
        "planes": mode.weight_bits in (4, 8),
        "dense+int4": mode.dense or mode.weight_bits == 4 and not mode.planes_only,
    }[storage]
