"""Where a decode step's time goes: the GPU kernels of an AR step (run eagerly), by total time (torch.profiler);
with --prompt-tokens T, those of a prompt pass of T tokens (the prompt arithmetic, logits of the last one); with
--batch B --verify-tokens T, those of a verify pass of T tokens for each of B rows (logits of every position).

python -m selfspec.bench.profile_step [--shape llama-3-8b] [--modes bf16 full upper] [--prompt-tokens 512]
python -m selfspec.bench.profile_step --modes full --batch 32 --verify-tokens 5
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from selfspec.bench.steps import STORAGE_MODES, filled_cache
from selfspec.bench.synthetic import synthetic_model
from selfspec.quant.modes import MODES, prompt_mode


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--modes", nargs="+", default=["bf16", "full", "upper"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="profile a prompt pass of this many tokens")
    ap.add_argument("--batch", type=int, default=1, help="rows of the step or verify pass")
    ap.add_argument("--verify-tokens", type=int, default=1, help="tokens per row of the pass (a verify pass past 1)")
    args = ap.parse_args(argv)
    if args.prompt_tokens and (args.batch > 1 or args.verify_tokens > 1):
        ap.error("--prompt-tokens profiles one prompt: leave --batch and --verify-tokens out")
    for storage, modes in STORAGE_MODES.items():
        wanted = [m for m in modes if m in args.modes]
        if not wanted:
            continue
        model = synthetic_model(args.shape, storage)
        for mode in wanted:
            t, b = args.prompt_tokens or args.verify_tokens, args.batch
            cache = filled_cache(model, b, args.context, args.context + t)  # attention reads a real history
            tok = torch.randint(0, model.cfg.vocab_size, (b, t), device="cuda")
            pos = args.context + torch.arange(t, device="cuda")[None].repeat(b, 1)
            m = prompt_mode(MODES[mode]) if args.prompt_tokens else MODES[mode]
            last = torch.tensor([t - 1], device="cuda") if args.prompt_tokens else None  # a verify pass: every one
            for _ in range(2):
                model(tok, pos, cache, m, last)  # eager: each kernel's GPU time is what the profile sums
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model(tok, pos, cache, m, last)
                torch.cuda.synchronize()
            what = (f"prompt passes of {t} tokens" if args.prompt_tokens else
                    f"verify passes of {b} x {t} tokens" if t > 1 else f"AR steps of {b} rows")
            print(f"\n=== {args.shape} {storage} {mode}: GPU kernels of 3 eager {what}, context {args.context}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
