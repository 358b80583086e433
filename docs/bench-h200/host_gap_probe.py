"""The host's critical path between the engine's passes, unperturbed by a profiler (8B synthetic planes, recycle trace
replayed): each CUDA graph replay's gap since the host last waited for the GPU (a .tolist()), and the time spent in
named functions inside those gaps. With --profile DIR, two more runs each: the GPU's busy time (torch profiler, kernels
summed) and a cProfile (DIR/host-B{B}-{GAMMA}.prof, its top functions printed). Usage:
[RECIPE=quasar TRACE=...] python docs/bench-h200/host_gap_probe.py [--profile DIR] B:GAMMA ... (GAMMA: int, or p for
the policy)."""
import collections, cProfile, functools, os, pstats, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
import selfspec.engine.engine as eng
import selfspec.engine.graphs as graphs
import selfspec.model as model
import selfspec.speculative.decode as decode
import selfspec.cache.paged as paged
from selfspec.bench.serve import synthetic_llm, replayed, make_engine, run_load
from selfspec.speculative.sampling import SamplingParams

EVENTS = []
clock = time.perf_counter


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            EVENTS.append((name, t, clock()))
    return wrapper


torch.Tensor.tolist = timed("tolist", torch.Tensor.tolist)
torch.Tensor.to = timed("Tensor.to", torch.Tensor.to)
if os.environ.get("PINNED"):  # small index tensors copied from pinned memory, not waiting
    from array import array
    def pinned_long(values, device="cpu"):
        host = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
        return host.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else host
    decode.long_tensor = paged.long_tensor = pinned_long
if os.environ.get("THREADS"):  # the host's torch threads (intra-op), e.g. 1
    torch.set_num_threads(int(os.environ["THREADS"]))
torch.cuda.CUDAGraph.replay = timed("replay", torch.cuda.CUDAGraph.replay)
eng.Engine.step = timed("step", eng.Engine.step)
eng.Engine._schedule = timed("schedule", eng.Engine._schedule)
eng.Engine._emit = timed("emit", eng.Engine._emit)
eng.tree_rounds = timed("tree_rounds", eng.tree_rounds)
eng.run_round = timed("run_round", eng.run_round)
eng.SharedTree = type("SharedTree", (paged.SharedTree,), {"__init__": timed("SharedTree", paged.SharedTree.__init__)})
eng.tree_view = timed("tree_view", eng.tree_view)
model.TreeLayout.of = classmethod(timed("TreeLayout.of", model.TreeLayout.of.__func__))
graphs.pad_into = timed("pad_into", graphs.pad_into)
graphs.PagedGraphedModel.__call__ = timed("runner", graphs.PagedGraphedModel.__call__)
paged.SharedTree.move_positions = timed("move_positions", paged.SharedTree.move_positions)
decode.advance = timed("advance", decode.advance)
paged.PagedKVCache.view = timed("cache.view", paged.PagedKVCache.view)
paged.BlockPool.extend = timed("cache.extend", paged.BlockPool.extend)
eng.Engine._round = timed("_round", eng.Engine._round)
eng.Engine._take_inbox = timed("_take_inbox", eng.Engine._take_inbox)
eng.Engine._burst = timed("_burst", eng.Engine._burst)
eng.Engine._execute = timed("_execute", eng.Engine._execute)
decode.run_steps = eng.run_steps = timed("run_steps", eng.run_steps)
torch.tensor = timed("torch.tensor", torch.tensor)
graphs._Graph.__call__ = timed("_Graph", graphs._Graph.__call__)
graphs._TreeGraph.__call__ = timed("_TreeGraph", graphs._TreeGraph.__call__)
graphs.PagedGraphedModel._static = timed("_static", graphs.PagedGraphedModel._static)
if hasattr(graphs, "_BatchInputs"):  # docs/leads/staged-round-inputs.patch: a pass's inputs staged in one copy
    graphs._BatchInputs.fill = timed("inputs.fill", graphs._BatchInputs.fill)
    graphs.PagedGraphedModel._replay = timed("_replay", graphs.PagedGraphedModel._replay)

