"""The decoding loop: prefill, then rounds of (draft k tokens, verify k+1 positions, accept, roll back).

State between rounds: the cache holds KV for positions 0..L-1 and `pending` is the last emitted token,
whose KV is not yet written (it is fed at position L by the next draft or verify pass).
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from selfspec.cache import KVCache
from selfspec.engine.stats import GenerationStats
from selfspec.model import Transformer
from selfspec.quant.modes import Mode
from selfspec.spec.sampling import SamplingParams, sample, to_probs
from selfspec.spec.verify import accept_greedy, accept_rejection


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    return int(logits.argmax()) if params.greedy else sample(to_probs(logits, params), gen)


@torch.inference_mode()
def decode(model: Transformer, prompt: list[int], verify: Mode, draft: Mode | None, gamma: int,
           params: SamplingParams, stats: GenerationStats, cache: KVCache | None = None) -> Iterator[list[int]]:
    """Yield the tokens each round commits (AR: one per step); the caller stops the iteration."""
    dev = model.device
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=dev).manual_seed(params.seed)
    cache = cache or model.new_cache(min(model.cfg.max_seq_len, len(prompt) + params.max_new_tokens + gamma + 1))
    t0 = time.perf_counter()
    logits = model(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev), cache, verify)
    cache.commit(len(prompt))
    pending = _pick(logits[0, -1], params, gen)
    stats.prefill_s += time.perf_counter() - t0
    yield [pending]
    while cache.length + 1 < cache.max_len:
        k = min(gamma, cache.max_len - cache.length - 1) if draft is not None else 0
        drafts, q = draft_tokens(model, cache, pending, k, draft, params, gen, stats) if k else ([], None)
        t0 = time.perf_counter()
        toks = torch.tensor([[pending] + drafts], device=dev)
        logits = model(toks, cache.length + torch.arange(k + 1, device=dev), cache, verify)[0]
        if params.greedy:
            n, nxt = accept_greedy(drafts, logits)
        else:
            n, nxt = accept_rejection(drafts, q, to_probs(logits, params), gen)
        cache.commit(cache.length + n + 1)
        stats.verify_s += time.perf_counter() - t0
        stats.rounds += 1
        stats.draft_proposed += k
        stats.draft_accepted += n
        pending = nxt
        yield drafts[:n] + [nxt]


def draft_tokens(model: Transformer, cache: KVCache, pending: int, k: int, mode: Mode, params: SamplingParams,
                 gen: torch.Generator | None, stats: GenerationStats) -> tuple[list[int], torch.Tensor | None]:
    """Run k draft-mode steps from the pending token; their KV lands in the cache past `length`
    and is overwritten by the verify pass. Returns the drafts and (sampling) their probabilities."""
    t0 = time.perf_counter()
    dev = model.device
    drafts, probs = [], []
    tok = pending
    for i in range(k):
        pos = torch.tensor([cache.length + i], device=dev)
        logits = model(torch.tensor([[tok]], device=dev), pos, cache, mode)[0, -1]
        if params.greedy:
            tok = int(logits.argmax())
        else:
            probs.append(to_probs(logits, params))
            tok = sample(probs[-1], gen)
        drafts.append(tok)
    stats.draft_s += time.perf_counter() - t0
    return drafts, torch.stack(probs) if probs else None
