"""w8a8's cells that miss 0.8x cuBLAS BF16 (o at 256 and 1,024 rows, qkv at 256: session 26) are few tiles: the int8
GEMM's int32 sums are exact, so K may be cut into any number of pieces without changing a bit, and the K tile is
free too. Per 8B layer at 256 and 1,024 rows: the warp-specialized int8 GEMM's time for pieces 1, 2, 4, 8 and K tiles
of 128 and 256 (and the default `int8_pieces` / `int8_block_k` pick) against cuBLAS BF16, each timed under CUDA
graphs cycling through weights past L2. Session 26, for the next lease:
    PYTHONPATH=. python docs/bench-h200/int8_pieces_probe.py OUT.json"""
import json
import sys

import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import gluon_linear as gll
from selfspec.quant.act import quantize_per_token
from selfspec.quant.formats import quantize_weight

rows = []
for gemm, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies_past_l2(2 * n * k))]
    weights = [quantize_weight(w, "int8", 128) for w in ws]
    dense = [w.bfloat16() for w in ws]
    del ws
    for m in (256, 1024):
        xq, xs = quantize_per_token(torch.randn(m, k, device="cuda").bfloat16(), 8)
        xs = xs.reshape(-1).contiguous()
        x = torch.randn(m, k, device="cuda").bfloat16()
        cublas = graph_time_ms([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        grid = (-(-m // gll.BLOCK_M), -(-n // gll.INT8_BLOCK_N))
        default_k = gll.int8_block_k(grid[0] * grid[1], xq.device)
        row = {"gemm": gemm, "m": m, "cublas_ms": cublas, "default": (gll.int8_pieces(grid, k, default_k, xq.device),
                                                                       default_k), "ratios": {}}
        for block_k in (128, 256):
            for pieces in (1, 2, 4, 8):
                if k < pieces * 4 * block_k:
                    continue
                t = graph_time_ms([lambda w=w: gll.int8_gemm(xq, xs, w.q, w.scale, None, None, pieces, block_k)
                                   for w in weights])
                row["ratios"][f"{pieces}x{block_k}"] = t / cublas
        rows.append(row)
        best = min(row["ratios"], key=row["ratios"].get)
        print(f"{gemm:8s} m={m:5d} cuBLAS {1000 * cublas:7.1f} us, default {row['default']}: "
              + " ".join(f"{key} {r:.2f}" for key, r in row["ratios"].items()) + f" | best {best}", flush=True)
    del weights, dense
with open(sys.argv[1], "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
