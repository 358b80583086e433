"""Real shared-tree verify costs through the engine (8B synthetic planes, recycle trace replayed, every round k=5)
and a kernel breakdown of a tree round against a plain one under the profiler."""
import collections, sys, time
import torch
from selfspec.bench.serve import synthetic_llm, replayed, make_engine, run_load
from selfspec.speculative.sampling import SamplingParams

T = "selfspec/bench/traces/qwen2.5-coder-1.5b.ngram.recycle-tree.json"
llm = synthetic_llm("llama-3-8b", "recycle", 8, 128, "cuda")
name, accept = replayed(llm, T)
g = torch.Generator().manual_seed(0)
for B in [int(x) for x in sys.argv[1:]] or [1, 2, 4]:
    prompts = torch.randint(0, llm.model.cfg.vocab_size, (max(8, 2 * B), 512), generator=g).tolist()
    engine = make_engine(llm, prompts, B, 64, 8, accept)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    engine.policy.verify_cost.clear(); engine.policy.verify_sizes.clear(); engine.policy._floors = None
    r0 = run_load(engine, prompts, params, 0)
    r5 = run_load(engine, prompts, params, 5)
    costs = {t: round(e.value * 1e3, 3) for t, e in sorted(engine.policy.verify_cost.items())}
    print(f"B={B} AR {r0['tokens_per_s']:.0f} tok/s, k=5 trees {r5['tokens_per_s']:.0f} tok/s; verify ms by tokens {costs}", flush=True)
    from torch.profiler import profile, ProfilerActivity
    for gamma in (0, 5):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rr = run_load(engine, prompts[:B], SamplingParams(max_new_tokens=64, ignore_eos=True), gamma)
            torch.cuda.synchronize()
        agg = collections.Counter(); cnt = collections.Counter()
        for e in prof.events():
            if e.device_type.name == "CUDA":
                agg[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                cnt[e.name[:60]] += 1
        tot = sum(agg.values())
        print(f"  B={B} gamma={gamma}: {tot/1e3:.1f} ms GPU over {rr['output_tokens']} tokens; top kernels (ms, calls):")
        for n, t in agg.most_common(12):
            print(f"    {t/1e3:8.2f} {cnt[n]:6d}  {n}")
    del engine
    torch.cuda.empty_cache()
