"""A lead for the nibble formats' build (docs/gpu.md, session 20): INT4 codes read as bf16 1 + q / 16, the weight
fma(16 s, 1 + q / 16, lo - 16 s), which needs lo - 16 s to be a bf16 value. Squared error on SmolLM2's layer weights
(groups of 128) of that grid (the range centred, lo - 16 s rounded to bf16, the scale grown a bf16 step where an end
falls more than half a step out) against today's INT4 grid (`exact_grid`), and for the planes' upper view the
offset lo_u - 16 s_u rounded to bf16 against today's lo_u. Usage: python docs/bench-cpu/int4_grid_error.py"""
import torch

from selfspec.loading import resolve
from selfspec.quant.formats import bf16_spacing, code_128_grid, exact_grid, upper_affine


def code_one_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, lo) covering [lo, hi] in 15 steps, the scale a bf16 value and lo - 16 scale one too."""
    span, centre = hi - lo, (lo + hi) / 2
    s0 = torch.maximum(span / 15, lo.abs() * 2.0**-10).clamp_min(1e-10)
    scale = torch.round(s0 / bf16_spacing(s0)) * bf16_spacing(s0)
    for _ in range(64):
        ideal = centre - 7.5 * scale - 16 * scale  # the weight of code 0, less 16 scale
        step = torch.maximum(torch.exp2(torch.floor(torch.log2(scale)) - 9), bf16_spacing(ideal))
        c = torch.round(ideal / step) * step
        low = c + 16 * scale
        covered = (low <= lo + scale / 2) & (low + 15 * scale >= hi - scale / 2)
        if covered.all():
            return scale, low
        scale = torch.where(covered, scale, scale + bf16_spacing(scale))
    raise RuntimeError("no scale covered a group's range")


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
    for grid, (s, lo) in (("INT4 today", exact_grid(lo_w, hi_w, 15)), ("INT4 code one", code_one_grid(lo_w, hi_w))):
        total[grid] = total.get(grid, 0.0) + sq_error(w, s, lo, 15)
    s8, lo8 = code_128_grid(lo_w, hi_w)  # the planes: their upper view's error with its offset as today, and rounded
    q = ((w - lo8[..., None]) / s8[..., None]).round().clamp(0, 255)
    us, ulo = upper_affine(s8, lo8)
    rounded = (ulo - 16 * us).bfloat16().float() + 16 * us
    for view, offset in (("upper today", ulo), ("upper code one", rounded)):
        total[view] = total.get(view, 0.0) + (((q // 16) * us[..., None] + offset[..., None] - w) ** 2).sum().item()
print(f"INT4 (w4a16): code-one grid / today's - 1 = {total['INT4 code one'] / total['INT4 today'] - 1:+.2%}")
print(f"upper view: offset rounded / today's - 1 = {total['upper code one'] / total['upper today'] - 1:+.2%}")
