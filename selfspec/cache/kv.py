"""One KV cache shared by every mode: draft writes into it, verify overwrites the same positions.

Rows past `length` are stale scratch (rejected drafts); attention never reads them because a query at
position p reads keys 0..p only, and every key it reads was written in the current or an earlier pass.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.cache.paged import KEY_TILE

if TYPE_CHECKING:
    from selfspec.cache.quant_kv import QuantLayer


@dataclass(frozen=True)
class LayerKV:
    """What one layer's attention reads and writes: the pools [N, Hkv, bs, D] a pass stores its k/v into and the
    block table [B, W] attention reads them through; with a quantized cache (cache/quant_kv.py), also its
    quantized groups (then the pools are the full-precision buffer of the recent tokens)."""
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    quant: "QuantLayer | None" = None


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        # Each row is one block of the paged layout (table[b] = [b]), its slots rounded up to whole kernel tiles.
        slots = -(-max_len // KEY_TILE) * KEY_TILE
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.table = torch.arange(batch, device=device)[:, None]
        self.max_len = max_len
        self.max_pass = max_len  # the most tokens one pass may write: all of them
        self.length = 0  # positions 0..length-1 hold committed tokens' KV
        self._views: dict[tuple[int, int], KVCache] = {}

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start..stop-1 as a cache of their own over the same buffers: a pass through it reads and writes
        those rows only. One object per range, so the CUDA graphs bound to it are found again."""
        view = self._views.get((start, stop))
        if view is None:
            view = self._views[(start, stop)] = copy.copy(self)
            view.table, view._views = self.table[start:stop], {}
        return view

    def shared_rows(self, row: int, n: int) -> KVCache:
        """Row `row` n times, as a cache of its own: a tree's branch rows that share one sequence's row
        (model.TreeLayout's tails). One object per (row, n), as `rows`."""
        view = self._views.get((row, -n))
        if view is None:
            view = self._views[(row, -n)] = copy.copy(self)
            view.table, view._views = self.table[row:row + 1].repeat(n, 1), {}
        return view

    def move_positions(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy every layer's keys and values of positions src to positions dst of one row (exact): a tree's
        accepted branch from its tails to the positions its tokens were committed at."""
        runs: list[list[int]] = []  # [src, dst, length]: a branch's own nodes are consecutive, so few slice copies
        for s, d in zip(src, dst):
            if s == d:
                continue
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        for s, d, n in runs:  # src >= dst (tails follow the positions): a clone keeps an overlapping copy exact
            for buf in (self.k, self.v):
                buf[:, row, :, d:d + n] = buf[:, row, :, s:s + n].clone()

    def copy_positions(self, src: int, start: int, end: int) -> None:
        """Copy every layer's keys and values of positions start..end-1 from row src to every other row (exact)."""
        if self.batch > 1 and end > start:  # every row, src's own included (the same values): no index tensor
            for buf in (self.k, self.v):
                buf[:, :, :, start:end] = buf[:, src:src + 1, :, start:end].clone()

    @property
    def block_size(self) -> int:
        """Slots per row: each row is one block (so a PagedBatchView over this cache addresses it alike)."""
        return self.k.shape[3]

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions pos [B, T] -> the slots [B, T] where their k/v go in this cache's pools: row b is block b,
        so slot = b * slots_per_row + pos."""
        return self.table * self.k.shape[3] + pos

    def layer(self, layer: int) -> LayerKV:
        """This layer's whole key/value buffers [B, Hkv, slots, D] as pools of one block per row, and the block
        table [B, 1]. Slots past a query's position are masked by attention, so no slicing is needed: no host
        sync and fixed shapes, which CUDA graphs require."""
        return LayerKV(self.k[layer], self.v[layer], self.table)

    def commit(self, length: int) -> None:
        """Keep positions 0..length-1; anything after is discarded (rollback of rejected drafts)."""
        self.length = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
