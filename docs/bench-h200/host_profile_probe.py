"""Where the host's time goes in the engine's serving loop (8B synthetic planes, recycle trace replayed): for each
batch size and gamma (None: the policy), the wall time of a run, the GPU's busy time in it (torch profiler, kernels
summed), and a cProfile of another run (its .prof file written beside the log). Usage:
python docs/bench-h200/host_profile_probe.py OUT_DIR B:GAMMA ... (GAMMA: an int, or p for the policy)."""
import collections, cProfile, pstats, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
from selfspec.bench.serve import synthetic_llm, replayed, make_engine, run_closed_loop
from selfspec.speculative.sampling import SamplingParams

T = "selfspec/bench/traces/qwen2.5-coder-1.5b.ngram.recycle-tree.json"
out = sys.argv[1]
llm = synthetic_llm("llama-3-8b", "recycle", 8, 128, "cuda")
name, accept = replayed(llm, T)
g = torch.Generator().manual_seed(0)
engines = {}
for spec in sys.argv[2:]:
    b, gm = spec.split(":")
    B, gamma = int(b), (None if gm == "p" else int(gm))
    prompts = torch.randint(0, llm.model.cfg.vocab_size, (max(8, 2 * B), 512), generator=g).tolist()
    if B not in engines:
        engines.clear(); torch.cuda.empty_cache()
        engines[B] = make_engine(llm, prompts, B, 128, 8, accept)
    engine = engines[B]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    r = run_closed_loop(engine, prompts, params, gamma)  # settles the policy; then timed
    r = run_closed_loop(engine, prompts, params, gamma)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rp = run_closed_loop(engine, prompts, params, gamma)
        torch.cuda.synchronize()
    busy = sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA")
    pr = cProfile.Profile()
    pr.enable()
    rc = run_closed_loop(engine, prompts, params, gamma)
    pr.disable()
    path = f"{out}/host-B{B}-{gm}.prof"
    pr.dump_stats(path)
    print(f"== B={B} gamma={gm}: {r['output_tokens']} tokens, wall {r['wall_s']*1e3:.0f} ms ({r['tokens_per_s']:.1f} tok/s), "
          f"mean gamma {r['mean_gamma']:.2f}; profiled run wall {rp['wall_s']*1e3:.0f} ms, GPU busy {busy/1e3:.0f} ms "
          f"({busy/1e3/rp['wall_s']/1e3:.3f}); cProfile'd wall {rc['wall_s']*1e3:.0f} ms", flush=True)
    st = pstats.Stats(path)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats("selfspec", 40)
