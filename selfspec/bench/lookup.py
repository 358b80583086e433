"""Cost of the n-gram lookup drafter per round, on the host: B rows with H-token histories, each round proposing
k tokens per row (speculative/drafters.py NgramDrafter.propose) and appending the committed ones to every row's
index, against the same loop with no lookup. Histories are drawn from a Zipf-like distribution over 2,000 token
ids, so n-grams of every length match, as in text.

selfspec bench lookup [--batch 32] [--history 4096 8192] [--gamma 8] [--rounds 200]
"""
from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import torch

from selfspec.speculative.drafters import NgramDrafter

TOKEN_IDS = 2000


def zipf_tokens(rng: random.Random, n: int) -> list[int]:
    weights = [1 / (i + 1) for i in range(TOKEN_IDS)]
    return rng.choices(range(TOKEN_IDS), weights, k=n)


def time_rounds(drafter: NgramDrafter | None, rows: list, gamma: int, rounds: int, rng: random.Random) -> float:
    """Seconds per round: the lookup (if any) and each row committing 1..gamma+1 tokens to its history."""
    pending = torch.zeros(len(rows), dtype=torch.long)
    commits = [[zipf_tokens(rng, rng.randint(1, gamma + 1)) for _ in rows] for _ in range(rounds)]
    t0 = time.perf_counter()
    for committed in commits:
        if drafter is not None:
            drafter.propose(None, None, rows, pending, None, gamma)
        for r, toks in zip(rows, committed):
            r.history.extend(toks)
    return (time.perf_counter() - t0) / rounds


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--history", type=int, nargs="+", default=[4096, 8192], help="tokens per row before the rounds")
    p.add_argument("--gamma", type=int, default=8, help="tokens proposed per row and round")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--min-n", type=int, default=1)
    p.add_argument("--max-n", type=int, default=3)
    args = p.parse_args(argv)
    drafter = NgramDrafter(args.max_n, args.min_n)
    rng = random.Random(0)
    print("| batch | history | build index (ms/row) | lookup + commit (us/round) | commit alone (us/round) | "
          "lookup (us/round) | rows with a proposal |")
    print("|---|---|---|---|---|---|---|")
    for h in args.history:
        texts = [zipf_tokens(rng, h) for _ in range(args.batch)]
        t0 = time.perf_counter()
        rows = [SimpleNamespace(history=drafter.history(t)) for t in texts]
        build_ms = (time.perf_counter() - t0) / args.batch * 1e3
        matched = sum(bool(r.history.lookup(args.gamma)) for r in rows) / len(rows)
        with_lookup = time_rounds(drafter, rows, args.gamma, args.rounds, rng)
        plain = time_rounds(None, rows, args.gamma, args.rounds, rng)
        print(f"| {args.batch} | {h} | {build_ms:.2f} | {with_lookup * 1e6:.0f} | {plain * 1e6:.0f} | "
              f"{(with_lookup - plain) * 1e6:.0f} | {matched:.0%} |")


if __name__ == "__main__":
    main()
