"""Speculative decoding speed with each round replayed from a trace recorded on a real model (bench/traces.py): the
real loop (spec/decode.py) pays the round's recorded draft steps in the recipe's draft mode, runs a verify pass of
its recorded token count (a chain, or a tree's branches as rows) and accepts its recorded count, on a
synthetic-weight shape under CUDA graphs (GPU) or on a real model (CPU); against AR decoding of the verify mode and
the speed the measured step costs and the trace's acceptance predict.

python -m selfspec.bench.spec [--shape llama-3-8b] [--trace selfspec/bench/traces/smollm2-135m.planes.json]
python -m selfspec.bench.spec --shape qwen2.5-1.5b --draft-shape qwen2.5-0.5b --trace ...draft-model...json
    (recipe draft-model: its draft steps on a second synthetic model, the draft model's shape)
python -m selfspec.bench.spec --shape llama-3-70b --tensor-parallel 2 --trace ...planes.json
    (the model split across 2 GPUs, one process each; rank 0's speeds reported)
python -m selfspec.bench.spec --predict AR_MS DRAFT_MS TOKEN_MS [--trace ...]   (any machine: step costs alone)
python -m selfspec.bench.spec --tables [--trace-model smollm2-135m] [--shape llama-3-8b | --device cpu] ...
    Quasar's tables (bench/tables.py): tokens/s and acceptance length per recipe and task vs BF16 AR, vs the
    sampling temperature, vs gamma and the n-gram range.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.bench.shapes import SHAPES
from selfspec.bench.traces import (TASKS, TRACE_DIR, DraftModelReplay, Replay, Round, Trace, TreeReplay, catches_up,
                                   load, replay)
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.parallel import SOLO, TensorParallel, check_tensor_parallel
from selfspec.parallel.launch import on_ranks
from selfspec.quant.modes import MODES, Mode
from selfspec.speculative.decode import decode
from selfspec.speculative.drafters import draft_modes
from selfspec.speculative.recipes import PRESETS
from selfspec.speculative.sampling import SamplingParams

if TYPE_CHECKING:
    from selfspec.engine.graphs import GraphedModel


# The draft-model peer (`selfspec bench all`, part draft-peer): Qwen2.5-Coder-0.5B drafting for the 1.5B beside the
# 1.5B's self-drafts, each replayed from its trace at the pair's own shapes.
PEER_SHAPE, PEER_DRAFT_SHAPE = "qwen2.5-1.5b", "qwen2.5-0.5b"
PEER_TRACES = [TRACE_DIR / f"qwen2.5-coder-1.5b.{name}.json"
               for name in ("ngram.recycle-tree", "hybrid", "planes", "draft-model.qwen2.5-coder-0.5b")]


def expected_tokens(rounds: list[Round], k: int) -> float:
    """Mean tokens a round commits when it drafts at most k: its accepted drafts plus the verify pass's token."""
    return 1 + sum(r.cut(k).accepted for r in rounds) / len(rounds)


def predicted_speedup(rounds: list[Round], k: int, ar_ms: float, draft_ms: float, token_ms: float) -> float:
    """Speed over AR of the rounds drafting at most k, from step costs alone: an AR step of ar_ms, a draft step of
    draft_ms, and a verify pass of t tokens costing ar_ms + token_ms (t - 1) (flat at batch 1 on a GPU)."""
    cut = [r.cut(k) for r in rounds]
    ms = sum(r.draft_steps * draft_ms + ar_ms + token_ms * (r.verified - 1) for r in cut)
    return sum(r.accepted + 1 for r in cut) * ar_ms / ms


def predict(traces: list[Path], gammas: list[int], costs: tuple[float, float, float]) -> str:
    """A markdown table of every trace's predicted speedup over AR per task and gamma (no GPU)."""
    out = ["| trace | gamma | " + " | ".join(TASKS) + " | mean |", "|" + "---|" * (len(TASKS) + 3)]
    for path in traces:
        t = load(path)
        if (why := unreplayable(t)) is not None:
            out.append(f"| {path.name} | skipped: {why} |")
            continue
        for k in [g for g in gammas if g <= t.gamma]:
            cells = {task: predicted_speedup(rs, k, *costs) for task, rs in t.tasks.items()}
            row = [f"{cells[task]:.2f}x ({expected_tokens(t.tasks[task], k):.2f})" if task in cells else "-"
                   for task in TASKS]
            out.append(f"| {path.name} | {k} | " + " | ".join(row) + f" | {sum(cells.values()) / len(cells):.2f}x |")
    return "\n".join(out)


