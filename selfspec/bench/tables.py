"""Quasar's tables (`selfspec bench spec --tables`), each cell a trace recorded on a real model and task
(bench/traces.py) replayed through the real decoding loop on the target (bench/spec.py):

  Table 1  tokens/s and mean acceptance length per recipe and task, vs BF16 AR (greedy, gamma --gamma)
  Table 2  acceptance length and speedup vs the sampling temperature (traces recorded sampling at that temperature)
  Table 3  acceptance length and speedup vs gamma, and vs the n-gram sizes looked up for lookup recipes

selfspec bench spec --tables [--trace-model smollm2-135m] [--recipes ngram hybrid planes] [--tasks ...]
                    [--shape llama-3-8b | --device cpu] [--out bench-results/tables] [--smoke]

Traces are read from --trace-dir where one matches (model, recipe, drafter, temperature, gamma), else recorded on
--trace-model and written to OUT/traces. The target is a synthetic-weight --shape under CUDA graphs (GPU), or with
--device cpu the trace model itself. The replay decodes greedily whatever the trace's temperature (its acceptance
is the sampled one; the sampling's own cost is left out); a cell replays each of its rounds once.
Output: OUT/tables.json, tables.md, tables.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from selfspec.bench.spec import decode_speed, draft_mode, expected_tokens, replayed_speed
from selfspec.bench.traces import DEFAULT_GAMMA, TASKS, TRACE_DIR, Trace, load, record_trace, task_prompts, \
    trace_path
from selfspec.errors import SelfspecError
from selfspec.quant.modes import MODES, Mode
from selfspec.speculative.drafters import make_drafter
from selfspec.speculative.recipes import PRESETS, Recipe, resolve_recipe

TEMPERATURES = (0.0, 0.25, 0.5, 0.75, 1.0)
GAMMAS = (3, 5, 7, 9)
NGRAM_RANGES = ("1-3", "2-4", "3-5")
AR = resolve_recipe("ar", verify="bf16")  # every speedup's baseline: BF16 AR on the same target

# (recipe, drafter or None: the recipe's, gamma) -> LLM; recipe "ar" -> BF16 AR (every speedup's baseline)
MakeLLM = Callable[[str, str | None, int], object]
Target = Callable[[Recipe], tuple[object, Mode | None]]  # recipe -> (model to replay on, its draft steps' mode)


class Cells:
    """Traces by (recipe, drafter, temperature, gamma): read from `trace_dir`, else recorded and written to `out`."""

    def __init__(self, make_llm: MakeLLM, name: str, prompts: dict[str, list], new_tokens: int,
                 trace_dir: Path | None, out: Path, log=print) -> None:
        self.make_llm, self.name, self.prompts, self.new_tokens = make_llm, name, prompts, new_tokens
        self.trace_dir, self.out, self.log = trace_dir, out, log
        self.traces: dict[tuple, Trace] = {}

    def trace(self, recipe: str, draft: str | None, temperature: float, gamma: int) -> Trace:
        default = PRESETS[recipe].draft
        if draft is None or make_drafter(draft) == make_drafter(default):  # ngram:1-3 is the default ngram
            draft = default
        key = (recipe, draft, temperature, gamma)
        if key not in self.traces:
            found = self.trace_dir and trace_path(self.trace_dir, self.name, recipe, draft, temperature, gamma,
                                                  default)
            old = load(found) if found and found.is_file() else None
            sizes = (max(map(len, self.prompts.values())), self.new_tokens)
            if old and set(self.prompts) <= set(old.tasks) and (old.prompts, old.max_new_tokens) == sizes:
                self.traces[key] = old
            else:
                llm = self.make_llm(recipe, None if draft == default else draft, gamma)
                t = record_trace(llm, self.name, self.prompts, gamma, self.new_tokens, temperature, self.log)
                t.save(trace_path(self.out, self.name, recipe, t.draft, temperature, gamma, default))
                self.traces[key] = t
        return self.traces[key]


def replay_row(target: Target, recipe: str, trace: Trace, rounds, gamma: int, context: int,
               ar_tokens_per_s: float) -> dict:
    """A cell: every round of `rounds` replayed once (the tokens they commit), at gamma."""
    model, mode = target(PRESETS[recipe])
    tokens = sum(r.cut(gamma).accepted + 1 for r in rounds)
    speed = replayed_speed(model, MODES[PRESETS[recipe].verify], mode, rounds, gamma, context, tokens)
    return {"recipe": recipe, "draft": trace.draft, "verify": trace.verify, "temperature": trace.temperature,
            "gamma": gamma, "trace": trace.label(), "mean_acceptance_length": expected_tokens(rounds, gamma),
            "replayed_acceptance_length": speed["mean_acceptance_length"], "tokens_per_s": speed["tokens_per_s"],
            "draft_steps_per_round": speed["draft_steps"] / max(1, speed["rounds"]),
            "ar_bf16_tokens_per_s": ar_tokens_per_s, "speedup": speed["tokens_per_s"] / ar_tokens_per_s}


def run(cells: Cells, target: Target, recipes: list[str], gamma: int, temperatures: list[float], gammas: list[int],
        ngram_ranges: list[str], context: int, ar_tokens: int, log=print) -> dict:
    """Every table's rows; `target` gives the model each recipe's traces replay on."""
    ar_model, _ = target(AR)
    ar = decode_speed(ar_model, MODES[AR.verify], None, 0, context, ar_tokens)["tokens_per_s"]
    log(f"BF16 AR: {ar:.1f} tok/s")
    rows = {"1": [], "2": [], "3": []}
    for recipe in recipes:
        t = cells.trace(recipe, None, 0.0, gamma)
        for task, rounds in t.tasks.items():
            rows["1"].append({"task": task, **replay_row(target, recipe, t, rounds, gamma, context, ar)})
        for temp in temperatures:
            t = cells.trace(recipe, None, temp, gamma)
            rows["2"].append(replay_row(target, recipe, t, t.rounds(), gamma, context, ar))
        for g in gammas:
            t = cells.trace(recipe, None, 0.0, g)
            rows["3"].append(replay_row(target, recipe, t, t.rounds(), g, context, ar))
        if (PRESETS[recipe].draft or "").startswith("ngram"):
            for r in ngram_ranges:
                t = cells.trace(recipe, f"ngram:{r}", 0.0, gamma)
                row = replay_row(target, recipe, t, t.rounds(), gamma, context, ar)
                rows["3"].append({**row, "draft": f"ngram:{r}"})  # the default range's trace says "ngram"
        log(f"{recipe}: done")
    return {"ar_bf16_tokens_per_s": ar, "context": context, "tables": rows}


def markdown(result: dict, title: str) -> str:
    t = result["tables"]
    fmt = lambda r: (f"{r['mean_acceptance_length']:.2f} | {r['tokens_per_s']:.1f} | "  # noqa: E731
                     f"{r['speedup']:.2f}x |")
    out = [f"# Speculative decoding, acceptance replayed: {title}", "",
           f"BF16 AR: {result['ar_bf16_tokens_per_s']:.1f} tok/s (batch 1, context {result['context']}). "
           "Mean acceptance length: tokens a round commits (accepted drafts + 1), from the trace.", "",
           "## Table 1: per recipe and task (greedy)", "",
           "| task | recipe | draft -> verify | gamma | mean acc. length | tok/s | vs BF16 AR |", "|" + "---|" * 7]
    out += [f"| {r['task']} | {r['recipe']} | {r['draft']} -> {r['verify']} | {r['gamma']} | " + fmt(r) for r in t["1"]]
    out += ["", "## Table 2: temperature (all tasks)", "",
            "| recipe | temperature | gamma | mean acc. length | tok/s | vs BF16 AR |", "|" + "---|" * 6]
    out += [f"| {r['recipe']} | {r['temperature']:g} | {r['gamma']} | " + fmt(r) for r in t["2"]]
    out += ["", "## Table 3: gamma and n-gram sizes (greedy, all tasks)", "",
            "| recipe | drafter | gamma | mean acc. length | tok/s | vs BF16 AR |", "|" + "---|" * 6]
    out += [f"| {r['recipe']} | {r['draft']} | {r['gamma']} | " + fmt(r) for r in t["3"]]
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path, title: str) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[eval]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = result["tables"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    tasks = list(dict.fromkeys(r["task"] for r in t["1"]))
    recipes = list(dict.fromkeys(r["recipe"] for r in t["1"]))
    width = 0.8 / max(1, len(recipes))
    for i, recipe in enumerate(recipes):
        ys = [next(r["speedup"] for r in t["1"] if r["recipe"] == recipe and r["task"] == task) for task in tasks]
        axes[0].bar([j + i * width for j in range(len(tasks))], ys, width, label=recipe)
    axes[0].set(xticks=[j + 0.4 - width / 2 for j in range(len(tasks))], xticklabels=tasks, ylabel="x BF16 AR",
                title="Table 1: speedup per task")
    for recipe in recipes:
        pts = [(r["temperature"], r["speedup"]) for r in t["2"] if r["recipe"] == recipe]
        axes[1].plot(*zip(*pts), marker="o", label=recipe)
        pts = [(r["gamma"], r["speedup"]) for r in t["3"]
               if r["recipe"] == recipe and r["draft"] == PRESETS[recipe].draft]
        axes[2].plot(*zip(*pts), marker="o", label=recipe)
    axes[1].set(xlabel="temperature", ylabel="x BF16 AR", title="Table 2: speedup vs temperature")
    axes[2].set(xlabel="gamma", ylabel="x BF16 AR", title="Table 3: speedup vs gamma")
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def llm_target(make_llm: MakeLLM, gamma: int) -> Target:
    """Replay on the trace model itself (CPU): the recipe's LLM, its draft steps in its drafter's mode."""
    def target(recipe: Recipe):
        llm = make_llm(recipe.name, None, gamma)
        # The LLM's own draft mode (with a layer-skip recipe's skipped layers), else the recipe's (hybrid's upper).
        return llm.runner, llm.draft_mode or draft_mode(recipe.name, recipe.draft)
    return target


def synthetic_target(shape: str, max_len: int) -> Target:
    """Replay on a synthetic-weight shape in each recipe's storage, under CUDA graphs (one model at a time)."""
    from selfspec.bench.synthetic import synthetic_model
    from selfspec.engine.graphs import GraphedModel

    built: dict[tuple, object] = {}

    def target(recipe: Recipe):
        key = (recipe.storage, recipe.rotate)
        if key not in built:
            built.clear()
            torch.cuda.empty_cache()
            built[key] = GraphedModel(synthetic_model(shape, recipe.storage, rotate=recipe.rotate), max_len=max_len)
        return built[key], draft_mode(recipe.name, recipe.draft)
    return target


