"""Perplexity of a named model (SmolLM2-135M unless named) on Paul Graham's essays (`selfspec eval`'s ppl task:
windows of 512 tokens, each from an empty cache) per stored format and mode, on the CPU: the formats `eval` does not
pick by recipe (`int4g`) beside the ones it does. Sessions 27 and 29:
    python docs/bench-cpu/storage_ppl.py [WINDOWS] [MODEL]    (Qwen2.5-Coder-1.5B: ~20 GB of memory)"""
import math
import sys
import time

from selfspec.engine.llm import build_model
from selfspec.eval.tasks.ppl import load_windows, window_nll
from selfspec.loading import resolve
from selfspec.loading.named import DEFAULT_MODEL
from selfspec.quant.modes import MODES

RUNS = (("dense", ["fp32"]), ("int4", ["w4a16", "w4a8"]), ("int4g", ["w4a16", "w4a8"]))

name = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_MODEL
windows = None
for storage, modes in RUNS:
    start = time.time()
    cfg, state_dict, tokenizer, _ = resolve(name)  # loaded again for each storage: one copy in memory at a time
    windows = windows or load_windows(tokenizer, None, int(sys.argv[1]) if len(sys.argv) > 1 else 8)
    model = build_model(cfg, state_dict, storage, 128, tokenizer=tokenizer)
    del state_dict
    for mode in modes:
        nll, tokens = map(sum, zip(*(window_nll(model, w.prompt, MODES[mode]) for w in windows)))
        print(f"{storage:6s} {mode:6s} perplexity {math.exp(nll / tokens):.2f} ({time.time() - start:.0f} s)",
              flush=True)
