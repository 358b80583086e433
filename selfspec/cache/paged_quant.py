"""Paged quantized KV cache (serving): QuantSpec's quantized groups in a pool of blocks shared by every sequence, and
each sequence's own full-precision buffer of its recent tokens.

The groups: blocks of block_size positions (a multiple of the KV group G) in QuantPools (cache/quant_kv.py), each
sequence's blocks in its block table, accounted as the bf16 pool's (BlockPool: extend before a pass, truncate to
commit or roll back, free). A block holds only quantized positions, so a sequence of committed length n holds
blocks for its n // G * G of them, and a pass that may complete groups first extends by the tokens it writes.

The buffers: one row of BUFFER_GROUPS * G slots per running sequence (max_seqs rows, + the trash row 0), the double
buffer of the contiguous cache, per sequence: slot 0 holds position `starts[seq]`, positions below
`quantized[seq]` are in the blocks. `truncate` commits a sequence through the same `settle` as the contiguous cache:
the groups its committed tokens complete are quantized into its blocks and its buffer moves down; rejected drafts
only leave the buffer. Sequences at different lengths move their buffers independently.
"""
from __future__ import annotations

import torch

from selfspec.cache.kv import LayerKV
from selfspec.cache.paged import BlockPool
from selfspec.cache.quant_kv import BUFFER_GROUPS, QuantPools, check_pass_fits, settle
from selfspec.errors import SelfspecError
from selfspec.host import long_tensor


class PagedQuantKVCache(BlockPool):
    def __init__(self, n_layers: int, num_blocks: int, n_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, fmt: str, group: int, max_seqs: int):
        super().__init__(num_blocks, block_size)
        self.fmt, self.group = fmt, group
        self.pools = QuantPools(n_layers, num_blocks + 1, n_kv_heads, block_size, head_dim, device, fmt, group)
        shape = (n_layers, max_seqs + 1, n_kv_heads, BUFFER_GROUPS * group, head_dim)  # + the trash row
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.free_rows = list(range(max_seqs, 0, -1))
        self.rows: dict[str, int] = {}  # each sequence's buffer row
        self.starts: dict[str, int] = {}  # the position in its buffer's first slot
        self.quantized: dict[str, int] = {}  # positions 0..quantized-1 are in its blocks

    @property
    def max_pass(self) -> int:
        """The most tokens one pass may write past a sequence's committed length (prefill chunks are cut to it)."""
        return self.group

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks of a sequence of n_tokens committed positions: its completed groups (the rest is in its buffer)."""
        return -(-(n_tokens // self.group * self.group) // self.block_size)

    def allocate(self, seq: str, n_tokens: int = 0) -> None:
        if not self.free_rows:
            raise SelfspecError(f"every one of the {len(self.rows)} KV buffers is in use: a quantized KV cache holds "
                                "at most max_batch sequences")
        super().allocate(seq, n_tokens)
        self.rows[seq] = self.free_rows.pop()
        self.starts[seq] = self.quantized[seq] = 0

    def truncate(self, seq: str, length: int) -> None:
        """Commit positions 0..length-1: quantize the groups they complete into the sequence's blocks and move its
        buffer down; later positions are dropped (rollback), and blocks past the quantized ones freed."""
        row, table, bs = self.rows[seq], self.tables[seq], self.block_size

        def store(k: torch.Tensor, v: torch.Tensor, first: int) -> None:
            block = table[first // bs]
            self.pools.store(k, v, slice(block, block + 1), first % bs)

        self.starts[seq], self.quantized[seq] = settle(self.k[:, row:row + 1], self.v[:, row:row + 1],
                                                       self.starts[seq], self.quantized[seq], length, self.group,
                                                       store)
        super().truncate(seq, length)

    def free(self, seq: str) -> None:
        if seq in self.rows:
            self.free_rows.append(self.rows.pop(seq))
            del self.starts[seq], self.quantized[seq]
        super().free(seq)

    def view(self, seqs: list[str]) -> PagedQuantBatchView:
        dev = self.k.device
        return PagedQuantBatchView(self, self.padded_tables(seqs, dev),
                                   long_tensor([self.rows[s] for s in seqs], dev)[:, None],
                                   long_tensor([self.starts[s] for s in seqs], dev))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + self.pools.nbytes()


class PagedQuantBatchView:
    """The cache as one forward pass over a batch sees it: `slots` says where each new token's k/v go in the
    buffers, `layer` gives what quantized attention reads: the buffers [R, Hkv, 3G, D] with each row's buffer
    row [B, 1], and the layer's quantized blocks with each row's block table [B, W] (padded with the trash block)
    and buffer start [B]."""

    def __init__(self, cache: PagedQuantKVCache, table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor):
        self.cache = cache
        self.table = table
        self.rows = rows
        self.starts = starts

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions [B, T] -> buffer slots [B, T]: buffer row * slots per row + position - the row's start."""
        n = self.cache.k.shape[3]
        return self.rows * n + check_pass_fits(pos, self.starts, n, self.cache.group)

    def layer(self, layer: int) -> LayerKV:
        c = self.cache
        return LayerKV(c.k[layer], c.v[layer], self.rows, c.pools.layer(layer, self.table, self.starts))