def cached(make: MakeLLM) -> MakeLLM:
    """One LLM per (recipe, drafter): recording and replay share it, gamma only sizes the calls."""
    llms: dict[tuple, object] = {}

    def get(recipe: str, draft: str | None = None, gamma: int = DEFAULT_GAMMA):
        if (recipe, draft) not in llms:
            llms[(recipe, draft)] = make(recipe, draft, gamma)
        return llms[(recipe, draft)]
    return get


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    import selfspec

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-model", default="smollm2-135m", help="the real model traces are recorded on")
    ap.add_argument("--trace-device", default=None, help="where traces are recorded (default: --device)")
    ap.add_argument("--recipes", nargs="+", default=["ngram", "hybrid", "planes"])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per task")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens recorded per prompt")
    ap.add_argument("--gamma", type=int, default=DEFAULT_GAMMA, help="gamma of tables 1 and 2")
    ap.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    ap.add_argument("--gammas", type=int, nargs="+", default=list(GAMMAS))
    ap.add_argument("--ngram-ranges", nargs="+", default=list(NGRAM_RANGES), help="MIN-MAX n-gram sizes")
    ap.add_argument("--device", default="cuda", help="cuda: replay on --shape; cpu: on the trace model itself")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens before the replayed decode")
    ap.add_argument("--ar-tokens", type=int, default=256, help="tokens the BF16 AR baseline decodes")
    ap.add_argument("--trace-dir", type=Path, default=TRACE_DIR, help="recorded traces to use where one matches")
    ap.add_argument("--out", type=Path, default=Path("bench-results/tables"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (1 prompt x 8 tokens per task, 2 temperatures, "
                                                         "2 gammas, 2 n-gram ranges, context 32, 8 AR tokens)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.new_tokens, args.context, args.ar_tokens = 1, 8, 32, 8
        args.temperatures, args.gammas, args.ngram_ranges = [0.0, 1.0], [3, 5], ["1-3", "2-4"]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SelfspecError("replaying on a synthetic shape needs a CUDA GPU; add --device cpu to replay on the "
                            "trace model itself")
    torch.set_grad_enabled(False)
    trace_device = args.trace_device or args.device
    make = cached(lambda recipe, draft, gamma: selfspec.load(
        args.trace_model, recipe, draft=draft, verify=AR.verify if recipe == "ar" else None,
        gamma=max([gamma, *args.gammas]), device=trace_device))
    cells = Cells(make, args.trace_model, task_prompts(args.tasks, args.prompts), args.new_tokens, args.trace_dir,
                  args.out / "traces")
    cpu = args.device == "cpu"
    g = max([args.gamma, *args.gammas])  # the longest replay: every round of every task once
    longest = max(args.ar_tokens, len(args.tasks) * args.prompts * (args.new_tokens + g + 1))
    target = llm_target(make, args.gamma) if cpu else synthetic_target(args.shape, args.context + longest + 2 * g + 2)
    result = run(cells, target, args.recipes, args.gamma, args.temperatures, args.gammas, args.ngram_ranges,
                 args.context, args.ar_tokens)
    where = (f"{args.trace_model} on the CPU" if cpu else
             f"{torch.cuda.get_device_name()}, {args.shape} (synthetic weights), CUDA graphs")
    title = f"{where}; acceptance replayed from {args.trace_model} traces ({', '.join(args.tasks)})"
    result |= {"title": title, "synthetic": not cpu, "trace_model": args.trace_model}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tables.json").write_text(json.dumps(result, indent=1))
    report = markdown(result, title)
    (args.out / "tables.md").write_text(report)
    plot(result, args.out / "tables.png", title)
    print(report)
    print(f"wrote {args.out}/tables.json, tables.md, tables.png")
