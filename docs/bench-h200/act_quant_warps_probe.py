"""act_quant alone (triton_linear._act_quant with the codes' row sums, as o runs it) at M rows of K = 4,096 against
the warps its one program a row takes (ACT_QUANT_WARPS, up to what the row's block allows), under CUDA graphs
cycling through inputs past L2; GB/s of x read and the codes, scales and sums written. Session 29:
    PYTHONPATH=. python docs/bench-h200/act_quant_warps_probe.py"""
import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.kernels import triton_linear

k = 4096
for m in (1, 16, 256, 1024, 4096):
    xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(copies_past_l2(2 * m * k))]
    want = triton_linear._act_quant(xs[0], 8, sums=True)
    cells = []
    for warps in (1, 2, 4, 8, 16):
        triton_linear.ACT_QUANT_WARPS = warps
        got = triton_linear._act_quant(xs[0], 8, sums=True)
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        ms = graph_time_ms([lambda x=x: triton_linear._act_quant(x, 8, sums=True) for x in xs])
        gb_s = m * k * (2 + 1 + 4 / 64) / ms / 1e6
        cells.append(f"{warps} warps {1000 * ms:6.1f} us ({gb_s:5.0f} GB/s){'' if same else ' bits!'}")
    print(f"m={m:5d}: " + ", ".join(cells), flush=True)
