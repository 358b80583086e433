"""The decoding loop: prefill, then rounds of (draft k tokens, verify k+1 positions, accept, roll back).

State between rounds, per sequence (`Row`): the cache holds KV for positions 0..length-1 and `pending` is
the last emitted token, whose KV is not yet written (it is fed at position `length` by the next pass).
`run_round` is one batched round over any number of rows; the solo loop `decode` is that round with one row,
and the serving engine (engine/engine.py) runs it over its whole batch.

With a tree drafter (several candidate continuations per round), rounds are `tree_rounds` instead: chains verified
in one pass, one row per branch, either forked (the solo cache's rows; the engine's paged cache forks each
sequence's blocks) or, for a drafter that forks no rows, all reading the sequence's own row (model.TreeLayout).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Iterator

import torch

from selfspec.cache import KVCache
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.host import long_tensor
from selfspec.model import Runner, Transformer, TreeLayout, prefill
from selfspec.quant.modes import Mode, prompt_mode
from selfspec.speculative.drafters import Drafter, RowsView, TokenHistory, TreeDrafter, as_drafter
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.sampling import SamplingParams, sample, to_probs
from selfspec.speculative.verify import accept_greedy, accept_rejection, accept_tree_sampling

GreedyAcceptance = Callable[[list[int], list[int]], tuple[int, int]]  # (drafts, verify argmaxes) -> (n, next)
TREE_LAYOUTS = ("forked", "packed", "shared")  # how a tree round's verify pass lays out its branches (tree_rounds)


@dataclass
class Row:
    """One sequence's decoding state between rounds."""
    pending: int
    length: int
    params: SamplingParams
    gen: torch.Generator | None
    stats: GenerationStats
    history: TokenHistory | None = None  # prompt + emitted tokens, for drafters that read the text (lookup)


@dataclass
class RoundResult:
    """What a round did: each row's committed tokens, and what the gamma policy and the engine's counters learn."""
    tokens: list[list[int]]  # per row, the tokens committed (accepted drafts and the verify pass's next token)
    draft_s: float  # the draft steps (a draft model's prefill of new rows left out: the policy prices steps)
    verify_s: float
    k: int  # drafts per row the verify pass checked: the longest proposal (a lookup may propose fewer than asked)
    proposed: list[int]  # per row, the drafts verified (a tree: its chosen branch's)
    accepted: list[int]  # per row, the drafts verify accepted (a lockstep row emits none of them: run_round)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    return None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    return int(logits.argmax()) if params.greedy else sample(to_probs(logits, params), gen)


@torch.inference_mode()
def decode(model: Transformer, prompt: list[int], verify: Mode, draft: Drafter | Mode | None, gamma: int,
           params: SamplingParams, stats: GenerationStats, cache: KVCache | None = None,
           accept: GreedyAcceptance = accept_greedy, policy: GammaPolicy | None = None, start: int = 0
           ) -> Iterator[list[int]]:
    """Yield the tokens each round commits (AR: one per step); the caller stops the iteration.
    Each round drafts `gamma` tokens, or with `policy` as many as it picks from measured costs and acceptance
    (at most its max_gamma, which should not exceed gamma: the cache is sized by gamma).
    `accept` judges greedy drafts (benchmarks replay recorded acceptance through it). A tree drafter needs a cache
    of a row per branch (made here when none is given) and runs `tree_rounds`. `start`: positions the given cache
    already holds (committed), which the prompt follows (a long-context benchmark's filled cache)."""
    dev = model.device
    draft = as_drafter(draft)
    tree = isinstance(draft, TreeDrafter)
    shared = tree and draft.shares_row(1)  # its branch rows read one cache row (model.TreeLayout's tails)
    gen = make_generator(params, dev)
    rows = draft.branches if tree and draft.forks else 1
    if start and cache is None:
        raise SelfspecError("decode(start=...) continues a given cache; pass the cache that holds those positions")
    nodes = draft.max_nodes(gamma) if shared else 0  # stored past the committed length before one is accepted
    cache = cache or model.new_cache(min(model.cfg.max_seq_len,
                                         len(prompt) + params.max_new_tokens + gamma + 1 + nodes), rows)
    if tree and not isinstance(cache, KVCache):
        raise SelfspecError("token trees copy KV between branch rows of the bf16 cache; a quantized KV cache "
                            "(--kv int8 / hier) drafts in chains: drop --kv or pick a chain drafter")
    if tree and cache.batch < rows:
        raise SelfspecError(f"a tree of {rows} branches needs a cache of {rows} rows, got {cache.batch}")
    t0 = time.perf_counter()
    logits = prefill(model, prompt, cache.rows(0, 1) if tree else cache, prompt_mode(verify), start)  # the last's
    if tree:  # every branch row starts from the prompt's KV
        cache.copy_positions(0, 0, start + len(prompt))
        cache.commit(start + len(prompt))
    first = pick(logits[0], params, gen)
    row = Row(first, start + len(prompt), params, gen, stats, draft.history(prompt + [first]) if draft else None)
    stats.prefill_s += time.perf_counter() - t0
    yield [row.pending]
    while row.length + 1 < cache.max_len:
        k = gamma if policy is None else policy.choose(1)
        k = min(k, cache.max_len - row.length - 1) if draft is not None else 0
        if shared and row.length + 1 + draft.max_nodes(k) > cache.max_len:  # no room for the tree's nodes
            k = 0
        if shared:
            result = tree_rounds(model, [cache], [row], k, draft, verify,
                                 lambda spans: cache.shared_rows(0, spans[0][1] - spans[0][0]), accept, "shared")
        elif tree:
            result = tree_rounds(model, [cache], [row], k, draft, verify, lambda spans: cache.rows(*spans[0]), accept)
        else:
            result = run_round(model, cache, [row], k, draft, verify, accept)
        (tokens,) = result.tokens
        cache.commit(row.length)
        if policy is not None:
            policy.observe_round(1, result.k, result.draft_s, result.verify_s)
            policy.observe_acceptance(k, result.accepted)
        yield tokens


