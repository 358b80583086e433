"""Acceptance of drafted tokens: exact match for greedy, rejection sampling otherwise.

Both return (n_accepted, next_token): the drafts d[:n] are kept and next_token follows them, drawn from
the verify distribution, so the output is exactly what verify mode alone would produce.
"""
from __future__ import annotations

import torch

from selfspec.speculative.sampling import sample


def accept_greedy(drafts: list[int], target: list[int]) -> tuple[int, int]:
    """drafts [k]; target [k+1]: the verify pass's argmax at the pending token and each draft."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, target[n]


def accept_rejection(drafts: list[int], q: torch.Tensor, p: torch.Tensor,
                     gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling: accept d_i with prob min(1, p_i/q_i), else resample from norm(max(0, p_i - q_i)).

    q [k, V]: draft probabilities each draft was sampled from; p [k+1, V]: verify probabilities.
    """
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=gen, device=p.device))
        if u * q[i, d] < p[i, d]:  # u < p/q without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        # p == q on the support leaves no residual mass; then p itself is the right distribution.
        return i, sample(residual / total if total > 0 else p[i], gen)
    return len(drafts), sample(p[len(drafts)], gen)


def accept_tree_sampling(branches: list[list[int]], p: torch.Tensor,
                         gen: torch.Generator | None) -> tuple[int, int, int]:
    """Multi-candidate speculative sampling (SpecInfer) over branches judged as one-hot proposals.

    branches: the candidate continuations, row b of p [B, k+1, V] the verify probabilities along branch b (at the
    pending token and each of its drafts). Walking down from the root, a node's candidates are the distinct next
    tokens of the branches still alive; each is accepted with probability r(c) / r.sum(), r the node's verify
    distribution with the candidates rejected so far removed; if all are rejected, the token is drawn from r. Any
    token t is then emitted with probability p(t), whatever the candidates: the output follows the verify
    distribution exactly. Returns (a branch holding the accepted path, drafts accepted, next token)."""
    live, n = list(range(len(branches))), 0
    while True:
        r = p[live[0], n].clone()  # the live branches share the path, hence this distribution
        candidates = dict.fromkeys(branches[b][n] for b in live if len(branches[b]) > n)
        accepted = None
        for c in candidates:
            u = float(torch.rand((), generator=gen, device=p.device))
            if u * r.sum() < r[c]:
                accepted = c
                break
            r[c] = 0
        if accepted is None:
            total = r.sum()
            # Every candidate rejected yet no mass left: only where rounding left p(c) < 1 for the sole token.
            return live[0], n, sample(r / total if total > 0 else p[live[0], n], gen)
        live = [b for b in live if len(branches[b]) > n and branches[b][n] == accepted]
        n += 1
