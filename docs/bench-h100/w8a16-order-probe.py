"""Does wgmma in natural order, fed x and the INT8 codes with each 16 columns in the order
[0,1,4,5,8,9,12,13,2,3,6,7,10,11,14,15], give the w8a16 decode tiles' bits? (scale 1: the GEMM's output is its sum)"""
import json
import os

import torch
from selfspec.kernels import gluon_linear as gll
from selfspec.kernels import triton_linear as tl_
from selfspec.kernels import linear_tiles as tiles
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

def perm16(t):
    m, k = t.shape
    return t.reshape(m, k // 16, 4, 2, 2).transpose(2, 3).reshape(m, k).contiguous()

out = []
torch.manual_seed(0)
for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("down", 4096, 14336)]:
    w = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int8", 128)
    w.scale.fill_(1.0)
    x = torch.randn(1024, k, device="cuda").bfloat16()
    for m in (16, 256, 1024):
        y_tr = tl_.linear(x[:m], w, MODES["w8a16"], None)
        cfg = tiles.tile_config(tiles.INT8.value, False, n, k, 0, m)
        codes = w.q.float().bfloat16()
        chunk = tiles.k_chunk(k, cfg.split_k, 64)
        y_perm = gll.dense_gemm(perm16(x[:m]), perm16(codes), 64, chunk, cfg.split_k, None, None)
        y_nat = gll.dense_gemm(x[:m].contiguous(), codes.contiguous(), 64, chunk, cfg.split_k, None, None)
        row = {"gemm": name, "m": m, "split": cfg.split_k, "block_k": cfg.block_k, "block_m": cfg.block_m,
               "permuted_vs_triton": int((y_perm != y_tr).sum()), "natural_vs_triton": int((y_nat != y_tr).sum()),
               "outputs": y_tr.numel()}
        out.append(row)
        print(json.dumps(row), flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/w8a16-order-probe.json", "w"), indent=1)
