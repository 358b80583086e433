"""A runner that logs every forward pass by its shape: what sets its cost (bench/step_bound.py times each kind once)
and what a speculative round paid (bench/traces.py reads its rounds off the log)."""
from __future__ import annotations

from collections import Counter

import torch

from selfspec.model import Packed, TreeLayout
from selfspec.quant.modes import Mode


def pass_shape(tokens: torch.Tensor, packed: Packed | None, tree: TreeLayout | None) -> tuple:
    """("prefill", lengths, keys) of a packed prompt pass; ("tree", rows, width, nodes, shared) of a node-packed
    tree pass (its branch rows, their width, its nodes: each sequence's pending token and distinct drafts); (rows,
    tokens) of a decode, draft or verify pass (the CUDA graphs replay these shapes)."""
    if packed is not None:
        return "prefill", tuple(packed.lengths), tuple(packed.keys)
    if tree is not None:
        return ("tree", *tree.rows.shape, tokens.shape[1], tree.tails is not None)
    return tuple(tokens.shape)


def decode_rows(calls: list[tuple[Mode, tuple]]) -> list[tuple[int, int, int]]:
    """The decode passes among logged calls as (rows, tokens per row, distinct draft tokens); prompt passes (a
    prefill, a draft model's catch-up of the committed context) are left out."""
    out = []
    for _, shape in calls:
        if shape[0] == "tree":
            out.append((shape[1], shape[2], shape[3] - 1))
        elif shape[0] != "prefill":
            rows, width = shape
            out.append((rows, width, rows * (width - 1)))
    return out


class PassLog:
    """Stands in for a runner (eager or graphed model): each pass is logged in `calls` as (mode, pass_shape) and run
    on the runner it wraps. Two logs may share one `calls` list (a target and its draft model)."""

    def __init__(self, runner, calls: list | None = None) -> None:
        self.runner = runner
        self.calls = [] if calls is None else calls

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache, mode: Mode,
                 logits_at: torch.Tensor | None = None, packed: Packed | None = None,
                 tree: TreeLayout | None = None) -> torch.Tensor:
        self.calls.append((mode, pass_shape(tokens, packed, tree)))
        return self.runner(tokens, pos, cache, mode, logits_at, packed, tree=tree)

    @property
    def passes(self) -> Counter:
        """How many passes of each (mode, shape) ran."""
        return Counter(self.calls)
