"""Draft acceptance of w4a8 / w4a4 self-drafts for w4a16 on the `int4` and `int4g` storages (SmolLM2 on the CPU,
greedy, gamma 4, the first N built-in chat prompts): what a recipe on `int4g` would accept against one on `int4`.
    python docs/bench-cpu/int4g_acceptance.py [N] [MAX_NEW_TOKENS]"""
import sys

from selfspec.bench.acceptance import measure
from selfspec.bench import prompts
from selfspec.engine.llm import build
from selfspec.loading import resolve
from selfspec.speculative.recipes import Recipe

count = int(sys.argv[1]) if len(sys.argv) > 1 else 8
max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 48
prompts.PROMPTS[:] = prompts.PROMPTS[:count]
print("| storage | draft -> verify | rotated | acceptance | mean acc. length |\n|---|---|---|---|---|")
for storage, draft, rotate in (("int4", "w4a8", False), ("int4g", "w4a8", False), ("int4", "w4a4", True),
                               ("int4g", "w4a4", True)):
    cfg, sd, tokenizer, description = resolve(None)
    recipe = Recipe(f"{storage}-{draft}", storage, "w4a16", draft, rotate=rotate)
    r = measure(build(cfg, sd, tokenizer, recipe, gamma=4, description=description, fixed_gamma=True), 4, max_new)
    print(f"| {storage} | {draft} -> w4a16 | {'yes' if rotate else 'no'} | {100 * r['acceptance_rate']:.1f}% | "
          f"{r['mean_acceptance_length']:.2f} |", flush=True)
