"""Tree-row attention (tails) time at 8B heads, branches of 1-6 nodes padded to 9 queries, under CUDA graphs:
`python attention_tails_padding_probe.py ROOT` (ROOT: a checkout holding selfspec/) -> (rows, queries, keys, us)."""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from selfspec.kernels import triton_attention as ta
from triton.testing import do_bench_cudagraph
torch.manual_seed(0)
dev = "cuda"
H, HKV, D, BS = 32, 8, 128, 16
for R, T, ctx in [(7, 9, 600), (14, 9, 600), (23, 9, 600), (46, 9, 600), (7, 9, 2048)]:
    blocks = (ctx + 64) // BS + 1
    k_pool = torch.randn(blocks + 4, HKV, BS, D, device=dev, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    table = torch.randperm(blocks + 4, device=dev)[:blocks][None].expand(R, -1).contiguous().long()
    q = torch.randn(R, H, T, D, device=dev, dtype=torch.bfloat16)
    lens = torch.randint(1, 7, (R,))
    pos = torch.stack([torch.tensor([ctx + min(t, int(n) - 1) for t in range(T)]) for n in lens]).to(dev)
    tails = pos.clone()
    f = lambda: ta.attention(q, k_pool, v_pool, table, pos, tails=tails)
    f(); torch.cuda.synchronize(); us = do_bench_cudagraph(f, rep=200) * 1e3
    print(f"| tails | R={R} | T={T} | keys={ctx} | {us:.1f} |", flush=True)
