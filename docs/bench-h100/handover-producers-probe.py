"""Producers' time with and without the codes, and act_quant alone (us, CUDA graphs)."""
import json, os, sys
import torch
from selfspec.bench.device import graph_time_ms
from selfspec.kernels import triton_small, triton_linear

rows = []
for m in (1, 32, 160, 256, 1024, 4096):
    xs = [torch.randn(m, 4096, device="cuda").bfloat16() for _ in range(8)]
    w = torch.randn(4096, device="cuda").bfloat16()
    gus = [torch.randn(m, 2 * 14336, device="cuda").bfloat16() for _ in range(4)]
    r = {"m": m}
    r["norm_sums"] = 1000 * graph_time_ms([lambda x=x: triton_small.rms_norm_handover(x, w, 1e-6) for x in xs])
    r["norm_codes"] = 1000 * graph_time_ms([lambda x=x: triton_small.rms_norm_handover(x, w, 1e-6, 8) for x in xs])
    r["act_quant_4096"] = 1000 * graph_time_ms([lambda x=x: triton_linear._act_quant(x, 8, sums=False) for x in xs])
    halves = [g.chunk(2, dim=-1) for g in gus]
    r["swiglu_sums"] = 1000 * graph_time_ms([lambda h=h: triton_small.swiglu_handover(*h) for h in halves])
    r["swiglu_codes"] = 1000 * graph_time_ms([lambda h=h: triton_small.swiglu_handover(*h, 8) for h in halves])
    ys = [triton_small.swiglu(*h) for h in halves]
    r["act_quant_14336"] = 1000 * graph_time_ms([lambda y=y: triton_linear._act_quant(y, 8, sums=False) for y in ys])
    rows.append(r)
    print(json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
