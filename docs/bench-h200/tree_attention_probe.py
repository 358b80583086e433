"""Tree attention per layer at 8B heads (32 query heads, 8 kv heads, dim 128), a paged cache of 16-key blocks:
the branch rows' kernel (attention with tails, the dispatcher's tiles) against each node's query once
(tree_attention) at several tiles, B sequences of random 16-node trees (depth <= 5), rows as wide as a graph's
(9), under CUDA graphs. Prints microseconds a call."""
import sys

import torch

from selfspec.kernels import triton_attention as ta
from selfspec.model import TreeLayout


def random_tree(gen: torch.Generator, nodes: int = 15, depth: int = 5) -> list[list[int]]:
    parent, level = [-1], [0]
    for i in range(1, nodes + 1):
        while True:
            p = int(torch.randint(0, i, (1,), generator=gen))
            if level[p] < depth:
                break
        parent.append(p)
        level.append(level[p] + 1)
    leaves = [i for i in range(1, nodes + 1) if i not in parent]
    branches = []
    for leaf in leaves:
        path = []
        while leaf > 0:
            path.append(leaf)
            leaf = parent[leaf]
        branches.append(path[::-1])
    return branches


def timed(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / 10


gen = torch.Generator().manual_seed(0)
for context in [int(x) for x in sys.argv[1:]] or [600, 1100]:
    for b in (1, 2, 4, 8):
        trees = [(i, context + 37 * i, random_tree(gen)) for i in range(b)]
        layout, _, node_pos = TreeLayout.of(trees, "cuda", shared=True, width=9)
        blocks = -(-(context + 37 * b + 32) // 16)
        k_pool = torch.randn(b * blocks + 1, 8, 16, 128, device="cuda").bfloat16()
        v_pool = torch.randn_like(k_pool)
        seq_table = (torch.randperm(b * blocks, generator=gen).view(b, blocks) + 1).cuda()
        per_seq = torch.tensor([len(br) for _, _, br in trees], device="cuda")
        table = seq_table.repeat_interleave(per_seq, 0)
        q = torch.randn(len(node_pos), 32, 128, device="cuda").bfloat16()[layout.rows].permute(0, 2, 1, 3)
        pos = node_pos[layout.rows]
        rows = timed(lambda: ta.attention(q, k_pool, v_pool, table, pos, tails=layout.tails))
        line = [f"keys {context} B={b} rows {layout.rows.shape[0]} nodes {len(node_pos)}: branch rows {rows:.1f} us"]
        for tiles in (ta.Tiles(32, warps=4), ta.Tiles(16, warps=8), ta.Tiles(16, warps=4), ta.Tiles(32, warps=8)):
            t = timed(lambda: ta.tree_attention(q, k_pool, v_pool, table, pos, layout, tiles))
            line.append(f"{tiles.block_t}x{tiles.warps} {t:.1f}")
        print(", ".join(line), flush=True)
