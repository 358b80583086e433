"""Hadamard rotation (QuaRot-style) for activation-quantized modes.

A weight stored as quantize(W H) and activations rotated online, x H, give (x H)(W H)^T = x H H^T W^T = x W^T
(H orthonormal), up to weight quantization. The rotation spreads an outlier channel of x over its whole block,
so per-token activation quantization (the w4a4 draft) keeps its resolution for the other channels.
H is block-diagonal: one Hadamard matrix of a power-of-two order that divides K (K = 576 has 64), applied to
every block of K. One H per order is shared by every weight that uses it, and by every mode.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of two): symmetric, H H^T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return h / math.sqrt(n)


class BlockHadamard(nn.Module):
    """x -> x @ blockdiag(H, ..., H) along the last dim (whose size the block order divides)."""

    def __init__(self, block: int):
        super().__init__()
        self.register_buffer("matrix", hadamard(block))

    @property
    def block(self) -> int:
        return self.matrix.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from selfspec.kernels.ops import rotate  # the op table (imported here: kernels import quant)

        return rotate(x, self.matrix)
