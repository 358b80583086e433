"""The gamma policy alone through a trace's recorded texts, at pass costs measured on a GPU: what it chooses for a
lone sequence and the throughput that gives, against plain decoding and against drafting k every round. No model
runs: a round's acceptance is the trace's round at the sequence's place in the text (traces.ServeReplay's rule,
the serving benchmark's), its cost the measured pass of its graph bucket of tokens (a tree's nodes, a lookup
chain's k + 1; a round that proposed nothing: a plain step), and plain rounds run as the engine's bursts of `burst`
steps. So a policy change can be weighed in seconds
before a GPU lease (the engine's own rounds on the GPU then say whether the costs and the rule held).

selfspec bench policy --trace selfspec/bench/traces/qwen2.5-coder-1.5b.ngram.recycle-tree.json \
    --plain-ms 4.69 --tree-ms 16:5.77 32:6.4 [--draft-ms 0.2] [--host-ms 0.3] [--tokens 128] [--sequences 8] [--runs 4]

At a batch (`--batch B`, a lookup trace's chain rounds: `replay_batch`) the requests share B rows in a closed loop,
a finished row's successor admitted as the engine admits it (`Refill`: held for company, prefilled, joining the
round); --tree-ms then prices a pass by its tokens and --plain-ms is a B-row step:
selfspec bench policy --trace selfspec/bench/traces/qwen2.5-coder-1.5b.quasar.json --batch 8 --plain-ms 3.71 \
    --tree-ms 16:3.9 40:4.82 72:6.25 --draft-ms 0.2 --host-ms 1.2 --burst-host-ms 2.1 --prefill-ms 8.2
"""
from __future__ import annotations

import argparse
import bisect
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfspec.bench.traces import TRACE_DIR, RecordedText, load
from selfspec.engine.engine import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_WAIT, finish_rate, in_step
from selfspec.engine.graphs import node_bucket
from selfspec.errors import SelfspecError
from selfspec.speculative.drafters import Drafter, TreeDrafter, gamma_policy
from selfspec.speculative.policy import GammaPolicy


@dataclass(frozen=True)
class Costs:
    plain_s: float  # a plain decoding step
    tree_s: dict[int, float]  # a tree pass by its graph's nodes bucket (16, 32, ...)
    draft_s: float = 0.0  # a drafting round's host time (proposing its tree)
    host_s: float = 0.0  # a drafting round's host time around its pass, which the warm-up's timings leave out
    burst_host_s: float = 0.0  # a burst of plain steps' host time outside its passes (scheduling, emitting)

    def pass_s(self, tokens: int) -> float:
        """A chain pass over `tokens` tokens (a batch's rows): interpolated linearly between the measured sizes
        (`tree_s` by tokens, with plain_s at its own batch's), the nearest end past them."""
        sizes = sorted(self.tree_s)
        return float(np.interp(tokens, sizes, [self.tree_s[n] for n in sizes]))

    def round_s(self, nodes: int) -> float:
        """A tree pass over `nodes` nodes (the pending token's included): its bucket's time, or the largest
        bucket's past them."""
        size = node_bucket(nodes)
        known = sorted(self.tree_s)
        return self.tree_s[known[min(bisect.bisect_left(known, size), len(known) - 1)]]


@dataclass(frozen=True)
class Choice:
    """Who chooses each round's drafts: the policy (k None); k every round (0: plain decoding); or, `oracle`, k
    only where the round at that place accepts a draft and one plain step where it would not, a bound no policy
    reaches (it knows each round's outcome before running it)."""
    k: int | None = None
    oracle: bool = False

    def drafts(self, policy: GammaPolicy, rows: int, text: RecordedText, at: int) -> int:
        if self.k is None:
            return policy.choose(rows)
        if not self.oracle:
            return self.k
        ahead = text.round_at(at).cut(self.k)
        return self.k if ahead.proposed and ahead.accepted else 0


POLICY = Choice()


