"""Is mma.sync m16n8k16 (fed bytes, kWidth 4) two 8-k halves added one after the other? wgmma fed each half as its
own 16-k step (the other 8 slots zero) against the w8a16 tiles (channel scales 1)."""
import json
import os

import torch
from selfspec.kernels import gluon_linear as gll
from selfspec.kernels import triton_linear as tl_
from selfspec.kernels import linear_tiles as tiles
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

def halves(t, order):
    m, k = t.shape
    v = t.reshape(m, k // 16, 16)[:, :, order]  # each 16-k step in the order mma.sync sees it
    z = torch.zeros(m, k // 16, 2, 16, dtype=t.dtype, device=t.device)
    z[:, :, 0, :8] = v[:, :, :8]
    z[:, :, 1, :8] = v[:, :, 8:]
    return z.reshape(m, 2 * k).contiguous()

kw4 = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
nat = list(range(16))
out = []
torch.manual_seed(0)
for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("down", 4096, 14336)]:
    w = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int8", 128)
    w.scale.fill_(1.0)
    x = torch.randn(1024, k, device="cuda").bfloat16()
    codes = w.q.float().bfloat16()
    for m in (16, 1024):
        y_tr = tl_.linear(x[:m], w, MODES["w8a16"], None)
        cfg = tiles.tile_config(tiles.INT8.value, False, n, k, 0, m)
        row = {"gemm": name, "m": m, "split": cfg.split_k, "outputs": y_tr.numel()}
        for label, order in (("kwidth4_halves", kw4), ("natural_halves", nat)):
            chunk = tiles.k_chunk(2 * k, cfg.split_k, 64)  # K doubled: each 16-k step in two
            y = gll.dense_gemm(halves(x[:m], order), halves(codes, order), 64, chunk, cfg.split_k, None, None)
            row[label] = int((y != y_tr).sum())
        out.append(row)
        print(json.dumps(row), flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/w8a16-halves-probe.json", "w"), indent=1)
