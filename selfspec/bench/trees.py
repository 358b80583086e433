"""Acceptance of chain and tree drafters on a real model (CPU or GPU): per drafter, the mean drafts accepted per
round and the tokens each verify pass emits, greedy, every round drafting --gamma tokens, on the built-in prompts.
Every run is checked against AR decoding of the verify mode (token for token). The model is stored as INT8 planes
(recipe planes: verify `full`; `upper` and hybrid draft from the same weights).

selfspec bench trees [--prompts 5] [--new-tokens 64] [--gamma 4]
    [--drafts ngram ngram-tree:2 ngram-tree:4 hybrid hybrid-tree upper]
"""
from __future__ import annotations

import argparse

import torch

from selfspec.bench.prompts import PROMPTS
from selfspec.engine.llm import load
from selfspec.engine.stats import GenerationStats
from selfspec.speculative.decode import decode
from selfspec.speculative.drafters import make_drafter
from selfspec.speculative.sampling import SamplingParams

DRAFTS = ["ngram", "ngram-tree:2", "ngram-tree:4", "hybrid", "hybrid-tree", "upper"]


def run(llm, ids: list[int], drafter, gamma: int, new_tokens: int) -> tuple[list[int], GenerationStats]:
    stats, out = GenerationStats(), []
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for chunk in decode(llm.runner, ids, llm.verify_mode, drafter, gamma, params, stats):
        out += chunk
        if len(out) >= new_tokens:
            break
    return out[:new_tokens], stats


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=5, help="the first N built-in prompts (chat template)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4, help="drafts per round (per branch for trees)")
    p.add_argument("--drafts", nargs="+", default=DRAFTS, help="--draft names to compare")
    args = p.parse_args(argv)
    llm = load(args.model, "hybrid", gamma=args.gamma, device=args.device)
    prompts = [llm.encode(t, chat=True) for t in PROMPTS[:args.prompts]]
    refs = [run(llm, ids, None, 0, args.new_tokens)[0] for ids in prompts]
    print(f"{llm.description}; verify {llm.verify_mode.name}, gamma {args.gamma}, {len(prompts)} prompts x "
          f"{args.new_tokens} tokens")
    print("| drafter | rounds | accepted drafts / round | tokens / verify pass | accepted / proposed | == AR | "
          "draft + verify s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.drafts:
        drafter = make_drafter(name)
        runs = [run(llm, ids, drafter, args.gamma, args.new_tokens) for ids in prompts]
        same = all(out == ref for (out, _), ref in zip(runs, refs))
        total = GenerationStats.total(s for _, s in runs)
        emitted = total.rounds + total.draft_accepted  # each round: its accepted drafts and the verify's token
        print(f"| {name} | {total.rounds} | {total.draft_accepted / total.rounds:.2f} | "
              f"{emitted / total.rounds:.2f} | {total.draft_accepted / max(1, total.draft_proposed):.2f} | "
              f"{'yes' if same else 'NO'} | {total.draft_s + total.verify_s:.1f} |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