def replay(policy: GammaPolicy, text: RecordedText, costs: Costs, tokens: int, sequences: int, burst: int = 4,
           choice: Choice = POLICY) -> tuple[float, int, int]:
    """Seconds, tokens and drafting rounds of `sequences` sequences of `tokens` tokens each, one after the other on
    one policy (sequence s reads the text from task s's start, cycling), each round's k as `choice` says."""
    seconds, drafting = 0.0, 0
    for s in range(sequences):
        p, made = text.task_starts[s % len(text.task_starts)], 0
        while made < tokens:
            k = choice.drafts(policy, 1, text, p)
            if k == 0:  # a burst of plain steps (the oracle's: one, then it looks again)
                steps = 1 if choice.oracle else min(burst, tokens - made)
                seconds += steps * costs.plain_s + costs.burst_host_s
                policy.observe_round(1, 0, 0.0, costs.plain_s, steps)
                p, made = p + steps, made + steps
                continue
            drafting += 1
            r = text.round_at(p).cut(k)
            if not r.proposed:  # nothing proposed: the plain pass, booked as one (decode.py `tree_rounds`)
                seconds += costs.draft_s + costs.plain_s
                policy.observe_round(1, 0, costs.draft_s, costs.plain_s)
                policy.observe_acceptance(k, [0])
                p, made = p + 1, made + 1
                continue
            verify = costs.round_s(r.nodes + 1) + costs.host_s
            seconds += costs.draft_s + verify
            policy.observe_round(1, k, costs.draft_s, verify)
            policy.observe_acceptance(k, [r.accepted])
            p, made = p + r.accepted + 1, made + r.accepted + 1
    return seconds, sequences * tokens, drafting


@dataclass(frozen=True)
class Refill:
    """How the batch refills a finished row's slot (the engine's admission, engine.py `_hold_prefill`): a waiting
    prompt is held while others decode, fewer prompts than fill half the prefill budget wait, the oldest has
    waited fewer than `wait` steps, and company may come within them (a free row past the waiting ones, a row
    whose tokens due end within the steps left, or rows finishing often enough: engine.py `finish_rate`); then up
    to chunk // prompt_tokens prompts are prefilled in one pass (pass_s + prompt_s each), emit their first token
    and join that step's round."""
    prompt_tokens: int = 512
    chunk: int = DEFAULT_PREFILL_CHUNK
    wait: int = DEFAULT_PREFILL_WAIT
    prompt_s: float = 0.0
    pass_s: float = 0.0


