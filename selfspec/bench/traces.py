"""Acceptance traces: how many drafts each speculative round accepted, recorded on a real model and task, and
replayed through the real decoding loop on any model (e.g. synthetic 8B shapes on the GPU).

python -m selfspec.bench.traces --model smollm2-135m --recipe planes --tasks gsm8k humaneval --prompts 8
    -> selfspec/bench/traces/smollm2-135m.planes.json

A trace is recorded at gamma G (default 8). Replayed at gamma k <= G, a round accepts min(n, k) where n is
the recorded count: greedy drafts are deterministic, so the first k drafts of a round are the first k of the
G drafts the recording made (the rounds themselves then fall at other positions: an approximation, labelled).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

import selfspec
from selfspec.eval.runner import encode
from selfspec.eval.tasks import get_task
from selfspec.speculative.sampling import SamplingParams

TRACE_DIR = Path(__file__).parent / "traces"


def record(llm: selfspec.LLM, prompts: list, gamma: int, max_new_tokens: int) -> list[int]:
    """Accepted drafts per round over all prompts (greedy decoding, the recipe's draft and verify modes)."""
    accepted = []
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for prompt in tqdm(prompts, desc=f"trace {llm.recipe.name}", leave=False):
        ids = encode(llm, prompt)
        before = 0
        for _, _, out in llm.stream(ids, params, gamma=gamma):  # one yield per round (after the prefill's)
            if out.stats.rounds:  # each round's yield: the drafts it accepted
                accepted.append(out.stats.draft_accepted - before)
                before = out.stats.draft_accepted
    return accepted


class ReplayAcceptance:
    """Greedy acceptance whose decisions come from a trace: round i accepts min(trace[i], k) drafts; the
    next token is the verify pass's own argmax there. Cycles through the trace."""

    def __init__(self, accepted: list[int]) -> None:
        self.accepted = accepted
        self.i = 0

    def __call__(self, drafts: list[int], target: list[int]) -> tuple[int, int]:
        n = min(self.accepted[self.i % len(self.accepted)], len(drafts))
        self.i += 1
        return n, target[n]


def task_prompts(tasks: list[str], n: int) -> dict[str, list]:
    """The first n prompts of each task, as the eval builds them (chat messages for GSM8K)."""
    return {task: [it.prompt for it in get_task(task).load_items(None, chat=True)[:n]] for task in tasks}


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="planes")
    ap.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per task (the first ones)")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None, help="the model's name in the trace (default: --model)")
    ap.add_argument("--prompts-file", type=Path, default=None,
                    help="JSON {task: [prompt, ...]} instead of the task datasets (for machines without them)")
    ap.add_argument("--out", type=Path, default=TRACE_DIR)
    args = ap.parse_args(argv)
    name = args.name or args.model
    llm = selfspec.load(args.model, args.recipe, gamma=args.gamma, device=args.device)
    trace = {"model": name, "recipe": args.recipe, "draft": llm.recipe.draft, "verify": llm.recipe.verify,
             "gamma": args.gamma, "max_new_tokens": args.max_new_tokens, "tasks": {}}
    prompts = task_prompts(args.tasks, args.prompts) if args.prompts_file is None else load(args.prompts_file)
    for task, texts in prompts.items():
        trace["tasks"][task] = record(llm, texts[: args.prompts], args.gamma, args.max_new_tokens)
        acc = trace["tasks"][task]
        print(f"{task}: {len(acc)} rounds, mean accepted {sum(acc) / len(acc):.2f} of {args.gamma}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.{args.recipe}.json"
    with open(path, "w") as f:
        json.dump(trace, f)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