@torch.inference_mode()
def run_round(model: Runner, cache, rows: list[Row], k: int, draft: Drafter | Mode | None, verify: Mode,
              accept: GreedyAcceptance = accept_greedy, lockstep: list[bool] | None = None
              ) -> RoundResult:
    """One speculative round over a batch: up to k drafts per row (e.g. k batched draft-mode steps, or a lookup),
    one batched verify pass over the pending token and the longest proposal (T=k+1 for a self-draft), acceptance
    per row of its real drafts (a row's padding is never judged; a row without drafts is a plain decoding step).
    A greedy row flagged in `lockstep` commits only the verify pass's token at its pending position, the plain
    decoding step's, whatever it accepted (a round drafting only to measure keeps the batch's rows in step);
    sampling rows commit what they accept (their draws stay those of their solo run).
    Returns the RoundResult; rows are updated only once every pass succeeded (a failure leaves them as
    they were). The caller commits/truncates the cache to each row's new length.
    The drafts stay on the device between steps: on a GPU the host waits twice per round (drafts, verify)."""
    dev = model.device
    t0 = time.perf_counter()
    pending = long_tensor([r.pending for r in rows], dev)
    lengths = long_tensor([r.length for r in rows], dev)[:, None]
    prefill_s = 0.0
    if k:
        proposal = as_drafter(draft).propose(model, cache, rows, pending, lengths, k)
        prefill_s = proposal.prefill_s
        k = max(proposal.counts)  # verify only as far as the longest proposal: no match costs a plain step
        drafted, counts, q = proposal.tokens[:, :k], proposal.counts, proposal.q
    else:
        drafted, counts, q = pending.new_empty((len(rows), 0)), [0] * len(rows), [None] * len(rows)
    # Waiting for the drafts here keeps draft_s and verify_s (the policy reads them) apart; a lookup's are on the host.
    drafts = [d[:n] for d, n in zip(drafted.tolist(), counts)]
    t1 = time.perf_counter()
    toks = torch.cat((pending[:, None], drafted.to(dev)), 1)
    pos = lengths + torch.arange(k + 1, device=dev)
    logits = model(toks, pos, cache, verify)
    targets = logits.argmax(-1).tolist()  # greedy rows' verify tokens: one pass and one copy, not one per row
    accepted = [accept(d, t) if r.params.greedy else accept_rejection(d, one_hot(d, lg) if qq is None else qq,
                                                                       to_probs(lg, r.params), r.gen)
                for r, d, qq, lg, t in zip(rows, drafts, q, logits, targets)]
    t2 = time.perf_counter()
    lockstep = lockstep or [False] * len(rows)
    committed = [(0, t[0]) if lock and r.params.greedy else a
                 for r, t, a, lock in zip(rows, targets, accepted, lockstep)]
    out = [advance(r, d, n, nxt, t1 - t0, t2 - t1) for r, d, (n, nxt) in zip(rows, drafts, committed)]
    return RoundResult(out, t1 - t0 - prefill_s, t2 - t1, k, list(map(len, drafts)), [n for n, _ in accepted])


