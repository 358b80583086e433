"""Split a replayed recycle-tree round on the 8B shape: GPU time of each verify pass (synchronized) vs the round."""
import sys, time, statistics
import torch
from selfspec.bench.synthetic import synthetic_model
from selfspec.engine.graphs import GraphedModel
from selfspec.bench.traces import load, replay
from selfspec.bench.spec import decode_speed
from selfspec.quant.modes import MODES
from pathlib import Path

gm = GraphedModel(synthetic_model("llama-3-8b", "planes"), max_len=1024 + 512)

class Timed:
    def __init__(self, m): self.m, self.log = m, []
    def __getattr__(self, k): return getattr(self.m, k)
    def __call__(self, tokens, pos, cache, mode, *a, **kw):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = self.m(tokens, pos, cache, mode, *a, **kw)
        torch.cuda.synchronize()
        tree = kw.get("tree")
        self.log.append((None if tree is None else tuple(tree.rows.shape), tokens.shape[1], time.perf_counter() - t0))
        return out

t = load(Path(sys.argv[1]))
for task, rounds in t.tasks.items():
    tm = Timed(gm)
    out = decode_speed(tm, MODES["full"], replay(rounds, None), 5, 1024, 256, warm_tokens=256)
    passes = tm.log[-out["rounds"]:]
    tree = [dt for shape, n, dt in passes if shape is not None]
    ms = 1000 / out["tokens_per_s"] * out["tokens"] / out["rounds"]
    print(f"{task}: round {ms:.2f} ms (synchronized), verify pass median {1e3 * statistics.median(tree):.2f} ms over "
          f"{len(tree)} tree passes, mean nodes {statistics.mean(n for s, n, _ in passes if s):.1f}, "
          f"mean rows {statistics.mean(s[0] for s, n, _ in passes if s):.1f}", flush=True)
ar = Timed(gm)
decode_speed(ar, MODES["full"], None, 0, 1024, 64)
print(f"AR step (synchronized) median {1e3 * statistics.median(dt for *_, dt in ar.log[-32:]):.2f} ms")
chain = Timed(gm)
cache = gm.new_cache(1100)
for T in (1, 8, 16):
    toks = torch.zeros(1, T, dtype=torch.long, device="cuda"); pos = 1024 + torch.arange(T, device="cuda")
    for _ in range(12): chain(toks, pos, cache, MODES["full"])
    print(f"chain pass of {T}: {1e3 * statistics.median(dt for *_, dt in chain.log[-10:]):.2f} ms")
