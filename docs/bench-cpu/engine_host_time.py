"""The serving engine's host time per pass on this CPU, its runner replaced by one that returns random logits at once
(no model runs): what the GPU would wait on between passes, scheduling to emitting, without CUDA's launches and
copies (docs/bench-h200/host_gap_probe.py measures those on the GPU). A synthetic Qwen2.5-0.5B-shaped engine, the
recipe's acceptance replayed from its Qwen2.5-Coder-1.5B trace, the policy seeded with an H100's verify costs so it
drafts as there; 8 waves of B requests (512-token prompts, 128 new tokens) after one warm-up wave.

python docs/bench-cpu/engine_host_time.py B GAMMA [RECIPE] [--profile [tottime|cumulative]]   (GAMMA: int, or p)
"""
import cProfile
import pstats
import sys
import time

import torch

from selfspec.bench.serve import replayed, run_load, synthetic_llm
from selfspec.engine.engine import Engine
from selfspec.speculative.sampling import SamplingParams

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, GAMMA = int(args[0]), None if args[1] == "p" else int(args[1])
RECIPE = args[2] if len(args) > 2 else "ngram"
PROFILE = "--profile" in sys.argv
SORT = sys.argv[sys.argv.index("--profile") + 1] if PROFILE and sys.argv[-1] != "--profile" else "tottime"
VOCAB = 64


class InstantRunner:
    """The model's call signature; logits drawn at random, shaped as each kind of pass returns them."""

    def __init__(self, model):
        self.model, self.device, self.cfg = model, model.device, model.cfg

    def __call__(self, tokens, pos, cache, mode, logits_at=None, packed=None, tree=None):
        if logits_at is not None:
            return torch.randn(len(logits_at), VOCAB)
        if tree is not None:
            return torch.randn(1, tokens.shape[1], VOCAB)
        return torch.randn(tokens.shape[0], tokens.shape[1], VOCAB)


torch.manual_seed(0)
llm = synthetic_llm("qwen2.5-0.5b", RECIPE, 8, 128, "cpu")
_, accept = replayed(llm, f"selfspec/bench/traces/qwen2.5-coder-1.5b.{RECIPE}.json")
prompts = torch.randint(0, 1000, (8 * B, 512), generator=torch.Generator().manual_seed(0)).tolist()
blocks_a_row = -(-(512 + 128 + 9) // 16) + 2
engine = Engine(llm, max_batch=B, num_blocks=B * blocks_a_row, max_queue=len(prompts), max_gamma=8, accept=accept)
engine.runner = InstantRunner(llm.model)
engine.seed_policy({t: (11.5 + 0.05 * t) / 1e3 for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)}, {})
params = SamplingParams(max_new_tokens=128, ignore_eos=True)
run_load(engine, prompts[:B], params, GAMMA)
profiler = cProfile.Profile() if PROFILE else None
t = time.perf_counter()
if profiler:
    profiler.enable()
r = run_load(engine, prompts, params, GAMMA)
if profiler:
    profiler.disable()
wall = time.perf_counter() - t
passes = sum(r["passes"].values())
tokens = r["output_tokens"]
print(f"B={B} gamma={args[1]} {RECIPE}: {wall * 1e3:.0f} ms host, {passes} passes, {wall / passes * 1e3:.3f} ms a "
      f"pass, mean gamma {r['mean_gamma']:.2f}, {tokens} tokens, {wall / tokens * 1e6:.1f} us a token")
if profiler:
    pstats.Stats(profiler).sort_stats(SORT).print_stats(30)
