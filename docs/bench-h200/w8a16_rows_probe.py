"""w8a16 (INT8 codes as 32-bit words) at 17-160 rows on the 8B layers: which tiles after the decode config.
Session 11 (H200). PYTHONPATH=. python docs/bench-h200/w8a16_rows_probe.py OUT.json"""
import json
import sys
from dataclasses import replace

import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import triton_linear as tlin
from selfspec.kernels import linear_tiles as tiles
from selfspec.quant.formats import quantize_weight

rows = []
for gemm, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    weights = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int8", 128)
               for _ in range(copies_past_l2(n * k))]
    base = tiles.decode_config(tiles.INT8.value, False, n, k, 0)
    variants = {"decode tiles": base, "gluon": replace(base, warp_specialized=True)}
    for t in [(32, 128, 4, 3, False), (32, 128, 8, 3, False), (32, 128, 8, 3, True), (32, 64, 4, 3, False),
              (64, 128, 4, 3, False), (64, 64, 4, 3, False)]:
        variants[f"{t[0]}x{t[1]}x{t[2]}{' in program' if t[4] else ''}"] = tiles.retile(base, t, k)
    for m in (32, 64, 96, 128, 160):
        x = torch.randn(m, k, device="cuda").bfloat16()
        row = {"gemm": gemm, "m": m}
        for name, cfg in variants.items():
            row[name] = 1000 * graph_time_ms([lambda w=w: tlin._launch(x, None, w, tiles.INT8.value, False, None, cfg)
                                              for w in weights])
        print(gemm, m, {a: round(b, 1) for a, b in row.items() if a not in ("gemm", "m")}, flush=True)
        rows.append(row)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
