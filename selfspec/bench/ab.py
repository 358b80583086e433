"""A/B two source trees in one lease: a benchmark that writes `--json` rows with milliseconds (`steps`, `gemm`),
run in turn from an old tree and from this one (old, new, old, new, ...), each row's best time per side and their
ratio. Lent machines differ by up to 7% and drift within a lease, so a change is judged only against its old code
timed beside it.

    mkdir -p .ab/old && git archive REV selfspec | tar -x -C .ab/old     # the old tree (.ab/ is git-ignored)
    python -m selfspec.bench.ab --old .ab/old --json ab.json -- steps --batch 1 32 --verify-tokens 1 5
    python -m selfspec.bench.ab --old .ab/old -- gemm --m 1 16 32 160
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What names a row of each benchmark (the rest are its measurements).
KEYS = {"steps": ("kind", "storage", "mode", "batch", "tokens"), "gemm": ("gemm", "storage", "mode", "m")}


def run_once(tree: Path, bench: str, args: list[str]) -> list[dict]:
    """`python -m selfspec.bench.BENCH ARGS --json F` run in `tree` (`-m` puts the working directory first on the
    path): its rows."""
    tree = tree.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", f"selfspec.bench.{bench}", *args, "--json", str(out)], env=env,
                       cwd=tree, check=True)
        return json.loads(out.read_text())["rows"]


def compare(old_runs: list[list[dict]], new_runs: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """Per row (named by `keys`), the best milliseconds of each side over its runs and new / old."""
    def best(runs: list[list[dict]]) -> dict[tuple, float]:
        times: dict[tuple, float] = {}
        for rows in runs:
            for r in rows:
                k = tuple(r[f] for f in keys)
                times[k] = min(times.get(k, float("inf")), r["ms"])
        return times

    old, new = best(old_runs), best(new_runs)
    return [{**dict(zip(keys, k)), "old_ms": old[k], "new_ms": new[k], "new_over_old": new[k] / old[k]}
            for k in old if k in new]


def table(rows: list[dict], keys: tuple[str, ...]) -> str:
    out = ["| " + " | ".join(keys) + " | old ms | new ms | new / old |", "|" + "---|" * (len(keys) + 3)]
    for r in rows:
        out.append("| " + " | ".join(str(r[k]) for k in keys)
                   + f" | {r['old_ms']:.4f} | {r['new_ms']:.4f} | {r['new_over_old']:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="the old tree (a folder holding selfspec/)")
    ap.add_argument("--new", type=Path, default=Path("."), help="the new tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="old/new runs in turn")
    ap.add_argument("--json", default=None, help="write the compared rows here")
    ap.add_argument("bench", choices=list(KEYS), help="the benchmark, then its own arguments after --")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    bench_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not (args.old / "selfspec").is_dir():
        ap.error(f"--old {args.old} holds no selfspec/ package: extract the old tree there (see --help)")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        for side, tree in (("old", args.old), ("new", args.new)):
            runs[side].append(run_once(tree, args.bench, bench_args))
    rows = compare(runs["old"], runs["new"], KEYS[args.bench])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": args.bench, "args": bench_args, "old": str(args.old), "rounds": args.rounds,
                       "rows": rows, "runs": runs}, f, indent=1)
    print(table(rows, KEYS[args.bench]))


if __name__ == "__main__":
    main()
