"""Which kernels one decode-size GEMM launches, and each one's CUDA time (torch.profiler): w4a16, w4a8 and `full` on
8B qkv at 1 row. For telling a slower K loop from an extra pass.

python docs/bench-h200/decode_kernels_probe.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

for mode_name, storage in (("w4a16", "int4"), ("w4a8", "int4"), ("full", "planes")):
    w = quantize_weight(torch.randn(6144, 4096, device="cuda") * 0.02, storage, 128)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    for _ in range(3):
        linear(x, w, MODES[mode_name])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            linear(x, w, MODES[mode_name])
        torch.cuda.synchronize()
    print(f"== {mode_name}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=70))
