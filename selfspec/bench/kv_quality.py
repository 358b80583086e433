"""Perplexity of a model under each KV cache format (quant/kv.py) on long text (Paul Graham's essays), on the
CPU: the weights as the verify mode reads them, only the KV cache changes.

python -m selfspec.bench.kv_quality [--model smollm2-135m] [--tokens 2048] [--windows 1] [--kv-group 128]

Each window is one sequence from an empty cache, run in passes of one group (as a quantized cache takes a
prompt), so every query past the first 2G tokens reads quantized keys below its last G to 2G positions.

With --acceptance RECIPES (e.g. planes,selfspec): instead, each window is a prompt, greedy decoding drafts
--gamma tokens every round for --max-new-tokens, and per recipe a JSON line gives the drafts accepted,
proposed and rejected (rounds ending in a rejected draft), `rate` = accepted / proposed (the share of drafts
accepted at this gamma: the drafts after a rejection count as proposed though never judged) and `per_token` =
accepted / (accepted + rejected), the per-draft acceptance a of the chain model (policy.expected_tokens;
bench/long_context.py --acceptance-json reads it).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import torch

from selfspec.engine.llm import load
from selfspec.engine.stats import GenerationStats
from selfspec.eval.tasks.ppl import load_windows, window_nll
from selfspec.speculative.sampling import SamplingParams

VIEWS = {"bf16": ("bf16", False), "int8": ("int8", False), "hier-upper": ("hier", True), "hier-full": ("hier", False)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--recipe", default="ar", help="whose verify mode reads the weights (default: ar, dense)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per window")
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--kv-group", type=int, default=128)
    p.add_argument("--views", default=",".join(VIEWS))
    p.add_argument("--acceptance", default=None, help="comma-separated recipes whose draft acceptance to measure")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.acceptance:
        for recipe in args.acceptance.split(","):
            print(json.dumps({"recipe": recipe, **acceptance(args, recipe)}), flush=True)
        return
    llm = load(args.model, args.recipe)
    items = load_windows(llm.tokenizer, None, args.windows, args.tokens)
    results = {}
    for view in args.views.split(","):
        fmt, upper = VIEWS[view]
        llm.model.set_kv_format(fmt, args.kv_group)
        mode = replace(llm.verify_mode, kv_upper=upper)
        nll, n = map(sum, zip(*(window_nll(llm.model, item.prompt, mode) for item in items)))
        results[view] = math.exp(nll / n)
        print(json.dumps({"view": view, "ppl": round(results[view], 4),
                          "vs_bf16": round(results[view] / results.get("bf16", results[view]) - 1, 5)}), flush=True)


def acceptance(args: argparse.Namespace, recipe: str) -> dict:
    llm = load(args.model, recipe, gamma=args.gamma, fixed_gamma=True)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    t = GenerationStats.total(llm.generate(item.prompt, params).stats
                              for item in load_windows(llm.tokenizer, None, args.windows, args.tokens))
    # rate: the share of drafts accepted at this fixed gamma (E[accepted per round] / gamma); per_token: the chain
    # model's per-draft acceptance, what policy.expected_tokens takes.
    return {"gamma": args.gamma, "accepted": t.draft_accepted, "proposed": t.draft_proposed,
            "rejected": t.draft_rejected, "rate": round(t.acceptance_rate, 4),
            "per_token": round(t.per_token_acceptance, 4)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
