"""Triton row-wise ops: rms_norm, rope (rotate-half), swiglu. One program per row (or elementwise): a row's
output never depends on how many rows there are."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from selfspec.kernels import register
from selfspec.kernels.launch import launch_options, start, wait


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start(PDL)
    wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(y_ptr + row * D + offs, (x * r * w).to(y_ptr.dtype.element_ty), mask=mask)


@register("rms_norm", "", "cuda")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, d, x2.stride(0), eps, BLOCK=block, num_warps=_warps(block),
                                    **launch_options())
    return y.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, T, stride_xb, stride_xh, stride_xt,
                 HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start(PDL)
    wait(PDL)
    row = tl.program_id(0)  # one (b, h, t) row
    t = row % T
    h = (row // T) % H
    b = row // (T * H)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x_row = x_ptr + b * stride_xb + h * stride_xh + t * stride_xt
    x1 = tl.load(x_row + offs, mask=mask, other=0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs, mask=mask, other=0).to(tl.float32)
    cs_row = (b * T + t) * 2 * HALF  # cos/sin [B, T, D]: each row's own positions
    c1 = tl.load(cos_ptr + cs_row + offs, mask=mask, other=0)
    c2 = tl.load(cos_ptr + cs_row + HALF + offs, mask=mask, other=0)
    s1 = tl.load(sin_ptr + cs_row + offs, mask=mask, other=0)
    s2 = tl.load(sin_ptr + cs_row + HALF + offs, mask=mask, other=0)
    y_row = y_ptr + row * 2 * HALF
    dtype = y_ptr.dtype.element_ty
    tl.store(y_row + offs, (x1 * c1 - x2 * s1).to(dtype), mask=mask)  # rotate_half: (-x2, x1)
    tl.store(y_row + HALF + offs, (x2 * c2 + x1 * s2).to(dtype), mask=mask)


@register("rope", "", "cuda")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [B, H, T, D] (any strides), cos/sin [B, T, D] float32."""
    b, h, t, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((b, h, t, d), dtype=x.dtype, device=x.device)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _rope_kernel[(b * h * t,)](x, cos, sin, y, h, t, *x.stride()[:3], HALF=d // 2,
                                BLOCK=triton.next_power_of_2(d // 2), num_warps=1, **launch_options())
    return y


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, H, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start(PDL)
    wait(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    silu = (g / (1 + tl.exp(-g))).to(dtype)  # F.silu rounds to the input dtype before the product
    tl.store(y_ptr + row * H + offs, (silu.to(tl.float32) * u).to(dtype), mask=mask)


@register("swiglu", "", "cuda")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., H]: rows may be strided (the two halves of one fused gate/up output), not copied."""
    h = gate.shape[-1]
    g2, u2 = (z.reshape(-1, h) for z in (gate, up))
    g2, u2 = (z if z.stride(-1) == 1 else z.contiguous() for z in (g2, u2))
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    _swiglu_kernel[(g2.shape[0], triton.cdiv(h, 1024))](g2, u2, y, h, g2.stride(0), u2.stride(0), BLOCK=1024,
                                                        num_warps=4, **launch_options())
    return y.view(gate.shape)
