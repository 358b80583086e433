"""Recycled drafts: each verify pass ranks the whole vocabulary at every position it runs, and all but the argmax
is thrown away. Kept instead, as a table token -> the verify mode's top-w next tokens after it (the latest pass
that ran the token decides), it proposes trees for free: from the pending token, follow the table.

This is Token Recycling's idea (Luo et al., 2024): candidates the model itself ranked, in contexts close to the
current one, drafted with no model step. The table starts from text (`text_successors` of reference texts, given
as the drafter's base, then each token's successor in the prompt), and every verify pass overwrites the entries of
the tokens it ran, rejected branches included (their ranks are the model's too).

`grow` shapes a round's tree: best first by the product of each step's rank prior, within a budget of nodes and of
leaves (the branches a forked-chain verify pass runs as rows), each branch at most k deep.
"""
from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from typing import Iterable

# P(the verify's next token is the successor of rank r), the weights `grow` ranks nodes by: a guess that falls
# like next-token top-k accuracy, not fitted yet; past the list, the last value.
RANK_PRIORS = (0.55, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01)
DEFAULT_WIDTH = 8  # successors kept per token


class SuccessorTable:
    """token -> the next tokens after it, best first: the verify mode's ranking from the latest pass that ran the
    token, else the token that followed it in the text."""

    def __init__(self, width: int = DEFAULT_WIDTH):
        self.width = width
        self.next: dict[int, tuple[int, ...]] = {}

    def read(self, tokens: list[int], prev: int | None = None) -> None:
        """Text (after `prev`, if any): each token's successor, where no verify pass ranked one yet."""
        for t in tokens:
            if prev is not None and prev not in self.next:
                self.next[prev] = (t,)
            prev = t

    def observe(self, inputs: list[int], ranked: list[list[int]]) -> None:
        """A verify pass ran `inputs` and ranked the next token after each (best first)."""
        for t, nxt in zip(inputs, ranked):
            self.next[t] = tuple(nxt[: self.width])


def text_successors(texts: Iterable[list[int]], width: int = DEFAULT_WIDTH) -> dict[int, tuple[int, ...]]:
    """token -> its most frequent next tokens in these token rows (a table to start from, before any pass ranks)."""
    counts: dict[int, Counter] = defaultdict(Counter)
    for ids in texts:
        for a, b in zip(ids, ids[1:]):
            counts[a][b] += 1
    return {a: tuple(t for t, _ in c.most_common(width)) for a, c in counts.items()}


def grow(successors: dict[int, tuple[int, ...]], root: int, depth: int, leaves: int, nodes: int,
         priors: tuple[float, ...] = RANK_PRIORS) -> list[list[int]]:
    """The tree from `root` with the highest prior mass, best first: up to `nodes` tokens, `leaves` branches and
    `depth` tokens per branch. Returns its root-to-leaf paths (the branches), best first; [] if root has no
    successor."""
    heap = [(-prior(priors, r), r, (t,)) for r, t in enumerate(successors.get(root, ()))]  # (-mass, order, path)
    order = len(heap)
    chosen: dict[tuple[int, ...], float] = {}
    children: dict[tuple[int, ...], int] = {}
    n_leaves = 0
    while heap and len(chosen) < nodes:
        neg, _, path = heapq.heappop(heap)
        parent = path[:-1]
        new_leaf = not parent or children.get(parent, 0) > 0
        if new_leaf and n_leaves == leaves:
            continue
        n_leaves += new_leaf
        chosen[path] = -neg
        children[parent] = children.get(parent, 0) + 1
        if len(path) < depth:
            for r, t in enumerate(successors.get(path[-1], ())):
                heapq.heappush(heap, (neg * prior(priors, r), order, path + (t,)))
                order += 1
    tips = [p for p in chosen if not children.get(p)]
    tips.sort(key=lambda p: -chosen[p])
    return [list(p) for p in tips]


def prior(priors: tuple[float, ...], rank: int) -> float:
    return priors[min(rank, len(priors) - 1)]
