"""A separate draft model (recipe `draft-model`): any loadable model with the target's tokenizer, run in any mode,
with its own KV cache. What users pick instead of a self-draft (e.g. Qwen2.5-Coder-0.5B for the 1.5B), at the cost
of a second set of weights and a second cache.

The draft cache mirrors the target's layout: for a contiguous target cache, one of the same batch and length; for
the engine's paged pool, a pool of as many blocks of the same size, addressed through the target's own block
tables. So the draft's blocks are allocated, extended, truncated and freed with the target's, and a preempted or
finished sequence frees both.

Each row keeps a `DraftState` (its `history`): its tokens, and how many of them the draft cache holds. A round
(1) keeps the KV of last round's drafts that were committed (those the verify pass accepted), (2) catches the draft
cache up on the rest of the committed context in one packed pass (the whole prompt, the first time), and (3) runs
k draft steps from the pending token, as a self-draft does (with the q distributions of sampling rows). The KV
those steps write past the committed context is judged at the next round by (1): a draft's KV is kept if and only
if the token it was computed for was committed, so rejected drafts are rolled back with no pass.
The catch-up pass of a new row (its whole context) is timed apart as its prefill: the gamma policy prices draft
steps without it.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.cache.kv import KVCache
from selfspec.cache.paged import PagedBatchView, PagedKVCache
from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.host import packed_positions
from selfspec.model import Packed, Transformer
from selfspec.quant.modes import Mode, prompt_mode
from selfspec.speculative.drafters import Proposal, draft_tokens

if TYPE_CHECKING:
    from selfspec.speculative.decode import Row

# Text whose token ids two tokenizers must agree on: code, numbers, accents, CJK, emoji.
TOKENIZER_PROBE = "def mean(xs):\n    return sum(xs) / len(xs)  # 3.14, déjà vu, 数字, 🙂\n"


@dataclass
class DraftState:
    """A row's state for the draft model: its tokens (prompt and emitted ones, the pending one included), the
    positions 0..cached-1 whose KV the draft cache holds, and the drafts the last round fed at positions
    cached.. (their KV is valid where they were committed)."""
    tokens: list[int]
    cached: int = 0
    fed: list[int] = field(default_factory=list)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def settle(self, length: int) -> None:
        """Keep the KV of the fed drafts that are now committed tokens (positions < length)."""
        for d in self.fed:
            if self.cached >= length or self.tokens[self.cached] != d:
                break
            self.cached += 1
        self.fed = []


class DraftModel:
    """The drafter of recipe `draft-model`: `model` proposes k tokens per row in `mode` from its own cache."""

    runs_steps = True

    def __init__(self, model: Transformer, mode: Mode, name: str = "draft model"):
        self.model, self.mode, self.name = model, mode, name
        # The draft cache of each target cache (weakly keyed: it goes when the target's does).
        self.stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.kv_bytes = 0  # the largest draft cache allocated so far

    def memory(self) -> dict:
        """What drafting adds to the target's memory: the draft model's weights and its KV cache."""
        return {"model": self.name, "mode": self.mode.name, "weight_bytes": self.model.weight_bytes(),
                "kv_bytes_per_token": self.kv_bytes_per_token(), "kv_bytes": self.kv_bytes}

    def describe(self) -> str:
        mib = 1 << 20
        return (f"drafts by {self.name} in {self.mode.name}: +{self.model.weight_bytes() / mib:.1f} MiB weights, "
                f"+{self.kv_bytes_per_token() / 1024:.1f} KiB KV per token")

    def history(self, tokens: list[int]) -> DraftState:
        return DraftState(list(tokens))

    def kv_bytes_per_token(self) -> int:
        c = self.model.cfg
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * self.model.dtype.itemsize

    def store_for(self, target: KVCache | PagedKVCache) -> KVCache | PagedKVCache:
        """The draft cache laid out like `target` (same rows or blocks, the draft model's layers and heads)."""
        store = self.stores.get(target)
        if store is None:
            c, m = self.model.cfg, self.model
            if isinstance(target, PagedKVCache):
                store = PagedKVCache(c.n_layers, target.num_blocks, c.n_kv_heads, target.block_size, c.head_dim,
                                     m.dtype, m.device)
            else:
                store = KVCache(c.n_layers, target.table.shape[0], c.n_kv_heads, target.max_len, c.head_dim,
                                m.dtype, m.device)
            self.stores[target] = store
            self.kv_bytes = max(self.kv_bytes, store.nbytes())
        return store

    def view(self, cache: KVCache | PagedBatchView) -> PagedBatchView:
        """The draft cache as the batch of the target's `cache` sees it: the draft pools, the target's table."""
        target = cache.cache if isinstance(cache, PagedBatchView) else cache
        return PagedBatchView(self.store_for(target), cache.table)

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal:
        states: list[DraftState] = [r.history for r in rows]
        for s, r in zip(states, rows):
            s.settle(r.length)
        view = self.view(cache)
        behind = [i for i, (s, r) in enumerate(zip(states, rows)) if s.cached < r.length]
        prefill_s = 0.0
        if behind:
            new_rows = any(states[i].cached == 0 for i in behind)  # new or resumed: the pass is their prefill
            t0 = time.perf_counter()
            self.catch_up(PagedBatchView(view.cache, view.table[behind]), [states[i] for i in behind],
                          [rows[i].length for i in behind])
            if new_rows:
                if self.model.device.type == "cuda":
                    torch.cuda.synchronize()
                prefill_s = time.perf_counter() - t0
        tokens, q = draft_tokens(self.model, view, rows, pending, lengths, k, self.mode)
        fed = tokens[:, :k - 1].tolist()  # k steps fed the pending token, then drafts 1..k-1
        for s, r, f in zip(states, rows, fed):
            s.cached, s.fed = r.length + 1, f
        return Proposal(tokens, [k] * len(rows), q, prefill_s)

    def catch_up(self, view: PagedBatchView, states: list[DraftState], lengths: list[int]) -> None:
        """One packed pass writing each row's committed tokens cached..length-1 into the draft cache (propose then
        counts them, with the pending token's, as cached)."""
        dev = self.model.device
        sizes = [n - s.cached for s, n in zip(states, lengths)]
        toks, pos = packed_positions([(s.tokens, s.cached, n) for s, n in zip(states, lengths)], dev)
        nothing = torch.empty(0, dtype=torch.long, device=dev)  # no logits: the next step drafts from pending
        self.model(toks, pos, view, prompt_mode(self.mode), logits_at=nothing, packed=Packed.of(sizes, lengths, dev))


def check_same_vocabulary(target: str, cfg: ModelConfig, tokenizer, draft: str, draft_cfg: ModelConfig,
                          draft_tokenizer) -> None:
    """A draft model must share the target's tokens: the same vocabulary size, and (where both have tokenizer
    files) the same token ids for a probe text."""
    if cfg.vocab_size != draft_cfg.vocab_size:
        raise SelfspecError(f"the draft model {draft} has a vocabulary of {draft_cfg.vocab_size} tokens, the model "
                            f"{target} one of {cfg.vocab_size}: a draft model must use the same tokenizer")
    if tokenizer is None or draft_tokenizer is None:
        return
    ids, draft_ids = tokenizer.encode(TOKENIZER_PROBE), draft_tokenizer.encode(TOKENIZER_PROBE)
    if ids != draft_ids:
        raise SelfspecError(f"the draft model {draft} tokenizes text differently from the model {target} "
                            f"({TOKENIZER_PROBE!r} -> {draft_ids[:12]}... vs {ids[:12]}...): a draft model must "
                            "use the same tokenizer")
