"""Speculative decoding speed on the GPU under CUDA graphs: the real draft / verify / accept / rollback loop
(spec/decode.py), with each round's acceptance replayed from a trace recorded on a real model
(selfspec/bench/traces/), on a synthetic-weight shape; against AR decoding of the verify mode and the speed
the measured step costs and the trace's acceptance predict.

python -m selfspec.bench.spec [--shape llama-3-8b] [--trace selfspec/bench/traces/smollm2-135m.planes.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from selfspec.bench.steps import ar_ms_per_step, pass_ms
from selfspec.bench.synthetic import synthetic_model
from selfspec.bench.traces import TRACE_DIR, ReplayAcceptance, load
from selfspec.engine.graphs import GraphedModel
from selfspec.engine.stats import GenerationStats
from selfspec.quant.modes import MODES
from selfspec.speculative.decode import decode
from selfspec.speculative.recipes import PRESETS
from selfspec.speculative.sampling import SamplingParams


def expected_tokens(accepted: list[int], k: int) -> float:
    """Mean tokens a round commits when it drafts k: min(n, k) accepted plus the verify pass's own token."""
    return 1 + sum(min(n, k) for n in accepted) / len(accepted)


def replayed_tokens_per_s(gm: GraphedModel, recipe: str, accepted: list[int], k: int, context: int,
                          new_tokens: int = 256) -> float:
    """Decode tokens/s of the real loop (batch 1) from a random `context`-token prompt, acceptance replayed."""
    r = PRESETS[recipe]
    prompt = torch.randint(0, gm.cfg.vocab_size, (context,)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for warm in (True, False):  # the first pass captures the graphs of every step shape
        stats = GenerationStats()
        n, t0 = 0, None
        for chunk in decode(gm, prompt, MODES[r.verify], MODES[r.draft] if k else None, k, params, stats,
                            accept=ReplayAcceptance(accepted)):
            if t0 is None:  # after the prefill
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                continue
            n += len(chunk)
            if n >= (32 if warm else new_tokens):
                break
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def measure(shape: str, traces: list[Path], gammas: list[int], context: int) -> list[dict]:
    rows = []
    by_recipe: dict[str, list[dict]] = {}
    for path in traces:
        t = load(path)
        by_recipe.setdefault(t["recipe"], []).append(t)
    for recipe, recipe_traces in by_recipe.items():
        r = PRESETS[recipe]
        gm = GraphedModel(synthetic_model(shape, r.storage), max_len=context + 512)
        ar_ms = ar_ms_per_step(gm, r.verify, 1, context)
        draft_ms = pass_ms(gm, r.draft, 1, 1, context)
        for t in recipe_traces:
            for task, accepted in t["tasks"].items():
                for k in gammas:
                    verify_ms = pass_ms(gm, r.verify, 1, k + 1, context)
                    predicted = 1000 * expected_tokens(accepted, k) / (k * draft_ms + verify_ms)
                    measured = replayed_tokens_per_s(gm, recipe, accepted, k, context)
                    row = {"shape": shape, "synthetic": True, "recipe": recipe, "draft": r.draft, "verify": r.verify,
                           "trace": f"{t['model']}/{task}", "gamma": k,
                           "acceptance_rate": sum(min(n, k) for n in accepted) / (k * len(accepted)),
                           "mean_acceptance_length": expected_tokens(accepted, k),
                           "ar_tokens_per_s": 1000 / ar_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
                           "predicted_tokens_per_s": predicted, "tokens_per_s": measured}
                    rows.append(row)
                    print(f"{recipe} {t['model']}/{task} k={k}: acc {row['acceptance_rate']:.2f}, "
                          f"{measured:.1f} tok/s (predicted {predicted:.1f}; AR {1000 / ar_ms:.1f})", flush=True)
        del gm
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| recipe | trace (replayed) | gamma | acceptance | mean acc. length | draft ms | verify ms | AR tok/s "
           "| spec tok/s | predicted | measured/predicted | spec/AR |", "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['recipe']} ({r['draft']} -> {r['verify']}) | {r['trace']} | {r['gamma']} "
                   f"| {100 * r['acceptance_rate']:.1f}% | {r['mean_acceptance_length']:.2f} | {r['draft_ms']:.2f} "
                   f"| {r['verify_ms']:.2f} | {r['ar_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} "
                   f"| {r['predicted_tokens_per_s']:.1f} | {r['tokens_per_s'] / r['predicted_tokens_per_s']:.2f} "
                   f"| {r['tokens_per_s'] / r['ar_tokens_per_s']:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--trace", type=Path, nargs="+", default=sorted(TRACE_DIR.glob("*.json")))
    ap.add_argument("--gamma", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.shape, args.trace, args.gamma, args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, {args.shape} (synthetic weights, acceptance replayed), batch 1, "
          f"context {args.context}, CUDA graphs")
    print(markdown(rows))


if __name__ == "__main__":
    main()
