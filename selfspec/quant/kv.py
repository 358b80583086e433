"""KV cache quantizers (torch references): asymmetric INT8 and the hierarchical INT8 of two INT4 planes.

Keys are quantized per channel over groups of G tokens (their outliers sit in fixed channels), values per token
(over the head dim): `dim` names the axis a scale and zero are shared along.

- `int8`: q = round((x - zero) / scale) in 0..255, x ~ zero + scale * q.
- `hier`: an upper INT4 plane u = round((x - zero) / s) in 0..15 (asymmetric, its own scale s and zero) and a lower
  INT4 plane l = round((x - zero - s u) / (s / 16)) in -8..7 (the signed residual at s / 16). The upper plane
  alone is a valid INT4 cache (x ~ zero + s u, error <= s / 2); both are an INT8 one (x ~ zero + s u + s / 16 l,
  error <= s / 32 but where the residual rounds to +8 and is clipped to 7: there s / 16).

Scales and zeros are stored in float16 and the codes computed against the stored values: the zero is rounded
down and the scale up, so no value falls outside the code range. Both planes hold two codes per byte (even
channel in the low nibble), so a hierarchical cache takes one byte per element, as INT8 does.
"""
from __future__ import annotations

import torch

from selfspec.errors import SelfspecError

KV_FORMATS = ("bf16", "int8", "hier")
SMALLEST_SCALE = 2.0 ** -14  # float16's smallest normal: a constant run of values still divides by a nonzero scale


def check_kv_format(fmt: str, group: int = 128) -> None:
    if fmt not in KV_FORMATS:
        raise SelfspecError(f"unknown KV cache format '{fmt}'; choose one of: {', '.join(KV_FORMATS)}")
    if group < 1:
        raise SelfspecError(f"the KV quantization group must be at least 1 token, got {group}")


def scale_and_zero(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) along `dim` (kept) with zero <= min(x) and zero + levels * scale >= max(x)."""
    lo, hi = x.float().amin(dim, keepdim=True), x.float().amax(dim, keepdim=True)
    zero = lo.half()
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -torch.inf)), zero)
    scale = ((hi - zero.float()) / levels).clamp_min(SMALLEST_SCALE).half()
    short = scale.float() * levels < hi - zero.float()
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    return scale, zero


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] in 0..15 -> [..., D/2] uint8, even channel in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] uint8 -> codes [..., D] uint8."""
    return torch.stack((packed & 0x0F, packed >> 4), -1).flatten(-2)


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> (codes uint8 like x, scale, zero float16 [x with `dim` of size 1])."""
    scale, zero = scale_and_zero(x, dim, 255)
    q = ((x.float() - zero.float()) / scale.float()).round().clamp(0, 255)
    return q.to(torch.uint8), scale, zero


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return zero.float() + scale.float() * q.float()


def quantize_hier(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (upper plane, lower plane) [..., D/2] uint8 packed, and float16 (scale, zero) of the upper
    plane; the lower plane's scale is scale / 16, its codes stored offset by 8."""
    scale, zero = scale_and_zero(x, dim, 15)
    s, z = scale.float(), zero.float()
    upper = ((x.float() - z) / s).round().clamp(0, 15)
    lower = ((x.float() - z - s * upper) / (s / 16)).round().clamp(-8, 7)
    return pack_nibbles(upper), pack_nibbles(lower + 8), scale, zero


def dequantize_hier(upper: torch.Tensor, lower: torch.Tensor | None, scale: torch.Tensor,
                    zero: torch.Tensor) -> torch.Tensor:
    """float32 values from the upper plane alone (lower None: the INT4 cache) or from both planes (INT8)."""
    s = scale.float()
    x = zero.float() + s * unpack_nibbles(upper).float()
    if lower is None:
        return x
    return x + (s / 16) * (unpack_nibbles(lower).float() - 8)
