"""INT4G's int8-activation GEMMs (w4a8) by path, per 8B layer and rows: the Triton tiles, the int8 codes' scratch with
w8a8's int8 GEMM, and the warp-specialized kernel building the codes in registers (gluon_linear.int_scale_gemm) with
128 or 256 rows of x a CTA (`kernel-128`, `kernel-256`), each under CUDA graphs cycling through weights past L2, against
cuBLAS BF16; every path's output checked bit for bit against the Triton tiles' (exact int32 sums: one result whatever
the path; the tiles themselves are not timed). Sessions 27-29:
    [PATHS="scratch kernel-128"] PYTHONPATH=. python docs/bench-h200/int4g_paths_probe.py OUT.json [ROWS ...]"""
import json
import os
import sys

import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.gemm import handed_over
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import gluon_linear as gll
from selfspec.kernels import linear
from selfspec.kernels import triton_linear as tlin
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

MODE = MODES["w4a8"]
takes_tiles = gll.takes_act_tiles
PATHS = tuple(os.environ.get("PATHS", "scratch kernel-128 kernel-256").split())
ROWS = [int(a) for a in sys.argv[2:]] or [128, 192, 256, 320, 384, 512, 768, 1024, 2048, 4096]


def run(path: str, x, w, given):
    """One GEMM on `path`: the thresholds and the gate moved so that `linear` takes it."""
    tlin.INT_SCALE_ROWS = 1 << 30 if path == "tiles" else 1
    tlin.INT_SCALE_SCRATCH_ROWS = 1 << 30
    gll.takes_act_tiles = takes_tiles if path.startswith("kernel") else (lambda block_k: False)
    if path.startswith("kernel"):
        rows = int(path.split("-")[1])
        gll.INTS_BLOCK_M, gll.INTS_TALL_ROWS, gll.INTS_TALL_TILES = 128, (1 if rows > 128 else 1 << 30), 0
    return linear(x, w, MODE, handover=given)


rows = []
for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    ws = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int4g", 128)
          for _ in range(copies_past_l2(n * k // 2))]
    dense = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies_past_l2(2 * n * k))]
    for m in ROWS:
        x = torch.randn(m, k, device="cuda").bfloat16()
        given = handed_over(name, x, MODE)
        cublas = graph_time_ms([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        want = run("tiles", x, ws[0], given)
        row = {"gemm": name, "m": m, "cublas_ms": cublas, "ratios": {}, "bits": {}}
        for path in PATHS:
            row["bits"][path] = torch.equal(run(path, x, ws[0], given), want)
            row["ratios"][path] = graph_time_ms([lambda w=w: run(path, x, w, given) for w in ws]) / cublas
        rows.append(row)
        print(f"{name:8s} m={m:5d} cuBLAS {1000 * cublas:7.1f} us: " + " ".join(
            f"{p} {r:.2f}{'' if row['bits'][p] else ' (bits!)'}" for p, r in row["ratios"].items()), flush=True)
    del ws, dense
with open(sys.argv[1], "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
