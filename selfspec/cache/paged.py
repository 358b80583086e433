"""Paged KV cache: one pool of fixed-size blocks shared by every sequence (vLLM's layout).

Each sequence owns a block table (list of block ids) and a committed length; position p of a sequence lives
in slot p % block_size of block table[p // block_size]. Rollback is `truncate`: blocks past the committed
length go back to the free list; slots past it inside the last block are stale, and attention never reads
them (a query at position p reads positions 0..p, all written in the current or an earlier pass).
Block 0 is the trash block: never allocated, it pads block tables and takes the writes of CUDA graphs' padding rows.
Attention reads keys through the block table (kernels/ops.py `attention`): nothing is gathered per pass.
A token tree's round forks a sequence into branch rows for one pass (`PagedTree`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.errors import SelfspecError
from selfspec.host import long_tensor

if TYPE_CHECKING:
    from selfspec.cache.kv import LayerKV

TRASH = 0
KEY_TILE = 128  # keys per online-softmax step of the attention kernel (kernels/triton_attention.py BLOCK_S)


def check_block_size(block_size: int) -> None:
    """A kernel tile of KEY_TILE keys must cover whole blocks, or a block whole tiles."""
    if block_size < 1 or (KEY_TILE % block_size and block_size % KEY_TILE):
        raise SelfspecError(f"KV block size must divide {KEY_TILE} or be a multiple of it, got {block_size}")


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Pool [N, Hkv, bs, D] and block table [B, W] -> each row's entries [B, Hkv, W * bs, D] in position order."""
    b, w = table.shape
    x = pool[table]  # [B, W, Hkv, bs, D]
    return x.permute(0, 2, 1, 3, 4).reshape(b, pool.shape[1], w * pool.shape[2], pool.shape[3])


class BlockPool:
    """The block accounting of a paged cache: a free list of block ids, each sequence's block table and committed
    length. A subclass holds the blocks' storage; `blocks_for` says how many blocks a length takes."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks, 0, -1))  # pop() hands out low ids first
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # committed positions 0..length-1 per sequence

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate(self, seq: str, n_tokens: int = 0) -> None:
        """Register a new sequence (length 0) with room for n_tokens positions."""
        if seq in self.tables:
            raise SelfspecError(f"sequence '{seq}' already has blocks")
        self.tables[seq], self.lengths[seq] = [], 0
        self.extend(seq, n_tokens)

    def blocks_needed(self, seq: str, n_tokens: int) -> int:
        """Blocks `extend(seq, n_tokens)` would take from the pool (what a scheduler budgets for a pass)."""
        return max(0, self.blocks_for(self.lengths[seq] + n_tokens) - len(self.tables[seq]))

    def extend(self, seq: str, n_tokens: int) -> None:
        """Make room for positions up to length + n_tokens - 1 (what the next pass writes)."""
        need = self.blocks_needed(seq, n_tokens)
        if need > len(self.free_blocks):
            raise SelfspecError(f"KV cache out of blocks: '{seq}' needs {need}, {len(self.free_blocks)} free")
        self.tables[seq].extend(self.free_blocks.pop() for _ in range(need))

    def truncate(self, seq: str, length: int) -> None:
        """Commit positions 0..length-1 and free every block past them (exact rollback of rejected drafts)."""
        table = self.tables[seq]
        keep = self.blocks_for(length)
        self.free_blocks.extend(reversed(table[keep:]))
        del table[keep:]
        self.lengths[seq] = length

    def free(self, seq: str) -> None:
        """Return all of a sequence's blocks; unknown sequences are fine (idempotent)."""
        if seq in self.tables:
            self.free_blocks.extend(reversed(self.tables.pop(seq)))
            del self.lengths[seq]

    def padded_tables(self, seqs: list[str], device: torch.device | str) -> torch.Tensor:
        """The block tables of rows `seqs` [B, W] on `device`, padded with the trash block to the longest."""
        return padded(list(map(self.tables.__getitem__, seqs)), device)


