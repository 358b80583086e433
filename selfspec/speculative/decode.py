"""The decoding loop: prefill, then rounds of (draft k tokens, verify k+1 positions, accept, roll back).

State between rounds, per sequence (`Row`): the cache holds KV for positions 0..length-1 and `pending` is
the last emitted token, whose KV is not yet written (it is fed at position `length` by the next pass).
`run_round` is one batched round over any number of rows; the solo loop `decode` is that round with one row,
and the serving engine (engine/engine.py) runs it over its whole batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from selfspec.cache import KVCache
from selfspec.engine.stats import GenerationStats
from selfspec.model import Transformer
from selfspec.quant.modes import Mode
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.sampling import SamplingParams, sample, to_probs
from selfspec.speculative.verify import accept_greedy, accept_rejection

GreedyAcceptance = Callable[[list[int], list[int]], tuple[int, int]]  # (drafts, verify argmaxes) -> (n, next)


@dataclass
class Row:
    """One sequence's decoding state between rounds."""
    pending: int
    length: int
    params: SamplingParams
    gen: torch.Generator | None
    stats: GenerationStats


@dataclass
class RoundTiming:
    draft_s: float
    verify_s: float


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    return None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    return int(logits.argmax()) if params.greedy else sample(to_probs(logits, params), gen)


@torch.inference_mode()
def decode(model: Transformer, prompt: list[int], verify: Mode, draft: Mode | None, gamma: int,
           params: SamplingParams, stats: GenerationStats, cache: KVCache | None = None,
           accept: GreedyAcceptance = accept_greedy, policy: GammaPolicy | None = None) -> Iterator[list[int]]:
    """Yield the tokens each round commits (AR: one per step); the caller stops the iteration.
    Each round drafts `gamma` tokens, or with `policy` as many as it picks from measured costs and acceptance
    (at most its max_gamma, which should not exceed gamma: the cache is sized by gamma).
    `accept` judges greedy drafts (benchmarks replay recorded acceptance through it)."""
    dev = model.device
    gen = make_generator(params, dev)
    cache = cache or model.new_cache(min(model.cfg.max_seq_len, len(prompt) + params.max_new_tokens + gamma + 1))
    t0 = time.perf_counter()
    last = torch.tensor([len(prompt) - 1], device=dev)  # only the last position's logits
    logits = model(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev), cache, verify, last)
    cache.commit(len(prompt))
    row = Row(pick(logits[0], params, gen), len(prompt), params, gen, stats)
    stats.prefill_s += time.perf_counter() - t0
    yield [row.pending]
    while row.length + 1 < cache.max_len:
        k = gamma if policy is None else policy.choose(1)
        k = min(k, cache.max_len - row.length - 1) if draft is not None else 0
        accepted = stats.draft_accepted
        (tokens,), timing = run_round(model, cache, [row], k, draft, verify, accept)
        cache.commit(row.length)
        if policy is not None:
            policy.observe_round(1, k, timing.draft_s, timing.verify_s)
            policy.observe_acceptance(k, [stats.draft_accepted - accepted])
        yield tokens


@torch.inference_mode()
def run_round(model: Transformer, cache, rows: list[Row], k: int, draft: Mode | None, verify: Mode,
              accept: GreedyAcceptance = accept_greedy) -> tuple[list[list[int]], RoundTiming]:
    """One speculative round over a batch: k batched draft steps (T=1), one batched verify pass (T=k+1),
    acceptance per row. Returns each row's committed tokens; rows are updated only once every pass succeeded
    (a failure leaves them as they were). The caller commits/truncates the cache to each row's new length.
    The drafts stay on the device between steps: on a GPU the host waits twice per round (drafts, verify)."""
    dev = model.device
    t0 = time.perf_counter()
    pending = torch.tensor([r.pending for r in rows], device=dev)
    lengths = torch.tensor([r.length for r in rows], device=dev)[:, None]
    if k:
        drafted, q = draft_tokens(model, cache, rows, pending, lengths, k, draft)
    else:
        drafted, q = pending.new_empty((len(rows), 0)), [None] * len(rows)
    drafts = drafted.tolist()  # waiting for the drafts here keeps draft_s and verify_s (the policy reads them) apart
    t1 = time.perf_counter()
    toks = torch.cat((pending[:, None], drafted), 1)
    pos = lengths + torch.arange(k + 1, device=dev)
    logits = model(toks, pos, cache, verify)
    targets = logits.argmax(-1).tolist()  # greedy rows' verify tokens: one pass and one copy, not one per row
    accepted = [accept(d, t) if r.params.greedy else accept_rejection(d, qq, to_probs(lg, r.params), r.gen)
                for r, d, qq, lg, t in zip(rows, drafts, q, logits, targets)]
    t2 = time.perf_counter()
    out = []
    for r, d, (n, nxt) in zip(rows, drafts, accepted):
        r.length += n + 1
        r.pending = nxt
        s = r.stats
        s.draft_s += t1 - t0
        s.verify_s += t2 - t1
        s.rounds += 1
        s.draft_proposed += k
        s.draft_accepted += n
        out.append(d[:n] + [nxt])
    return out, RoundTiming(t1 - t0, t2 - t1)


def draft_tokens(model: Transformer, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                 k: int, mode: Mode) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run k batched draft-mode steps from each row's pending token ([B], on the device) at its length ([B, 1]);
    their KV lands in the cache past each row's length and is overwritten by the verify pass. Returns the drafts
    [B, k] on the device and (sampling rows) the probabilities [k, V] each was drawn from. When every row is
    greedy, each step's argmax feeds the next step on the device, with no host round trip between steps."""
    dev = model.device
    greedy = all(r.params.greedy for r in rows)
    probs = [[] for _ in rows]
    toks = pending
    steps = []
    for i in range(k):
        logits = model(toks[:, None], lengths + i, cache, mode)[:, -1]
        toks = logits.argmax(-1)
        if not greedy:
            picks = toks.tolist()
            for j, r in enumerate(rows):
                if not r.params.greedy:
                    probs[j].append(to_probs(logits[j], r.params))
                    picks[j] = sample(probs[j][-1], r.gen)
            toks = torch.tensor(picks, device=dev)
        steps.append(toks)
    return torch.stack(steps, 1), [torch.stack(p) if p else None for p in probs]