def replay_batch(policy: GammaPolicy, text: RecordedText, costs: Costs, tokens: int, requests: int, batch: int,
                 refill: Refill = Refill(), burst: int = 4, choice: Choice = POLICY, lengths: list[int] | None = None,
                 due: int | None = None) -> tuple[float, int, int, float]:
    """Seconds, tokens, drafting rounds and rows a decode pass of `requests` requests of `tokens` tokens each (or
    of lengths[r], bench serve's --max-new-tokens-spread; with `due`, each request due that many, its length where
    an EOS ends it, which the hold cannot foresee), served `batch` at a time by chain rounds (request r reads
    the text from task r's start) in a closed loop (bench serve's: a finished request's successor is submitted after
    the step) and admitted as `refill` says. A round verifies every row's pending token and the longest proposal,
    B(w + 1) tokens at `costs.pass_s`; the policy's rounds draft nothing while its rows are to stay in step (the
    engine's `in_step`), and a measuring round emits one token for each row due as many tokens as another (the
    engine's lockstep); plain rounds run as bursts of up to `burst` steps, to the longest output still due,
    where no prompt waits for a free row or the one waiting is held, then up to the steps its wait has left
    (engine.py `_burst`; a row that joined this step takes part after its first token). Steps are decode steps: a
    burst counts each of its own. The oracle replays batch 1 alone."""
    if choice.oracle:
        raise SelfspecError("the oracle replays one sequence at a time (replay), not a batch")
    lengths = lengths or [tokens] * requests
    starts = iter((text.task_starts[r % len(text.task_starts)], lengths[r]) for r in range(requests))
    waiting = deque([p, 0, n] for _, (p, n) in zip(range(batch), starts))  # text start, step queued at, length
    per_pass = max(1, refill.chunk // refill.prompt_tokens)
    rows: list[list[int]] = []  # each row's text position, tokens made and length
    seconds, drafting, step, passes, row_passes, rate = 0.0, 0, 0, 0, 0, 0.0
    while rows or waiting:
        joined = 0
        left = refill.wait - (step - waiting[0][1]) if waiting else 0
        company = (len(waiting) < batch - len(rows) or rate * left >= 1
                   or rows and min((due or n) - made for _, made, n in rows) <= left)
        held = not waiting or rows and len(waiting) * refill.prompt_tokens < refill.chunk // 2 and left > 0 and company
        if not held and len(rows) < batch:
            joined = min(batch - len(rows), per_pass, len(waiting))
            # the prefill emits the first token
            rows += [[p + 1, 1, n] for p, _, n in (waiting.popleft() for _ in range(joined))]
            seconds += refill.pass_s + joined * refill.prompt_s
        b = len(rows)
        keep = choice.k is None and in_step([(due or n) - made for _, made, n in rows])  # the engine's rule
        k = 0 if keep else choice.drafts(policy, b, text, 0)
        if k == 0:
            waits = waiting and b < batch
            most = left if waits and held else 1 if waits else burst
            steps, step_s = min(burst, most, max(n - made for _, made, n in rows)), costs.pass_s(b)
            seconds += steps * step_s + costs.burst_host_s
            policy.observe_round(b, 0, 0.0, step_s, steps)
            advance = [steps] * b
            passes, row_passes = passes + steps, row_passes + steps * b
        else:
            drafting, steps = drafting + 1, 1
            cut = [text.round_at(p).cut(k) for p, _, _ in rows]
            width = max(c.proposed for c in cut)
            accepted = [c.accepted if c.proposed else 0 for c in cut]
            verify = costs.pass_s(b * (width + 1)) + (costs.host_s if width else 0.0)
            seconds += costs.draft_s + verify
            policy.observe_round(b, width, costs.draft_s, verify)
            policy.observe_acceptance(k, accepted)
            alike = Counter(n - made for _, made, n in rows)  # a measuring round's rows in step (engine `_lockstep`)
            lockstep = [policy.measuring and choice.k is None and alike[n - made] > 1 for _, made, n in rows]
            advance = [1 if lock else a + 1 for a, lock in zip(accepted, lockstep)]
            passes, row_passes = passes + 1, row_passes + b
        for row, n in zip(rows, advance):
            row[0], row[1] = row[0] + n, min(row[1] + n, row[2])
        step += steps
        finished = sum(made >= n for _, made, n in rows)
        rate = finish_rate(rate, finished, steps)
        rows = [r for r in rows if r[1] < r[2]]
        waiting += [[p, step, n] for _, (p, n) in zip(range(finished), starts)]
    return seconds, sum(lengths), drafting, row_passes / max(passes, 1)


def seeded_policy(costs: Costs, drafter: Drafter | TreeDrafter, max_gamma: int, batch: int = 1) -> GammaPolicy:
    """The engine's policy for `drafter` as its warm-up leaves it: plain steps and every round of k drafts (by the
    tokens it verifies: a tree's nodes, a chain's B(k + 1)) priced from the costs."""
    policy = gamma_policy(drafter, max_gamma)
    policy.observe_round(batch, 0, 0.0, costs.plain_s)
    for k in range(1, max_gamma + 1):
        n = policy.pass_tokens(batch, k)
        policy.observe_round(n, 0, 0.0, costs.round_s(n) if batch == 1 else costs.pass_s(n))
    return policy


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    from selfspec.bench.serve import output_lengths
    from selfspec.bench.traces import serve_replay

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--plain-ms", type=float, required=True)
    ap.add_argument("--tree-ms", nargs="+", required=True,
                    help="TOKENS:MS, a verify pass by its graph bucket of tokens (a tree's nodes, a chain's k + 1), "
                         "e.g. 16:5.77 32:6.4")
    ap.add_argument("--draft-ms", type=float, default=0.0, help="a drafting round's proposing time")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="a drafting round's host time around its pass, not in the warm-up's timed passes (the "
                         "replay's policy learns it; the engine's only the part inside its round: docs/speculative.md, "
                         "session 19; 0.4-0.6 ms at batch 1 on an H200 host, 1.6-1.9 ms at batch 32 on an H100's)")
    ap.add_argument("--burst-host-ms", type=float, default=0.0,
                    help="a burst of plain steps' host time (scheduling, emitting), shared by its steps")
    ap.add_argument("--batch", type=int, default=1,
                    help="rows decoding at once (a lookup trace's chain rounds; --tree-ms then prices passes by "
                         "their tokens, B(k + 1), and --plain-ms is a B-row step)")
    ap.add_argument("--prefill-ms", type=float, default=0.0,
                    help="at --batch B: a prompt's share of its prefill pass")
    ap.add_argument("--prefill-pass-ms", type=float, default=0.0,
                    help="at --batch B: a prefill pass's own time, whatever its prompts (H200, 8B: ~2 ms)")
    ap.add_argument("--prefill-wait", type=int, default=DEFAULT_PREFILL_WAIT, metavar="STEPS",
                    help="at --batch B: the steps a lone prompt waits for company (serve's --prefill-wait)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tokens-spread", type=float, default=0.0, metavar="R",
                    help="at --batch B: each request's length drawn in [N(1 - R), N(1 + R)] (bench serve's "
                         "--max-new-tokens-spread, seed 0)")
    ap.add_argument("--tokens-due", type=int, default=None, metavar="N",
                    help="at --batch B: each request due N tokens, ending at its length as at an EOS (the prefill "
                         "hold sees only what is due; default: due its length)")
    ap.add_argument("--sequences", type=int, default=None, help="requests a run (default 8; at --batch B, 4B)")
    ap.add_argument("--runs", type=int, default=4, help="runs on one policy, as bench serve's repeats")
    ap.add_argument("--max-gamma", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        tree_s = {int(n): float(ms) / 1e3 for n, ms in (x.split(":") for x in args.tree_ms)}
    except ValueError:
        raise SelfspecError(f"--tree-ms takes TOKENS:MS pairs, got {' '.join(args.tree_ms)}") from None
    if args.batch < 1:
        raise SelfspecError(f"--batch must be >= 1, got {args.batch}")
    b = args.batch
    costs = Costs(args.plain_ms / 1e3, tree_s if b == 1 else {**tree_s, b: args.plain_ms / 1e3}, args.draft_ms / 1e3,
                  args.host_ms / 1e3, args.burst_host_ms / 1e3)
    if not Path(args.trace).is_file():
        raise SelfspecError(f"no trace at {args.trace}; the recorded ones are in selfspec/bench/traces/ "
                            f"({', '.join(sorted(p.name for p in TRACE_DIR.glob('*.json')))})")
    tasks = list(load(args.trace).tasks.values())
    text, drafter = RecordedText(tasks), serve_replay(tasks)
    if b == 1 and args.tokens_spread:
        raise SelfspecError("--tokens-spread replays requests of their own lengths at --batch B > 1")
    if b > 1 and isinstance(drafter, TreeDrafter):
        raise SelfspecError("--batch replays a lookup trace's chain rounds; a tree trace replays at batch 1")
    requests = args.sequences or (8 if b == 1 else 4 * b)
    lengths = output_lengths(requests, args.tokens, args.tokens_spread, seed=0)
    longest = max(lengths or [args.tokens])
    if args.tokens_due is not None and (b == 1 or args.tokens_due < longest):
        raise SelfspecError(f"--tokens-due replays at --batch B > 1, at least the longest request ({longest} tokens); "
                            f"got {args.tokens_due} at batch {b}")
    refill = Refill(wait=args.prefill_wait, prompt_s=args.prefill_ms / 1e3, pass_s=args.prefill_pass_ms / 1e3)

    def run(policy: GammaPolicy, choice: Choice) -> tuple[float, int, int]:
        if b == 1:
            return replay(policy, text, costs, args.tokens, requests, choice=choice)
        return replay_batch(policy, text, costs, args.tokens, requests, b, refill, choice=choice,
                            lengths=lengths, due=args.tokens_due)[:3]

    plain = run(seeded_policy(costs, drafter, args.max_gamma, b), Choice(0))[0]
    print(f"{args.trace}: {requests} requests x {args.tokens} tokens a run at batch {b}, {args.runs} runs on one "
          f"policy; plain decoding {plain:.3f} s a run")
    print("| policy | speed over plain decoding, per run | drafting rounds |\n|---|---|---|")
    for name, choice in [("policy", POLICY), *((f"k = {k} every round", Choice(k)) for k in (1, 3, 5, args.max_gamma))]:
        policy = seeded_policy(costs, drafter, args.max_gamma, b)
        runs = [run(policy, choice) for _ in range(args.runs)]
        print(f"| {name} | {', '.join(f'{plain / s:.2f}x' for s, _, _ in runs)} | "
              f"{', '.join(str(d) for _, _, d in runs)} |")
    if b > 1:
        return
    k = min(5, args.max_gamma)
    seconds, _, drafting = replay(seeded_policy(costs, drafter, args.max_gamma), text, costs, args.tokens,
                                  requests, choice=Choice(k, oracle=True))
    print(f"| oracle: k = {k} where the round accepts a draft, else a plain step | {plain / seconds:.2f}x | "
          f"{drafting} |")


if __name__ == "__main__":
    main()
