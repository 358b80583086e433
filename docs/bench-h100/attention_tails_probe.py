"""Attention of a tree's branch rows on the 8B heads (H100): forked rows (each its own cache row) against rows sharing
one cache row through tails, and a 16-query chain; GPU time per call (32 calls in a CUDA graph, replayed 50 times:
the host of that machine would otherwise set the time)."""
import torch
from selfspec.kernels import triton_attention as ta

dev, L, R, T = "cuda", 1024, 6, 6


def timed(fn, calls=32, n=50):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n / calls * 1000


torch.manual_seed(0)
forked_k = torch.randn(R, 8, 1152, 128, device=dev).bfloat16()
forked_v = torch.randn_like(forked_k)
q = torch.randn(R, 32, T, 128, device=dev).bfloat16()
pos = (L + torch.arange(T, device=dev)).repeat(R, 1)
rows = torch.arange(R, device=dev)[:, None]
shared_k, shared_v = forked_k[:1].clone(), forked_v[:1].clone()
tails = torch.stack([L + torch.tensor([0] + [1 + r * (T - 1) + i for i in range(T - 1)]) for r in range(R)]).to(dev)
one = torch.zeros(R, 1, dtype=torch.long, device=dev)
q16 = torch.randn(1, 32, 16, 128, device=dev).bfloat16()
pos16 = (L + torch.arange(16, device=dev))[None]
print(f"forked rows {R} x {T}: {timed(lambda: ta.attention_handover(q, forked_k, forked_v, rows, pos)):.1f} us")
print(f"shared row + tails {R} x {T}: "
      f"{timed(lambda: ta.attention_handover(q, shared_k, shared_v, one, pos, tails=tails)):.1f} us")
print(f"shared row, no tails {R} x {T}: {timed(lambda: ta.attention_handover(q, shared_k, shared_v, one, pos)):.1f} us")
print(f"chain 1 x 16: {timed(lambda: ta.attention_handover(q16, shared_k, shared_v, rows[:1], pos16)):.1f} us")
wide = ta.VERIFY_TILES
print(f"32-row tiles: forked {timed(lambda: ta.attention(q, forked_k, forked_v, rows, pos, tiles=wide)):.1f} us, "
      f"shared + tails {timed(lambda: ta.attention(q, shared_k, shared_v, one, pos, tiles=wide, tails=tails)):.1f} us")