def draft_mode(recipe: str, draft: str | None, draft_vocab: int = 0) -> Mode | None:
    """The mode a recipe's replayed draft steps run in on one model: None for a lookup (it pays none) and for a
    draft model (its steps are another model's: not replayable here)."""
    modes = draft_modes(draft) if draft and recipe != "draft-model" else []
    return replace(MODES[modes[0]], draft_vocab=bool(draft_vocab)) if modes else None


def unreplayable(t: Trace, draft_shape: str | None = None) -> str | None:
    """Why a trace cannot be replayed on a synthetic shape (recipe draft-model's: without the draft model's shape),
    or None if it can."""
    if t.draft_model or t.recipe == "draft-model":
        if draft_shape is None:
            return (f"its draft steps are another model's ({t.draft_model}): give --draft-shape, the shape of "
                    f"{t.draft_model}")
        return None
    if t.recipe not in PRESETS:
        return f"recipe '{t.recipe}' is not a preset"
    if draft_mode(t.recipe, t.draft) is None and any(r.draft_steps for r in t.rounds()):
        return f"its rounds pay draft steps, but its drafter '{t.draft}' has no draft mode"
    return None


def replayable_traces(trace_dir: Path = TRACE_DIR) -> list[Path]:
    """Every trace file in trace_dir that bench spec can replay (the default of `bench spec` and `bench all`)."""
    return [p for p in sorted(trace_dir.glob("*.json")) if unreplayable(load(p)) is None]


def draft_model(t: Trace, draft_shape: str, max_len: int) -> GraphedModel:
    """A draft-model trace's drafter: a synthetic model of draft_shape stored for the trace's draft mode, under
    CUDA graphs (a GraphedModel)."""
    from selfspec.bench.synthetic import synthetic_model
    from selfspec.engine.graphs import GraphedModel
    from selfspec.speculative.recipes import resolve_recipe

    storage = resolve_recipe("ar", None, t.draft).storage
    return GraphedModel(synthetic_model(draft_shape, storage, seed=1), max_len=max_len)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_speed(model, verify: Mode, draft, k: int, context: int, new_tokens: int, warm_tokens: int = 32) -> dict:
    """Decode tokens/s of the real loop (batch 1) from a random `context`-token prompt: `draft` a replaying drafter
    (k: the gamma it is asked) or None (AR). A first untimed run captures the graphs of every step shape. The prompt
    is seeded: under tensor parallelism every rank decodes the same one."""
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    accept = {} if draft is None else {"accept": draft.accept}
    for warm in (True, False):
        stats = GenerationStats()
        n, t0 = 0, None
        for chunk in decode(model, prompt, verify, draft, k if draft else 0, params, stats, **accept):
            if t0 is None:  # after the prefill
                sync(model.device)
                t0 = time.perf_counter()
                continue
            n += len(chunk)
            if n >= (min(warm_tokens, new_tokens) if warm else new_tokens):
                break
    sync(model.device)
    return {"tokens_per_s": n / (time.perf_counter() - t0), "tokens": n, "rounds": stats.rounds,
            "accepted": stats.draft_accepted, "mean_acceptance_length": (n / stats.rounds) if stats.rounds else 1.0}


def replayed_speed(model, verify: Mode, draft: Mode | None, rounds: list[Round], k: int, context: int,
                   new_tokens: int, drafter: Replay | None = None) -> dict:
    """decode_speed of rounds replayed at gamma k, draft steps in mode `draft` (the replay's draft steps and
    verified tokens added); `drafter` replays them instead where given (a draft model's)."""
    drafter = drafter or replay(rounds, draft)
    # Tree rounds vary in shape (rows, tokens, nodes): the untimed run goes through them all, capturing their graphs.
    warm = new_tokens if isinstance(drafter, TreeReplay) else 32
    out = decode_speed(model, verify, drafter, k, context, new_tokens, warm)
    return {**out, "draft_steps": drafter.steps, "verified_tokens": drafter.verified}


