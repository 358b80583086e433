"""What a draft vocabulary costs in acceptance, teacher-forced (CPU or GPU).

python -m selfspec.bench.draft_vocab [--model smollm2-135m] [--sizes 4096 8192 16384 32768] [--prompts 3]

1. Continuations: each prompt's greedy continuation in the verify mode (`full`: the `planes` recipe at gamma 0).
2. One pass of the draft mode (`upper`) over prompt + continuation: the draft reads its own KV (as
   bench/upper_acceptance.py; a real round reads the verify pass's KV for what was committed before it).
3. Per continuation position: does the draft's argmax, over the whole vocabulary and over each draft vocabulary
   (speculative/draft_vocab.py: the counted tokens alone, and with the prompt's own, as solo decoding takes them),
   equal the verify mode's token (the per-token acceptance of a greedy draft); and the share of the continuation's
   tokens inside each draft vocabulary.
The draft vocabulary is counted on the second half of each source (speculative/draft_vocab.py); the prompts are
the first ones of each task (bench/traces.py), so no prompt's text was counted.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from selfspec.bench.traces import TASKS, prompt_ids, task_prompts
from selfspec.engine.llm import LLM, load
from selfspec.quant.modes import MODES
from selfspec.speculative.draft_vocab import frequent_tokens
from selfspec.speculative.sampling import SamplingParams


@torch.inference_mode()
def draft_argmaxes(llm: LLM, ids: list[int], start: int, vocabs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The `upper` draft's argmax at positions start-1 .. len(ids)-2 (each predicting the next token), over the
    whole vocabulary (None) or over each vocabulary's ids."""
    model = llm.model
    cache = model.new_cache(len(ids))
    tokens = torch.tensor([ids], device=model.device)
    logits = model(tokens, torch.arange(len(ids), device=model.device), cache, MODES["upper"])[0, start - 1:-1]
    return [logits.argmax(-1) if v is None else v[logits[:, v].argmax(-1)] for v in vocabs]


def study(llm: LLM, prompts: dict[str, list], sizes: list[int], max_new_tokens: int) -> dict:
    """Per task: per-token acceptance and coverage over the whole vocabulary, each size's counted tokens, and each
    size's tokens for the prompt (its own tokens joining the counted ones, as solo decoding takes them)."""
    model = llm.model
    vocab = model.lm_head.weight.shape[0]
    counted = frequent_tokens(llm.tokenizer, vocab, vocab, llm.eos_ids)  # counted once, cut to each size below
    sets = [replace(counted, size=s) for s in sizes]
    labels = ["all"] + [str(s) for s in sizes] + [f"{s}+prompt" for s in sizes]
    rows = {}
    for task, texts in prompts.items():
        agree, covered, positions = [0] * len(labels), [0] * len(labels), 0
        for text in texts:
            prompt = prompt_ids(llm, text)
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            cont = llm.generate(prompt, params, gamma=0).token_ids
            vocabs = [None] + [torch.tensor(v.ids(p), device=model.device) for p in ((), prompt) for v in sets]
            drafts = draft_argmaxes(llm, prompt + cont, len(prompt), vocabs)
            target = torch.tensor(cont, device=model.device)
            positions += len(cont)
            for i, (d, v) in enumerate(zip(drafts, vocabs)):
                agree[i] += int((d == target).sum())
                covered[i] += int((torch.isin(target, v) if v is not None else target >= 0).sum())
        rows[task] = {label: {"acceptance": a / positions, "coverage": c / positions}
                      for label, a, c in zip(labels, agree, covered)}
        print(f"{task}: {positions} positions; " + ", ".join(
            f"{label}: {rows[task][label]['acceptance']:.3f} ({rows[task][label]['coverage']:.3f} covered)"
            for label in labels), flush=True)
    return {"model": llm.description, "vocab": vocab, "sizes": sizes, "labels": labels, "counted": counted.sources,
            "tasks": rows}


def markdown(result: dict) -> str:
    labels = result["labels"]
    lines = ["| task | " + " | ".join(f"{x} tokens" if x != "all" else f"all {result['vocab']}" for x in labels) + " |",
             "|---" * (len(labels) + 1) + "|"]
    for task, row in result["tasks"].items():
        lines.append(f"| {task} | " + " | ".join(
            f"{row[x]['acceptance']:.3f} ({row[x]['coverage']:.3f})" for x in labels) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per task (the first ones)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    llm = load(args.model, "planes", gamma=0, device=args.device)
    result = study(llm, task_prompts(args.tasks, args.prompts), args.sizes, args.max_new_tokens)
    print("\nper-token acceptance of the greedy `upper` draft (share of the verify tokens in the draft vocabulary)")
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
