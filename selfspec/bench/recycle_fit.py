"""Recycled trees teacher-forced: record a model's AR tokens and the verify mode's ranking at each of them once, then
replay any recycled-tree drafter (speculative/recycling.py) over them in seconds: its acceptance per task, and the
rank priors its trees are grown by, fitted to what the model actually chose.

python -m selfspec.bench.recycle_fit record --model qwen2.5-coder-1.5b --prompts 1 --max-new-tokens 128 --out R.json
python -m selfspec.bench.recycle_fit fit R.json [--nodes 15 31] [--json OUT.json]

The replay is the drafter's own code (`RecycleTree.propose_tree`, the same table and lookup) on the recorded text:
each round proposes a tree from the pending token, accepts the longest branch the AR tokens follow, and hands the
table the ranking at the pending token and each accepted draft (the recorded AR rankings). What it cannot replay
is the rankings of rejected nodes (the real drafter stores those too, computed in contexts that never happened),
so its acceptance approximates a recorded trace's (`fit` prints both where a trace is given).
"""
from __future__ import annotations

import argparse
import json
from itertools import accumulate
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.engine.stats import GenerationStats
from selfspec.quant.modes import Mode
from selfspec.speculative.decode import Row, decode
from selfspec.speculative.drafters import RecycleTree
from selfspec.speculative.recycling import DEFAULT_WIDTH, RANK_PRIORS
from selfspec.speculative.sampling import SamplingParams
from selfspec.speculative.verify import accept_greedy


class RankLog:
    """A model that keeps the top-`width` ranking of every plain decoding step's next token."""

    def __init__(self, model, width: int) -> None:
        self.model, self.width, self.ranked = model, width, []

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache, mode: Mode, *args, **kw) -> torch.Tensor:
        logits = self.model(tokens, pos, cache, mode, *args, **kw)
        if tokens.shape == (1, 1) and not args and not kw:
            self.ranked.append(logits[0, -1].topk(self.width).indices.tolist())
        return logits


def record(llm, prompts: dict[str, list], max_new_tokens: int, width: int = DEFAULT_WIDTH) -> dict:
    """Per task and prompt: the prompt's ids, the AR tokens (the prefill's first) and the ranking after each."""
    from selfspec.bench.traces import prompt_ids

    out = {}
    for task, texts in prompts.items():
        out[task] = []
        for prompt in tqdm(texts, desc=f"AR rankings {task}", leave=False):
            ids = prompt_ids(llm, prompt)
            log = RankLog(llm.runner, width)
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            tokens = []
            for step in decode(log, ids, llm.verify_mode, None, 0, params, GenerationStats()):
                tokens += step
                if len(tokens) > max_new_tokens:
                    break
            out[task].append({"prompt": ids, "tokens": tokens, "ranked": log.ranked[:len(tokens) - 1]})
    return out


def replay(drafter: RecycleTree, prompt: list[int], tokens: list[int], ranked: list[list[int]], gamma: int,
           ranks: dict | None = None) -> list[int]:
    """The drafter's rounds over the AR tokens: drafts accepted per round. With `ranks`, counts for each rank how
    often a proposed node at that rank of its parent's successors was the AR token (rank -> [hits, tries])."""
    history = drafter.history(prompt + tokens[:1])
    row = Row(tokens[0], len(prompt), SamplingParams(), None, GenerationStats(), history)
    i, accepted = 0, []
    while i + 1 < len(tokens):
        k = min(gamma, len(tokens) - 1 - i)
        branches = drafter.propose_tree(None, None, row, k)
        targets = tokens[i + 1:] + [-1]  # the verify's token at the pending one and each draft (past the end: none)
        n = max((accept_greedy(b, targets)[0] for b in branches), default=0)
        if ranks is not None:
            count_ranks(drafter, row, branches, tokens[i:], ranks)
        drafter.observe(row, tokens[i:i + n + 1], ranked[i:i + n + 1])
        history.extend(tokens[i + 1:i + n + 2])
        i += n + 1
        row.pending = tokens[min(i, len(tokens) - 1)]
        accepted.append(n)
    return accepted