def measure(shape: str, traces: list[Path], gammas: list[int], context: int,
            draft_shape: str | None = None, tp: TensorParallel = SOLO) -> list[dict]:
    """Every trace's tasks replayed at each gamma on a synthetic shape (GPU, CUDA graphs), against AR of the verify
    mode and the speed predicted from the step costs. Recipe draft-model's draft steps run on a second synthetic
    model of `draft_shape`, under CUDA graphs too. Under tensor parallelism (`tp`), this rank's shard: every rank
    replays the same rounds (they meet in each pass's collectives)."""
    from selfspec.bench.steps import ar_ms_per_step, pass_ms
    from selfspec.bench.synthetic import synthetic_model
    from selfspec.engine.graphs import GraphedModel

    rows = []
    log = print if tp.rank == 0 else lambda *a, **k: None
    by_recipe: dict[str, list] = {}
    for path in traces:
        t = load(path)
        if (why := unreplayable(t, draft_shape)) is not None:
            log(f"skipping {path.name}: {why}", flush=True)
            continue
        by_recipe.setdefault(t.recipe, []).append(t)
    for recipe, recipe_traces in by_recipe.items():
        r = PRESETS[recipe]
        gm = GraphedModel(synthetic_model(shape, r.storage, rotate=r.rotate, tp=tp), max_len=context + 512)
        vocabs = {t.draft_vocab for t in recipe_traces} - {0}
        if len(vocabs) > 1:
            raise SelfspecError(f"traces of recipe {recipe} with draft vocabularies of {sorted(vocabs)} tokens: "
                                "replay one size a run")
        if vocabs:  # synthetic weights: which tokens' rows the draft head holds does not change its cost
            gm.model.set_draft_vocab(list(range(vocabs.pop())))
        ar_ms = ar_ms_per_step(gm, r.verify, 1, context)
        for t in recipe_traces:
            mode = draft_mode(recipe, t.draft, t.draft_vocab)
            draft_ms = pass_ms(gm, mode, 1, 1, context) if mode else 0.0
            drafting = draft_model(t, draft_shape, gm.max_len) if recipe == "draft-model" else None
            if drafting is not None:
                draft_ms = pass_ms(drafting, t.draft, 1, 1, context)
            for task, rounds in t.tasks.items():
                for k in [g for g in gammas if g <= t.gamma]:  # a round cannot draft past its recording
                    cut = [x.cut(k) for x in rounds]
                    steps = sum(x.draft_steps for x in cut) / len(cut)
                    if drafting is not None:  # the draft model's catch-up steps
                        steps += sum(map(catches_up, cut)) / len(cut)
                    branches = round(sum(x.branches for x in cut) / len(cut))  # the mean verify pass's shape
                    tokens = round(sum(x.width + 1 for x in cut) / len(cut))
                    verify_ms = pass_ms(gm, r.verify, branches, tokens, context)
                    predicted = 1000 * expected_tokens(rounds, k) / (steps * draft_ms + verify_ms)
                    drafter = (DraftModelReplay(rounds, MODES[t.draft], drafting, gm.max_len) if drafting is not None
                               else None)
                    measured = replayed_speed(gm, MODES[r.verify], mode, rounds, k, context, 256,
                                              drafter)["tokens_per_s"]
                    row = {"shape": shape, "synthetic": True, "recipe": recipe, "draft": t.draft,
                           "draft_vocab": t.draft_vocab, "verify": r.verify,
                           "trace": t.label(task), "gamma": k,
                           "acceptance_rate": sum(x.accepted for x in cut) / max(1, sum(x.proposed for x in cut)),
                           "mean_acceptance_length": expected_tokens(rounds, k),
                           "ar_tokens_per_s": 1000 / ar_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
                           "predicted_tokens_per_s": predicted, "tokens_per_s": measured}
                    if drafting is not None:
                        row |= {"draft_model": t.draft_model, "draft_shape": draft_shape,
                                "draft_weight_bytes": drafting.model.weight_bytes()}
                    rows.append(row)
                    log(f"{recipe} {t.label(task)} k={k}: acc {row['acceptance_rate']:.2f}, "
                          f"{measured:.1f} tok/s (predicted {predicted:.1f}; AR {1000 / ar_ms:.1f})", flush=True)
        del gm
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| recipe | acceptance replayed from | gamma | acceptance | mean acc. length | draft ms | verify ms "
           "| AR tok/s | spec tok/s | predicted | measured/predicted | spec/AR |", "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['recipe']} ({r['draft']} -> {r['verify']}) | {r['trace']} | {r['gamma']} "
                   f"| {100 * r['acceptance_rate']:.1f}% | {r['mean_acceptance_length']:.2f} | {r['draft_ms']:.2f} "
                   f"| {r['verify_ms']:.2f} | {r['ar_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} "
                   f"| {r['predicted_tokens_per_s']:.1f} | {r['tokens_per_s'] / r['predicted_tokens_per_s']:.2f} "
                   f"| {r['tokens_per_s'] / r['ar_tokens_per_s']:.2f}x |")
    return "\n".join(out)