@torch.inference_mode()
def run_steps(model: Runner, cache, rows: list[Row], verify: Mode, steps: int) -> RoundResult:
    """`steps` plain decoding steps of greedy rows, back to back: each step's argmax stays on the device as the
    next step's input, so the host queues every pass and then waits once for all their tokens, where run_round
    waits (and pays its own host time) once per step. A row's tokens are its AR tokens: the steps are plain
    decoding steps, and the kernels are batch invariant. The cache must hold `steps` more positions per row; the
    caller cuts each row at its stop (EOS, length, stop string: the tokens past it are computed and dropped).
    Returns one RoundResult for all the steps (k = 0, verify_s their total time)."""
    dev = model.device
    t0 = time.perf_counter()
    tok = long_tensor([r.pending for r in rows], dev)[:, None]
    pos = long_tensor([r.length for r in rows], dev)[:, None]
    out = []
    for i in range(steps):
        tok = model(tok, pos + i, cache, verify).argmax(-1)
        out.append(tok)
    tokens = torch.cat(out, 1).tolist()
    verify_s = time.perf_counter() - t0
    committed = [[t for nxt in row_tokens for t in advance(r, [], 0, nxt, 0.0, verify_s / steps)]
                 for r, row_tokens in zip(rows, tokens)]
    return RoundResult(committed, 0.0, verify_s, 0, [0] * len(rows), [0] * len(rows))


def advance(row: Row, drafts: list[int], n: int, nxt: int, draft_s: float, verify_s: float,
            deepest: int | None = None) -> list[int]:
    """Commit a row's n accepted drafts and the verify pass's next token; returns the tokens committed. The round
    counts as rejected (stats.draft_rejected) when n is below its deepest proposal: len(drafts) for a chain, or
    `deepest`, the longest branch, for a tree round."""
    row.length += n + 1
    row.pending = nxt
    s = row.stats
    s.draft_s += draft_s
    s.verify_s += verify_s
    s.rounds += 1
    s.draft_proposed += len(drafts)
    s.draft_accepted += n
    s.draft_rejected += n < (len(drafts) if deepest is None else deepest)
    out = drafts[:n] + [nxt]
    if row.history is not None:
        row.history.extend(out)
    return out