def count_ranks(drafter: RecycleTree, row: Row, branches: list[list[int]], truth: list[int], ranks: dict) -> None:
    """For each node of the tree whose parent is on the AR path: its rank among the parent's successors, and whether
    it is the AR token (a node off the path says nothing: its parent was never reached)."""
    table = drafter.successors(row)
    seen = set()
    for b in branches:
        for d in range(len(b)):
            if tuple(b[:d + 1]) in seen or b[:d] != truth[1:d + 1]:
                continue
            seen.add(tuple(b[:d + 1]))
            succ = table.get(truth[d], ())
            r = succ.index(b[d]) if b[d] in succ else len(succ)
            hit = d + 1 < len(truth) and b[d] == truth[d + 1]
            ranks.setdefault(r, [0, 0])
            ranks[r][0] += hit
            ranks[r][1] += 1


def fit_priors(data: dict, base: dict, gamma: int, nodes: int, rounds: int = 3) -> tuple[float, ...]:
    """Rank priors from the replay's own hit rates, iterated (the trees a prior grows decide which ranks are tried)."""
    priors = RANK_PRIORS
    for _ in range(rounds):
        ranks: dict = {}
        drafter = RecycleTree(nodes, base=base, priors=priors)
        for runs in data.values():
            for run in runs:
                replay(drafter, run["prompt"], run["tokens"], run["ranked"], gamma, ranks)
        rates = [ranks[r][0] / ranks[r][1] if ranks.get(r, [0, 0])[1] >= 5 else None for r in range(DEFAULT_WIDTH)]
        known = [x for x in rates if x is not None]
        if not known:
            break
        priors = tuple(accumulate((max(x if x is not None else min(known), 1e-3) for x in rates), min))  # ranks fall
    return priors


def mean_length(accepted: list[int]) -> float:
    return 1 + sum(accepted) / max(len(accepted), 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="AR tokens and rankings of a model on the trace tasks")
    rec.add_argument("--model", default="smollm2-135m")
    rec.add_argument("--recipe", default="ngram", help="the recipe whose verify mode and storage run")
    rec.add_argument("--prompts", type=int, default=1)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--out", type=Path, required=True)
    fit = sub.add_parser("fit", help="replay recycled trees over a recording: acceptance, fitted priors")
    fit.add_argument("rankings", type=Path)
    fit.add_argument("--gamma", type=int, default=5)
    fit.add_argument("--nodes", type=int, nargs="+", default=[15])
    fit.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        import selfspec
        from selfspec.bench.traces import task_prompts
        from selfspec.engine.llm import seed_successors

        llm = selfspec.load(args.model, args.recipe, device=args.device)
        data = record(llm, task_prompts(["mtbench", "humaneval", "gsm8k", "essay"], args.prompts),
                      args.max_new_tokens)
        base = seed_successors(llm.tokenizer, DEFAULT_WIDTH)
        args.out.write_text(json.dumps({"model": args.model, "recipe": args.recipe, "tasks": data,
                                        "base": {str(k): v for k, v in base.items()}}))
        print(f"wrote {args.out}")
        return
    rec = json.loads(args.rankings.read_text())
    base = {int(k): tuple(v) for k, v in rec["base"].items()}
    data = rec["tasks"]
    results = []
    for nodes in args.nodes:
        fitted = fit_priors(data, base, args.gamma, nodes)
        for label, priors in (("guess", RANK_PRIORS), ("fitted", fitted)):
            drafter = RecycleTree(nodes, base=base, priors=priors)
            lengths = {t: mean_length([a for run in runs for a in replay(drafter, run["prompt"], run["tokens"],
                                                                        run["ranked"], args.gamma)])
                       for t, runs in data.items()}
            results.append({"nodes": nodes, "priors": label, "values": [round(p, 4) for p in priors], **lengths})
            print(f"{nodes:3d} nodes, {label:6s} priors {', '.join(f'{p:.3f}' for p in priors)}: "
                  + " / ".join(f"{t} {v:.2f}" for t, v in lengths.items())
                  + f"  mean {sum(lengths.values()) / len(lengths):.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
