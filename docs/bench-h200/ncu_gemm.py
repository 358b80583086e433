"""One layer GEMM at M rows in a weight-only mode and cuBLAS BF16 on the same weights, each run 3 times, for ncu to
profile (8B shape, synthetic weights). Session 20's profile of the nibble kernel (docs/gpu.md):

ncu -k regex:nibble_ws --launch-skip 1 --launch-count 1 --section WarpStateStats --section SourceCounters \
    --section SpeedOfLight --print-details all python docs/bench-h200/ncu_gemm.py 1024 qkv w4a16
ncu -k regex:nibble_ws --launch-skip 1 --launch-count 1 --section SourceCounters --page source --print-source sass \
    --csv python docs/bench-h200/ncu_gemm.py 1024 qkv w4a16 > sass.csv   # samples per SASS instruction
A fourth argument names the storage where not the GEMM bench's first for the mode (`256 qkv w4a8 int4g`).
"""
import sys

import torch

from selfspec.bench.gemm import FIRST_STORAGE
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

STORAGE = FIRST_STORAGE  # each mode from the storage the GEMM bench names it by

m, names = int(sys.argv[1]), sys.argv[2].split(",")
mode = sys.argv[3] if len(sys.argv) > 3 else "w4a16"
storage = sys.argv[4] if len(sys.argv) > 4 else STORAGE[mode]
for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    if name not in names:
        continue
    w = torch.randn(n, k, device="cuda") * 0.02
    x = torch.randn(m, k, device="cuda").bfloat16()
    q, wb = quantize_weight(w, storage, 128), w.bfloat16()
    for _ in range(3):
        linear(x, q, MODES[mode])
        torch.nn.functional.linear(x, wb)
    torch.cuda.synchronize()
    print(name, n, k, "done")
