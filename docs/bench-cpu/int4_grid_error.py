"""The nibble formats' build without its sub (session 20's patch, landed in session 21): INT4 codes read as bf16
1 + q / 16, the weight fma(16 s, 1 + q / 16, lo - 16 s), which needs lo - 16 s to be a bf16 value. Squared error on
SmolLM2's layer weights (groups of 128) of that grid (quant/formats.fma_grid at 4 bits: the range centred) against
the INT4 grid before it (`exact_grid` below: bf16 offsets floored), and for the planes' upper view its offset
(upper_affine: lo_u - 16 s_u rounded to bf16) against lo_u rounded alone, as before. Usage: python
docs/bench-cpu/int4_grid_error.py"""
import torch

from selfspec.loading import resolve
from selfspec.quant.formats import bf16_spacing, fma_grid, upper_affine


def exact_grid(lo: torch.Tensor, hi: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The INT4 grid before `fma_grid`'s (session 20): bf16 scale and lo, lo floored onto a multiple of 2^(e - 9)
    and the scale the bf16 nearest to the span from there (unless the top then falls over half a step out)."""
    s0 = torch.maximum((hi - lo) / qmax, lo.abs() * 2.0**-10).clamp_min(1e-10)
    step = torch.maximum(torch.exp2(torch.floor(torch.log2(s0)) - 9), bf16_spacing(lo))
    lo = torch.floor(lo / step) * step
    span = hi - lo
    s = torch.maximum(span / qmax, s0)
    nearest = torch.round(s / bf16_spacing(s)) * bf16_spacing(s)
    return torch.where(nearest * (qmax + 0.5) >= span, nearest, nearest + bf16_spacing(s)), lo


def sq_error(w: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, qmax: int) -> float:
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, qmax)
    return ((q * scale[..., None] + lo[..., None] - w) ** 2).sum().item()


cfg, sd, _, _ = resolve(None)
total: dict[str, float] = {}
for name, t in sd.items():
    if t.dim() != 2 or t.shape[1] % 128 or "layers." not in name:
        continue
    w = t.float().view(t.shape[0], -1, 128)
    lo_w, hi_w = w.amin(-1), w.amax(-1)
    grids = (("INT4 floored", exact_grid(lo_w, hi_w, 15)), ("INT4 fma_grid", fma_grid(lo_w, hi_w, 15, -16)))
    for grid, (s, lo) in grids:
        total[grid] = total.get(grid, 0.0) + sq_error(w, s, lo, 15)
    s8, lo8 = fma_grid(lo_w, hi_w, 255, 128)  # the planes: their upper view with its offset as before, and rounded
    q = ((w - lo8[..., None]) / s8[..., None]).round().clamp(0, 255)
    us, rounded = upper_affine(s8, lo8)
    ulo = (lo8 + s8 * 7.5).bfloat16().float()  # upper_affine's offset before session 20
    for view, offset in (("upper before", ulo), ("upper fma_grid", rounded)):
        total[view] = total.get(view, 0.0) + (((q // 16) * us[..., None] + offset[..., None] - w) ** 2).sum().item()
print(f"INT4 (w4a16): fma_grid / floored grid - 1 = {total['INT4 fma_grid'] / total['INT4 floored'] - 1:+.2%}")
print(f"upper view: offset rounded twice / once - 1 = {total['upper fma_grid'] / total['upper before'] - 1:+.2%}")
