"""What o's own act_quant costs in the int8-activation modes: the 8B o GEMM (N = K = 4,096) at M rows as the model runs
it (attention hands over no codes: o quantizes its input itself) against the same GEMM handed x's codes, as the
norms hand them to qkv and gate/up, each under CUDA graphs cycling through weights past L2, against cuBLAS BF16.
Session 29:
    PYTHONPATH=. python docs/bench-h200/o_act_quant_probe.py [ROWS ...]"""
import sys

import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.gemm import handed_over
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

n = k = 4096
rows = [int(a) for a in sys.argv[1:]] or [256, 1024, 4096]
dense = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies_past_l2(2 * n * k))]
for storage, mode_name in (("int8", "w8a8"), ("int4", "w4a8"), ("int4g", "w4a8")):
    mode = MODES[mode_name]
    ws = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, storage, 128)
          for _ in range(copies_past_l2(n * k))]
    for m in rows:
        x = torch.randn(m, k, device="cuda").bfloat16()
        given = handed_over("qkv", x, mode)  # x's codes, as a norm hands them
        same = torch.equal(linear(x, ws[0], mode), linear(x, ws[0], mode, handover=given))
        cublas = graph_time_ms([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
        own = graph_time_ms([lambda w=w: linear(x, w, mode) for w in ws])
        handed = graph_time_ms([lambda w=w: linear(x, w, mode, handover=given) for w in ws])
        print(f"o {mode_name} [{storage}] m={m:5d}: cuBLAS {1000 * cublas:6.1f} us, own act_quant {1000 * own:6.1f} us "
              f"({own / cublas:.2f}x), codes handed over {1000 * handed:6.1f} us ({handed / cublas:.2f}x)"
              f"{'' if same else ', bits differ'}", flush=True)
