"""bf16's qkv misses its 1.25x cuBLAS bar by 1-2% at 256, 1,024 and 4,096 rows (session 26: 1.26-1.27x) where o,
gate/up and down meet it. A bf16 weight keeps every row's bits on any M / N tile, warps and stages (its K tile and
split fixed: linear_tiles.MANY_TOKENS' notes), so the tiles are free: per 8B layer at those rows, the default pick
against other Triton tiles and the warp-specialized kernel, each checked bit for bit against the default's output
and timed under CUDA graphs cycling through weights past L2, against cuBLAS BF16. Session 27:
    PYTHONPATH=. python docs/bench-h200/bf16_tiles_probe.py OUT.json"""
import json
import sys
from dataclasses import replace

import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import triton_linear as tlin
from selfspec.kernels import linear_tiles as tiles
from selfspec.quant.formats import quantize_weight

DENSE = tiles.DENSE.value
# (block_m, block_n, warps, stages, chunks in one program, block_k): Triton tiles to try beside the default.
TILES = [(128, 256, 8, 3, True, 64), (128, 128, 8, 3, True, 128), (128, 128, 8, 4, True, 64),
         (128, 256, 8, 4, True, 64), (256, 128, 8, 3, True, 64), (64, 256, 4, 4, True, 64), (128, 128, 4, 4, True, 64)]

rows = []
for gemm, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies_past_l2(2 * n * k))]
    weights = [quantize_weight(w.bfloat16(), "dense") for w in ws]
    dense = [w.weight for w in weights]
    del ws
    for m in (256, 1024, 4096):
        x = torch.randn(m, k, device="cuda").bfloat16()
        cublas = graph_time_ms([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        default = tiles.tile_config(DENSE, False, n, k, 0, m)
        base = tiles.decode_config(DENSE, False, n, k, 0)
        want = tlin._launch(x, None, weights[0], DENSE, False, None, default)
        cands = {"default": default, "ws": replace(default, warp_specialized=True),
                 "triton": replace(default, warp_specialized=False)}
        for t in TILES:
            c = tiles.retile(base, t, k)
            if tiles.fits_shared(c, DENSE, False):
                cands["x".join(map(str, t[:4])) + f"/k{c.block_k}"] = c
        row = {"gemm": gemm, "m": m, "cublas_ms": cublas, "default": str(default), "ratios": {}, "bits": {}}
        for name, c in cands.items():
            try:
                same = torch.equal(tlin._launch(x, None, weights[0], DENSE, False, None, c), want)
                t = graph_time_ms([lambda w=w, c=c: tlin._launch(x, None, w, DENSE, False, None, c) for w in weights])
            except Exception as e:  # a tile that does not compile or launch: say so, try the next
                print(f"{gemm} m={m} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row["ratios"][name], row["bits"][name] = t / cublas, same
        rows.append(row)
        best = min((c for c in row["ratios"] if row["bits"][c]), key=row["ratios"].get)
        print(f"{gemm:8s} m={m:5d} cuBLAS {1000 * cublas:7.1f} us: "
              + " ".join(f"{c} {r:.3f}{'' if row['bits'][c] else '(bits!)'}" for c, r in row["ratios"].items())
              + f" | best {best}", flush=True)
    del weights, dense
with open(sys.argv[1], "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
