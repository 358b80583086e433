"""The INT8 planes' grids on SmolLM2's layer weights: squared error of the floored-offset grid (`exact_grid`, bf16 lo)
against the code-128 grid (`code_128_grid`, bf16 lo + 128 s; docs/leads/full-without-sub.patch, which this needs
applied), for the INT8 weight and its upper plane's INT4 view. Usage: python docs/bench-cpu/planes_grid_error.py"""
import torch

from selfspec.loading import resolve
from selfspec.quant.formats import code_128_grid, exact_grid, upper_affine

cfg, sd, _, _ = resolve(None)
total = {}
grown = groups = 0
for name, t in sd.items():
    if t.dim() != 2 or t.shape[1] % 128 or "layers." not in name:
        continue
    w = t.float().view(t.shape[0], -1, 128)
    lo_w, hi_w = w.amin(-1), w.amax(-1)
    scales = {}
    for grid, (s, lo) in (("floored", exact_grid(lo_w, hi_w, 255)), ("code 128", code_128_grid(lo_w, hi_w))):
        q = ((w - lo[..., None]) / s[..., None]).round().clamp(0, 255)
        us, ulo = upper_affine(s, lo)
        int8 = q * s[..., None] + lo[..., None]
        int4 = (q // 16) * us[..., None] + ulo[..., None]
        total[grid, "INT8"] = total.get((grid, "INT8"), 0.0) + ((int8 - w) ** 2).sum().item()
        total[grid, "upper"] = total.get((grid, "upper"), 0.0) + ((int4 - w) ** 2).sum().item()
        scales[grid] = s
    grown += (scales["code 128"] > scales["floored"] * 1.01).sum().item()
    groups += w.shape[0] * w.shape[1]
for view in ("INT8", "upper"):
    print(f"{view}: squared error, code-128 grid / floored grid - 1 = {total['code 128', view] / total['floored', view] - 1:+.2%}")
print(f"groups whose scale grew by more than 1%: {grown} of {groups}")
