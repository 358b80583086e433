"""Where a decode step's time goes: the GPU kernels of an AR step (run eagerly), by total time (torch.profiler).

python -m selfspec.bench.profile_step [--shape llama-3-8b] [--modes bf16 full upper]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from selfspec.bench.steps import STORAGE_MODES, filled_cache
from selfspec.bench.synthetic import synthetic_model
from selfspec.quant.modes import MODES


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--modes", nargs="+", default=["bf16", "full", "upper"])
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args(argv)
    for storage, modes in STORAGE_MODES.items():
        wanted = [m for m in modes if m in args.modes]
        if not wanted:
            continue
        model = synthetic_model(args.shape, storage)
        for mode in wanted:
            cache = filled_cache(model, 1, args.context, args.context + 8)  # attention reads a real history
            tok = torch.randint(0, model.cfg.vocab_size, (1, 1), device="cuda")
            pos = torch.full((1, 1), args.context, device="cuda")
            for _ in range(2):
                model(tok, pos, cache, MODES[mode])  # eager: each kernel's GPU time is what the profile sums
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model(tok, pos, cache, MODES[mode])
                torch.cuda.synchronize()
            print(f"\n=== {args.shape} {storage} {mode}: GPU kernels of 3 eager AR steps, context {args.context}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