class PagedKVCache(BlockPool):
    def __init__(self, n_layers: int, num_blocks: int, n_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        check_block_size(block_size)
        super().__init__(num_blocks, block_size)
        # Zeros, not empty: attention multiplies masked slots' values by 0, and 0 * NaN garbage would be NaN.
        shape = (n_layers, num_blocks + 1, n_kv_heads, block_size, head_dim)  # + the trash block
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_pass = num_blocks * block_size  # the most tokens one pass may write: the whole pool

    def view(self, seqs: list[str]) -> PagedBatchView:
        """The batch view of rows `seqs`; their block tables padded with the trash block to the longest."""
        return PagedBatchView(self, self.padded_tables(seqs, self.k.device))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys and values at pool slots src [P] to slots dst [P] (exact)."""
        bs = self.block_size
        for pool in (self.k, self.v):
            pool[:, dst // bs, :, dst % bs] = pool[:, src // bs, :, src % bs]


class PagedTree:
    """One sequence forked into `branches` rows for a token tree's round (speculative/decode.py `tree_rounds`): row
    0 is the sequence's own block table; row b > 0 shares its blocks before the one holding position `length` and
    owns fresh blocks from there on (that block's committed slots copied in), so a pass writes each row's positions
    >= length into that row's slots alone, and every row reads the committed prefix. Offers what tree drafters use
    of the solo path's KVCache (`rows`, `copy_positions`). The sequence's table must already cover the round's
    positions; `release` gives the branch rows' blocks back to the pool."""

    def __init__(self, cache: PagedKVCache, seq: str, branches: int):
        own, length, bs = cache.tables[seq], cache.lengths[seq], cache.block_size
        first = length // bs  # the block holding position `length`: the first one a branch owns
        tail = len(own) - first
        need = (branches - 1) * tail
        if need > len(cache.free_blocks):
            raise SelfspecError(f"KV cache out of blocks: the tree of '{seq}' needs {need}, "
                                f"{len(cache.free_blocks)} free")
        self.cache = cache
        self.blocks = [cache.free_blocks.pop() for _ in range(need)]
        tails = [self.blocks[i:i + tail] for i in range(0, need, tail)]
        if length % bs:  # the committed slots of the shared partial block
            starts = torch.tensor([t[0] * bs for t in tails], device=cache.k.device)[:, None]
            offsets = torch.arange(length % bs, device=cache.k.device)
            cache.copy_slots((own[first] * bs + offsets).repeat(len(tails)), (starts + offsets).flatten())
        self.host_table = [own] + [own[:first] + t for t in tails]
        self.table = long_tensor([b for row in self.host_table for b in row], cache.k.device).view(branches, -1)

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    def rows(self, start: int, stop: int) -> PagedBatchView:
        """Rows start..stop-1 as a batch view: a pass through it reads and writes those rows only."""
        return PagedBatchView(self.cache, self.table[start:stop])

    def block_rows(self, start: int, stop: int) -> list[list[int]]:
        """Rows start..stop-1's block ids, on the host."""
        return self.host_table[start:stop]

    def copy_positions(self, src: int, start: int, end: int) -> None:
        """Copy every layer's keys and values of positions start..end-1 (>= length) from row src to every other row."""
        others = [b for b in range(self.batch) if b != src]
        if others and end > start:
            slots = self.rows(0, self.batch).slots(torch.arange(start, end, device=self.table.device)
                                                   .expand(self.batch, -1))
            self.cache.copy_slots(slots[src].repeat(len(others)), slots[others].flatten())

    def release(self) -> None:
        self.cache.free_blocks.extend(reversed(self.blocks))
        self.blocks = []


class SharedTree:
    """One sequence's token tree over its own blocks, for a drafter that forks no rows: every branch row reads the
    sequence's table, its nodes stored once past the committed length (model.TreeLayout's tails), so nothing is
    forked or copied but the accepted drafts (`move_positions`). The table must cover the round's nodes."""

    def __init__(self, cache: PagedKVCache, seq: str):
        self.cache = cache
        self.blocks = cache.tables[seq]

    def block_rows(self, start: int, stop: int) -> list[list[int]]:
        """The sequence's block ids stop - start times, on the host."""
        return [self.blocks] * (stop - start)

    def move_positions(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy every layer's keys and values of positions src to positions dst (a branch's accepted drafts)."""
        bs, blocks = self.cache.block_size, self.blocks
        pairs = [(blocks[s // bs] * bs + s % bs, blocks[d // bs] * bs + d % bs) for s, d in zip(src, dst) if s != d]
        if pairs:
            slots = long_tensor([s for s, _ in pairs] + [d for _, d in pairs], self.cache.k.device).view(2, -1)
            self.cache.copy_slots(slots[0], slots[1])

    def release(self) -> None:
        """Nothing to give back: the nodes sit in the sequence's own blocks, which truncate frees."""


def tree_view(trees: list[PagedTree | SharedTree], spans: list[tuple[int, int]]) -> PagedBatchView:
    """One batch view over rows spans[i] (start, stop) of each trees[i] (their tables padded with the trash block),
    built on the host and copied once."""
    cache = trees[0].cache
    rows = [row for t, (start, stop) in zip(trees, spans) for row in t.block_rows(start, stop)]
    return PagedBatchView(cache, padded(rows, cache.k.device))


def padded(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Block tables [B, W] on `device` from the host's lists, padded with the trash block to the longest."""
    width = max(map(len, tables))
    return long_tensor([b for t in tables for b in t + [TRASH] * (width - len(t))], device).view(len(tables), width)


class PagedBatchView:
    """The cache as one forward pass over a batch sees it: `slots` says where each new token's k/v go in the
    pools, `layer` gives what attention reads them through: a layer's pools [N, Hkv, bs, D] and the block
    table [B, W].

    table [B, W]: each row's block ids, padded with the trash block (padding sits past the row's positions, so
    attention masks it).
    """

    def __init__(self, cache: PagedKVCache, table: torch.Tensor):
        self.cache = cache
        self.table = table

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions [B, T] -> pool slots [B, T]: block id * block_size + offset in the block."""
        bs = self.cache.block_size
        return self.table.gather(1, pos // bs) * bs + pos % bs

    def layer(self, layer: int) -> LayerKV:
        """This layer's pools [N, Hkv, bs, D] (keys, values) and the block table [B, W]."""
        from selfspec.cache.kv import LayerKV

        return LayerKV(self.cache.k[layer], self.cache.v[layer], self.table)