def means(rows: list[dict]) -> str:
    """Per recipe (and gamma), the mean over the tasks of tokens/s and of spec/AR: a markdown table."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["recipe"], r["draft"], r["verify"], r["gamma"]), []).append(r)
    out = ["| recipe | gamma | tasks | mean tok/s | mean spec/AR |", "|---|---|---|---|---|"]
    for (recipe, draft, verify, k), rs in groups.items():
        out.append(f"| {recipe} ({draft} -> {verify}) | {k} | {len(rs)} "
                   f"| {sum(r['tokens_per_s'] for r in rs) / len(rs):.1f} "
                   f"| {sum(r['tokens_per_s'] / r['ar_tokens_per_s'] for r in rs) / len(rs):.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--tables" in argv:  # its own arguments (and --help)
        from selfspec.bench import tables

        tables.main([a for a in argv if a != "--tables"], prog=f"{prog or 'python -m selfspec.bench.spec'} --tables")
        return
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", action="store_true", help="Quasar's tables 1-3 (bench/tables.py): "
                                                          "`--tables --help` lists their options")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--trace", type=Path, nargs="+", default=replayable_traces(),
                    help="default: every replayable trace in selfspec/bench/traces")
    ap.add_argument("--gamma", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--draft-shape", default=None, choices=list(SHAPES),
                    help="recipe draft-model's traces: the draft model's shape (e.g. qwen2.5-0.5b beside --shape "
                         "qwen2.5-1.5b); without it they are skipped")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split the model across N GPUs")
    ap.add_argument("--predict", type=float, nargs=3, metavar=("AR_MS", "DRAFT_MS", "TOKEN_MS"), default=None,
                    help="no replay: the speedup the traces predict from step costs (an AR step, a draft step, each "
                         "verified token past the first), e.g. the H100's on the 8B shape: 5.07 3.72 0.08")
    args = ap.parse_args(argv)
    if args.predict:
        print("predicted speedup over AR (mean tokens a round), from step costs "
              f"AR {args.predict[0]} ms, draft {args.predict[1]} ms, {args.predict[2]} ms a verified token")
        print(predict(args.trace, args.gamma, tuple(args.predict)))
        return
    n = args.tensor_parallel
    if n > 1:
        if args.draft_shape is not None:
            raise SelfspecError("--draft-shape with --tensor-parallel: the draft model is not split across ranks; "
                                "replay its traces without --tensor-parallel")
        check_tensor_parallel(SHAPES[args.shape], n, 128)
    if not torch.cuda.is_available():
        raise SelfspecError("`selfspec bench spec` needs a CUDA GPU to replay on a synthetic shape; "
                            "`selfspec bench spec --tables --device cpu` replays on a real model on the CPU")
    measured = (args.shape, args.trace, args.gamma, args.context, args.draft_shape)
    rows = on_ranks(measure, n, *measured)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tensor_parallel": n, "rows": rows}, f, indent=1)
    how = "" if n == 1 else f", tensor parallel {n}"
    print(f"\n{torch.cuda.get_device_name()}, {args.shape} (synthetic weights, acceptance replayed), batch 1, "
          f"context {args.context}, CUDA graphs{how}")
    print(markdown(rows))


if __name__ == "__main__":
    main()
