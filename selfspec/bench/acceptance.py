"""Acceptance and CPU speed of speculative recipes vs AR on the 20 built-in chat prompts.

python -m selfspec.bench.acceptance [--model M] [--recipes qspec planes] [--gamma 4] [--max-new-tokens 64]
                                    [--no-rotate]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

from tqdm import tqdm

import selfspec
from selfspec.bench.prompts import PROMPTS
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.loading import resolve
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams


def measure(llm: selfspec.LLM, gamma: int, max_new_tokens: int) -> dict:
    t = GenerationStats.total(
        llm.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens), chat=True, gamma=gamma).stats
        for prompt in tqdm(PROMPTS, desc=f"{llm.recipe.name} gamma {gamma}", leave=False))
    decode_s = t.total_s - t.prefill_s
    return {"new_tokens": t.new_tokens, "rounds": t.rounds, "proposed": t.draft_proposed,
            "accepted": t.draft_accepted, "rejected": t.draft_rejected, "decode_s": decode_s,
            "acceptance_rate": t.acceptance_rate, "per_token_acceptance": t.per_token_acceptance,
            "mean_acceptance_length": 1 + t.draft_accepted / max(t.rounds, 1),
            "tokens_per_s": t.new_tokens / decode_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--recipes", nargs="+", default=["qspec", "planes"])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-rotate", action="store_true", help="recipes without their Hadamard rotation (before/after)")
    args = ap.parse_args()
    rows = []
    for name in args.recipes:
        recipe = resolve_recipe(name)
        if args.no_rotate:
            recipe = replace(recipe, rotate=False)
        cfg, sd, tokenizer, description = resolve(args.model)
        llm = build(cfg, sd, tokenizer, recipe, gamma=args.gamma, description=description)
        ar = measure(llm, 0, args.max_new_tokens)
        spec = measure(llm, args.gamma, args.max_new_tokens)
        rows.append({"recipe": name, "verify": recipe.verify, "draft": recipe.draft, "rotate": recipe.rotate,
                     "gamma": args.gamma, "ar_tokens_per_s": ar["tokens_per_s"], **spec})
    print(json.dumps(rows, indent=1))
    print("| recipe | draft -> verify | rotated | acceptance | mean acc. length | AR tok/s | spec tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['draft']} -> {r['verify']} | {'yes' if r['rotate'] else 'no'} | "
              f"{100 * r['acceptance_rate']:.1f}% | "
              f"{r['mean_acceptance_length']:.2f} | {r['ar_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / r['ar_tokens_per_s']:.2f}x |")


if __name__ == "__main__":
    main()
