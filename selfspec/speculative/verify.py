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


def accept_rejection(drafts: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None) -> tuple[int, int]:
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