@torch.inference_mode()
def tree_rounds(model: Runner, trees: list, rows: list[Row], k: int, draft: TreeDrafter, verify: Mode,
                view: RowsView, accept: GreedyAcceptance = accept_greedy, layout: str = "packed",
                pad_to: int = 0, lockstep: list[bool] | None = None) -> RoundResult:
    """One round of a tree drafter over a batch of sequences, as forked chains: trees[i] holds rows[i]'s branch
    rows (a solo KVCache of a row per branch, or the engine's PagedTree), each holding the sequence's committed KV,
    and `view(spans)` is one batch view of rows spans[i] of each trees[i]. The drafter proposes every sequence's
    branches (its draft steps batched over the sequences); branch b of sequence i is verified in row b of trees[i]
    as a chain, every branch of every sequence in one verify pass. `layout`: "forked", each row its own tokens;
    "packed", each node once through every op but attention, which runs the branches as rows over their own KV
    (model.TreeLayout); "shared" (for a drafter that `forks` no rows), packed with trees[i] one cache row (row 0)
    that every branch row reads, each node's KV stored once past the committed length (TreeLayout's tails);
    `pad_to`: their rows padded to that width (the engine's graphs are captured at one width).
    The batch-invariant kernels make each row's verify the chain verify bit for bit, so the winning row's KV is
    already AR's, and only the positions it commits are copied to the other rows (shared: its accepted drafts moved
    to their positions): no tree-attention mask and no re-run. Greedy: the longest accepted branch wins (ties: the
    first). Sampling: multi-candidate rejection sampling down the branches (verify.py). A drafter with `ranks` gets
    each branch row's ranking of the positions it ran (`observe`). A greedy row flagged in `lockstep` commits only
    the verify pass's token at its pending position, as `run_round`'s. Rows are updated only once the verify pass
    succeeded."""
    dev = model.device
    t0 = time.perf_counter()
    proposed = draft.propose_trees(model, trees, rows, k, view) if k else [[] for _ in rows]
    width = max((len(b) for branches in proposed for b in branches), default=0)
    proposed = [branches or [[]] for branches in proposed]  # nothing proposed: a plain step on row 0
    t1 = time.perf_counter()
    if layout not in TREE_LAYOUTS:
        raise SelfspecError(f"unknown tree layout '{layout}'; choose from {', '.join(TREE_LAYOUTS)}")
    shared = layout == "shared"
    if layout != "forked" and width:  # each node once (model.TreeLayout); nothing proposed: a plain step, below
        packed, nodes, node_pos = TreeLayout.of([(row.pending, row.length, branches)
                                                 for row, branches in zip(rows, proposed)], dev, shared, pad_to)
        logits = model(nodes[None], node_pos[None], view([(0, len(branches)) for branches in proposed]), verify,
                       tree=packed)[0]
        nodes, at = packed.host_tokens, packed.host_rows  # each branch row's nodes
    else:  # each branch row runs its own tokens
        toks = [[row.pending] + b + [0] * (width - len(b)) for row, branches in zip(rows, proposed) for b in branches]
        lengths = torch.tensor([row.length for row, branches in zip(rows, proposed) for _ in branches], device=dev)
        logits = model(torch.tensor(toks, device=dev), lengths[:, None] + torch.arange(width + 1, device=dev),
                       view([(0, len(branches)) for branches in proposed]), verify).flatten(0, 1)
        nodes, at = [t for r in toks for t in r], [list(range(i * (width + 1), (i + 1) * (width + 1)))
                                                   for i in range(len(toks))]
    best_next = logits.argmax(-1)  # logits [nodes, vocab]; at[r]: row r's nodes
    if draft.ranks:  # the ranking beside the argmax: one copy to the host
        ranked = torch.cat((best_next[:, None], logits.topk(draft.ranks, -1).indices), 1).tolist()
        best_next, ranked = [r[0] for r in ranked], [r[1:] for r in ranked]
    else:
        best_next = best_next.tolist()
    targets = [[best_next[i] for i in r] for r in at]  # greedy rows' verify tokens: one pass and one copy
    ends = list(accumulate(map(len, proposed)))
    if draft.ranks:
        for row, branches, end in zip(rows, proposed, ends):
            for r, b in zip(at[end - len(branches):end], branches):
                draft.observe(row, [nodes[i] for i in r[:len(b) + 1]], [ranked[i] for i in r[:len(b) + 1]])
    chosen, accepted = [], []
    for tree, row, branches, end, lock in zip(trees, rows, proposed, ends, lockstep or [False] * len(rows)):
        start = end - len(branches)
        if row.params.greedy:
            best, n, nxt = accept_branches(accept, branches, targets[start:end])
        else:
            best, n, nxt = accept_tree_sampling(branches, to_probs(logits[torch.tensor(at[start:end], device=dev)],
                                                                   row.params), row.gen)
        accepted.append((len(branches[best]), n))
        if lock and row.params.greedy:  # the plain decoding step's token, at the pending position of every row
            best, n, nxt = 0, 0, targets[start][0]
        if shared:  # the accepted drafts from their tails (nodes in order from the pending token's position)
            path = at[start + best]
            tree.move_positions(0, [row.length + i - path[0] for i in path[1:n + 1]],
                                list(range(row.length + 1, row.length + n + 1)))
        else:  # the pending token and the accepted drafts, to every other row
            tree.copy_positions(best, row.length, row.length + n + 1)
        chosen.append((branches[best], n, nxt))
    t2 = time.perf_counter()
    # A tree round counts as rejected when it accepted fewer drafts than its deepest branch (GenerationStats).
    out = [advance(row, b, n, nxt, t1 - t0, t2 - t1, max(map(len, branches)))
           for row, branches, (b, n, nxt) in zip(rows, proposed, chosen)]
    return RoundResult(out, t1 - t0, t2 - t1, width, [p for p, _ in accepted], [n for _, n in accepted])


def accept_branches(accept: GreedyAcceptance, branches: list[list[int]], targets: list[list[int]]
                    ) -> tuple[int, int, int]:
    """A greedy tree round's (branch, accepted drafts, next token): the longest accepted branch, ties to the first.
    An acceptance with a rule of its own for trees (`tree`: a benchmark's replay of one recorded count a round)
    decides instead."""
    rule = getattr(accept, "tree", None)
    if rule is not None:
        return rule(branches, targets)
    results = [accept(b, t) for b, t in zip(branches, targets)]
    best = max(range(len(branches)), key=lambda i: (results[i][0], -i))
    return (best, *results[best])


def one_hot(drafts: list[int], logits: torch.Tensor) -> torch.Tensor:
    """q [len(drafts), V] of proposals that were not sampled (a lookup's): all mass on each draft."""
    q = logits.new_zeros((len(drafts), logits.shape[-1]), dtype=torch.float32)
    q[torch.arange(len(drafts), device=q.device), torch.tensor(drafts, dtype=torch.long, device=q.device)] = 1.0
    return q

