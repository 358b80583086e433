"""Drafters: what proposes a round's k tokens per row before the verify pass.

- `SelfDraft(mode)`: k batched model steps in a draft mode of the same stored weights (the quantized self-draft).
- `NgramDrafter(max_n, min_n)`: prompt lookup, as in vLLM / SGLang / llama.cpp: the row's last n tokens (n from
  max_n down to min_n) are looked up in its own prompt + generated text, and the tokens that followed their most
  recent earlier occurrence are proposed. No model step: its cost is a few dictionary look-ups per row.

A proposal of n < k tokens (none where nothing matches) is padded for the batched verify pass, which runs as far
as the longest proposal of the batch (a round where nothing matches costs a plain step), and only its n real
tokens are judged: a row with no proposal is a plain decoding step. With sampling, a lookup proposal is
drawn from a one-hot q, for which rejection sampling (verify.py) accepts d with probability p(d) and otherwise
draws from p with d removed: the output still follows the verify distribution exactly.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from selfspec.errors import SelfspecError
from selfspec.quant.modes import Mode, get_mode
from selfspec.speculative.sampling import sample, to_probs

if TYPE_CHECKING:
    from selfspec.speculative.decode import Row

NGRAM_NAME = re.compile(r"ngram(?::(\d+)-(\d+))?")
DEFAULT_NGRAM = (1, 3)  # (min_n, max_n)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] on the device; past a row's count, padding that is never judged
    counts: list[int]  # real proposals per row (<= k)
    q: list[torch.Tensor | None]  # sampling rows: [k, V] distributions the drafts were drawn from; None: one-hot
    prefill_s: float = 0.0  # of the time proposing, a draft model's prefill of a new row's context (not drafting)


class Drafter(Protocol):
    def history(self, tokens: list[int]) -> TokenHistory | None:
        """The per-row state a row keeps (and run_round extends with its committed tokens), if the drafter
        reads the row's text; `tokens`: the prompt and every emitted token, the pending one included."""

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal: ...


# ---------------------------------------------------------------- the self-draft: a draft mode


@dataclass(frozen=True)
class SelfDraft:
    mode: Mode

    def history(self, tokens: list[int]) -> None:
        return None

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal:
        tokens, q = draft_tokens(model, cache, rows, pending, lengths, k, self.mode)
        return Proposal(tokens, [k] * len(rows), q)


def draft_tokens(model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
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


# ---------------------------------------------------------------- prompt lookup


class TokenHistory:
    """A row's tokens and an index of its n-grams (min_n <= n <= max_n) -> where the continuation of the most
    recent occurrence starts. Appending a token costs max_n - min_n + 1 dictionary writes and a lookup as many
    reads, whatever the history's length."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.tail: tuple[int, ...] = ()  # the last max_n tokens: its slices are the keys (cheaper than the list's)
        self.index: dict[tuple[int, ...], int] = {}  # tuples of different lengths are different keys
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        index, tail, sizes = self.index, self.tail, range(-self.min_n, -self.max_n - 1, -1)
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending just before t are now followed by t
            for n in sizes[:len(tail) - self.min_n + 1]:
                index[tail[n:]] = end
            self.tokens.append(t)
            tail = tail[1 - self.max_n:] + (t,) if self.max_n > 1 else (t,)
        self.tail = tail

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens continuing the longest suffix (max_n tokens down to min_n) seen earlier, from its most
        recent earlier occurrence; [] if none. A continuation that runs into the suffix keeps copying the text
        it proposes (the text repeats with that period), so a match always proposes k tokens."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            start = self.index.get(tuple(toks[-n:]))
            if start is not None:
                out: list[int] = []
                for i in range(start, start + k):
                    out.append(toks[i] if i < len(toks) else out[i - len(toks)])
                return out
        return []


@dataclass(frozen=True)
class NgramDrafter:
    max_n: int = DEFAULT_NGRAM[1]
    min_n: int = DEFAULT_NGRAM[0]

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise SelfspecError(f"n-gram lookup needs 1 <= min_n <= max_n, got min_n {self.min_n}, max_n {self.max_n}; "
                                "write it as ngram:MIN-MAX, e.g. ngram:1-3")

    def history(self, tokens: list[int]) -> TokenHistory:
        return TokenHistory(tokens, self.min_n, self.max_n)

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal:
        found = [r.history.lookup(k) for r in rows]
        padded = [f + [0] * (k - len(f)) for f in found]
        tokens = torch.tensor(padded, device=pending.device)
        return Proposal(tokens, [len(f) for f in found], [None] * len(rows))


# ---------------------------------------------------------------- names


def is_lookup(name: str) -> bool:
    """Whether a --draft name is the lookup drafter (ngram or ngram:MIN-MAX) rather than a draft mode."""
    return name.startswith("ngram")


def make_drafter(name: str) -> Drafter:
    """A draft mode name -> its self-draft; 'ngram' or 'ngram:MIN-MAX' (n-gram sizes tried, longest first) ->
    prompt lookup."""
    if not is_lookup(name):
        return SelfDraft(get_mode(name))
    m = NGRAM_NAME.fullmatch(name)
    if m is None:
        raise SelfspecError(f"unknown drafter '{name}'; write ngram (n-grams of {DEFAULT_NGRAM[0]} to "
                            f"{DEFAULT_NGRAM[1]} tokens) or ngram:MIN-MAX, e.g. ngram:2-4")
    if m.group(1) is None:
        return NgramDrafter()
    return NgramDrafter(max_n=int(m.group(2)), min_n=int(m.group(1)))


def as_drafter(draft: Drafter | Mode | None) -> Drafter | None:
    """A draft mode stands for its self-draft."""
    return SelfDraft(draft) if isinstance(draft, Mode) else draft
