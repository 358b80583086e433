"""`selfspec eval` arguments -> run the evaluation -> write and print the report."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from selfspec.errors import SelfspecError
from selfspec.eval.report import write_report
from selfspec.eval.runner import plan_configs, run_eval


def split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_data(pairs: list[str]) -> dict[str, Path]:
    data = {}
    for pair in pairs:
        task, sep, path = pair.partition("=")
        if not sep or not Path(path).is_file():
            raise SelfspecError(f"--data wants TASK=PATH with an existing file, got '{pair}'")
        data[task] = Path(path)
    return data


def default_out_dir(model: str | None) -> Path:
    """Where results go without --out: a git-ignored directory (the published results live in docs/eval)."""
    return Path("eval-results") / (Path(model).stem if model else "smollm2-135m")


def run_command(args: argparse.Namespace) -> None:
    tasks, modes, recipes = split(args.tasks), split(args.modes), split(args.recipes)
    out = Path(args.out) if args.out else default_out_dir(args.model)
    results = run_eval(args.model, tasks, modes, recipes, out, args.limit, args.seed, args.gamma,
                       args.max_new_tokens, args.chat, parse_data(args.data), args.group_size, args.device,
                       args.cached_only, args.batch_size, args.unsafe_sandbox, prefill_chunk=args.prefill_chunk,
                       draft_model=args.draft_model, tensor_parallel=args.tensor_parallel)
    title = f"{args.model or 'smollm2-135m'}, limit {args.limit or 'none'}, max {args.max_new_tokens} new tokens"
    write_report(out, plan_configs(modes, recipes, args.draft_model), results, tasks, title)
    print((out / "summary.md").read_text())
    print(f"per-item results and summary.json / summary.md / chart.png in {out}", file=sys.stderr)