RECIPE = os.environ.get("RECIPE", "recycle")  # and TRACE: another recipe's replayed trace
T = os.environ.get("TRACE", "selfspec/bench/traces/qwen2.5-coder-1.5b.ngram.recycle-tree.json")
PROFILE = sys.argv[2] if sys.argv[1] == "--profile" else None
SPECS = sys.argv[3:] if PROFILE else sys.argv[1:]
llm = synthetic_llm("llama-3-8b", RECIPE, 8, 128, "cuda")
name, accept = replayed(llm, T)
g = torch.Generator().manual_seed(0)
engines = {}
for spec in SPECS:
    b, gm = spec.split(":")
    B, gamma = int(b), (None if gm == "p" else int(gm))
    prompts = torch.randint(0, llm.model.cfg.vocab_size, (max(8, int(os.environ.get('WAVES', 2)) * B), 512), generator=g).tolist()
    if B not in engines:
        engines.clear(); torch.cuda.empty_cache()
        engines[B] = make_engine(llm, prompts, B, 128, 8, accept)
    engine = engines[B]
    if getattr(engine.tree, "propose_trees", None):
        engine.tree.propose_trees = timed("propose_trees", engine.tree.propose_trees)
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    run_load(engine, prompts, params, gamma)
    EVENTS.clear()
    r = run_load(engine, prompts, params, gamma)
    ev = sorted(EVENTS, key=lambda e: e[1])
    gaps, inside = [], collections.defaultdict(float)
    last_wait = None
    for name_, t0, t1 in ev:
        if name_ == "tolist":
            last_wait = t1
        elif name_ == "replay" and last_wait is not None:
            gaps.append(t0 - last_wait)
            for n2, a, z in ev:
                if n2 in ("runner", "_round", "step", "tree_rounds", "run_steps", "_execute") and last_wait <= a <= t0 <= z:
                    inside[n2 + " (to replay)"] += t0 - a
            for n2, a, z in ev:
                if a >= last_wait and z <= t0 and n2 != "replay":
                    inside[n2] += z - a
            last_wait = None
    n = len(gaps)
    gaps.sort()
    print(f"== B={B} gamma={gm} threads={torch.get_num_threads()} pinned={bool(os.environ.get('PINNED'))}: {r['output_tokens']} tokens, {r['tokens_per_s']:.1f} tok/s, mean gamma {r['mean_gamma']:.2f}; "
          f"{n} gaps from a wait to the next replay: mean {sum(gaps)/n*1e3:.3f} ms, median {gaps[n//2]*1e3:.3f}, "
          f"p90 {gaps[int(n*0.9)]*1e3:.3f}; total {sum(gaps)*1e3:.0f} ms of {r['wall_s']*1e3:.0f}", flush=True)
    reps = [z - a for nm, a, z in ev if nm == "replay"]
    print(f"   replay calls {len(reps)}: mean {sum(reps)/len(reps)*1e3:.3f} ms")
    # the parts of a gap: before the engine's step, and from a replaying call's entry to its replay
    steps = [(a, z) for nm, a, z in ev if nm == "step"]
    between = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    print(f"   between steps (the bench's loop): mean {sum(between)/len(between)*1e3:.3f} ms over {len(between)}")
    for k_, v in sorted(inside.items(), key=lambda kv: -kv[1]):
        print(f"   {k_:16s} {v/n*1e3:8.3f} ms a gap (nested times overlap)")
    if PROFILE:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rp = run_load(engine, prompts, params, gamma)
            torch.cuda.synchronize()
        busy = sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA")
        print(f"   profiled run: wall {rp['wall_s'] * 1e3:.0f} ms, GPU busy {busy / 1e3:.0f} ms", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        run_load(engine, prompts, params, gamma)
        pr.disable()
        pr.dump_stats(f"{PROFILE}/host-B{B}-{gm}.prof")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
