"""CUDA-graph forward passes: the model's forward, captured once per (cache, mode, batch, tokens) and replayed.

The host of a GPU machine is slow; an eager decode step launches hundreds of kernels and the GPU waits on
Python. A graph replays them in one launch. `GraphedModel` has the model's call signature, so the decoding
loop and the engine run unchanged: a step shape seen for the first time runs eagerly (that run compiles the
kernels and its result is returned), is captured, and every later call with that shape replays the graph.
Graphs are bound to a cache's buffers, so `new_cache` hands out one persistent cache per batch size. Passes
of more than MAX_GRAPHED_TOKENS tokens per row (prefill) run eagerly: they are few, and each length would
need its own graph; so do passes that ask for selected logits only (`logits_at`: a prefill's last position).

`PagedGraphedModel` does the same for the serving engine's batched passes over the paged cache: one graph per
(mode, batch bucket, tokens per row); a batch is padded to its bucket (a power of two) with rows of token 0 at
position 0 whose block table is all trash block (and, over a quantized cache, whose buffer is the trash row), so
their writes land there and their logits are dropped.
It also replays the engine's prompt passes (packed rows, Mode.prompt), whose host time (a Triton launch per op and
layer, ~420 for an 8B model) was 2-5x their GPU time on an H100: one graph per (mode, tokens, rows, width), each
bucketed (`prompt_bucket`; rows to a power of two past the real ones, unless the tokens fill their bucket exactly).
Padding tokens are token 0 at position 0 of padding rows whose table is all trash (model.Packed.of, `shape`), and the
kernels are batch invariant, so a prompt's KV and logits are the bits of its eager pass. A prompt graph dequantizes
integer weights into the kernels' scratch buffer, which the eager run before its capture has sized for the largest
weight, and keeps that buffer alive.
"""
from __future__ import annotations

import numpy as np
import torch

from selfspec.cache import KVCache
from selfspec.cache.paged import PagedBatchView, PagedKVCache
from selfspec.cache.paged_quant import PagedQuantBatchView, PagedQuantKVCache
from selfspec.errors import SelfspecError
from selfspec.model import Packed, Transformer, TreeLayout
from selfspec.quant.modes import Mode
from selfspec.speculative.drafters import SHARED_TREE_BATCH

MAX_GRAPHED_TOKENS = 16  # decode steps: AR (1), draft (1), verify (gamma + 1)
# Prompt passes pad their tokens to a multiple of this (powers of two below it): the many-token GEMM tiles are 128
# rows high, so a pass pays no more tiles for its padding.
PROMPT_STEP = 128


def bucket(rows: int) -> int:
    """The batch size of the graph a pass of `rows` rows replays: the next power of two."""
    return 1 << (rows - 1).bit_length()


def node_bucket(nodes: int) -> int:
    """The nodes of the graph a tree pass of `nodes` nodes replays: the next power of two, at least
    MAX_GRAPHED_TOKENS."""
    return max(MAX_GRAPHED_TOKENS, bucket(nodes))


def prompt_bucket(tokens: int) -> int:
    """The tokens of the prompt graph a pass (or a row) of `tokens` tokens replays."""
    return max(16, bucket(tokens)) if tokens <= PROMPT_STEP else -(-tokens // PROMPT_STEP) * PROMPT_STEP


def trash_view(cache: PagedKVCache | PagedQuantKVCache, rows: int, width: int) -> PagedBatchView | PagedQuantBatchView:
    """A batch view of `rows` padding rows of `cache`: every block the trash block and, in a quantized cache, every
    buffer the trash row (row 0) from position 0. Zeros, as `pad_into` pads."""
    dev = cache.k.device
    table = torch.zeros(rows, width, dtype=torch.long, device=dev)
    if isinstance(cache, PagedQuantKVCache):
        return PagedQuantBatchView(cache, table, torch.zeros(rows, 1, dtype=torch.long, device=dev),
                                   torch.zeros(rows, dtype=torch.long, device=dev))
    return PagedBatchView(cache, table)


def pad_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy src into the leading corner of dst and zero the rest: padding rows get token 0 at position 0, and
    padding table entries the trash block (0)."""
    if dst.shape != src.shape:
        dst.zero_()
    dst[tuple(map(slice, src.shape))].copy_(src, non_blocking=True)


class _Graph:
    """One captured forward: static token and position inputs, static logits output. Called with fewer rows
    than it was captured with, the rest are padding and their logits are cut off."""

    def __init__(self, model: Transformer, cache, mode: Mode, shape: tuple[int, int], pool) -> None:
        self.tokens = torch.zeros(shape, dtype=torch.long, device=model.device)
        self.pos = torch.zeros(shape, dtype=torch.long, device=model.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.tokens, self.pos, cache, mode)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        pad_into(self.tokens, tokens)
        pad_into(self.pos, pos.expand(tokens.shape))
        self.graph.replay()
        return self.logits[:tokens.shape[0]]


class _TreeGraph:
    """One captured tree pass (model.TreeLayout): static node tokens and positions [1, nodes], static layout rows
    [rows, width], first [nodes] and, for rows sharing one cache row, tails [rows, width]. Called with fewer
    nodes, the rest are padding (token 0, read by no row, logits cut off); with fewer rows (the engine's bucket),
    padding rows read node 0 into the view's trash rows."""

    def __init__(self, model: Transformer, cache, mode: Mode, shape: tuple[int, int, int, bool], pool) -> None:
        rows, width, nodes, shared = shape
        # One buffer, as TreeLayout.of lays its values out: rows, first, tokens, positions and, for shared rows,
        # tails and up to SHARED_TREE_BATCH sequences' starts (padding sequences' zeros: no nodes).
        self.sizes = [rows * width, nodes, nodes, nodes, rows * width * shared,
                      (min(rows, SHARED_TREE_BATCH) + 1) * shared]
        self.inputs = torch.zeros(sum(self.sizes), dtype=torch.long, device=model.device)
        self.staging = np.zeros(sum(self.sizes), dtype=np.int64)  # numpy: a slice copy 0.3 us (torch: 2.5, CPU)
        self.staged = np.split(self.staging, np.cumsum(self.sizes)[:-1])
        t_rows, first, tokens, pos, tails, starts = self.inputs.split(self.sizes)
        self.tokens, self.pos = tokens.view(1, nodes), pos.view(1, nodes)
        self.tree = TreeLayout(t_rows.view(rows, width), first, tails.view(rows, width) if shared else None,
                               starts if shared else None)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.tokens, self.pos, cache, mode, tree=self.tree)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
        """The pass's values padded into the static buffer, all in one copy from the host (the layout's own host
        values where TreeLayout.of built it: a layout built on the device is read back)."""
        if tree.starts is not None and len(tree.starts) > self.sizes[-1]:
            raise SelfspecError(f"a graphed tree pass of shared rows holds at most {SHARED_TREE_BATCH} sequences, "
                                f"got {len(tree.starts) - 1}")
        parts = [tree.rows, tree.first, tokens, pos] + ([tree.tails, tree.starts] if tree.tails is not None else [])
        host = tree.host if tree.host is not None else torch.cat([p.flatten() for p in parts]).cpu().numpy()
        self.staging.fill(0)
        start = 0
        for dst, part in zip(self.staged, parts):
            dst[:part.numel()] = host[start:start + part.numel()]
            start += part.numel()
        self.inputs.copy_(torch.from_numpy(self.staging))
        self.graph.replay()
        return self.logits[:, :tokens.shape[1]]


class _PromptGraph:
    """One captured prompt pass: static packed tokens, positions, block table, layout and logits rows; the graph's
    logits [rows, vocab] are those of the tokens `logits_at` names (padding: token 0's, cut off)."""

    def __init__(self, model: Transformer, cache: PagedKVCache, mode: Mode, shape: tuple[int, int, int],
                 table_width: int) -> None:
        tokens, rows, width = shape
        dev = model.device
        self.model, self.mode, self.shape = model, mode, shape
        self.tokens = torch.zeros(1, tokens, dtype=torch.long, device=dev)
        self.pos = torch.zeros_like(self.tokens)
        self.at = torch.zeros(rows, dtype=torch.long, device=dev)
        self.view = PagedBatchView(cache, torch.zeros(rows, table_width, dtype=torch.long, device=dev))
        self.packed = Packed([], [], torch.zeros(rows, width, dtype=torch.long, device=dev),
                             torch.zeros(tokens, dtype=torch.long, device=dev))
        self.graph: torch.cuda.CUDAGraph | None = None

    def fill(self, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, logits_at: torch.Tensor,
             packed: Packed) -> None:
        pad_into(self.tokens, tokens)
        pad_into(self.pos, pos)
        pad_into(self.view.table, table)
        pad_into(self.at, logits_at)
        layout = Packed.of(packed.lengths, packed.keys, "cpu", self.shape)
        self.packed.index.copy_(layout.index, non_blocking=True)
        self.packed.where.copy_(layout.where, non_blocking=True)
        self.packed.lengths, self.packed.keys = packed.lengths, packed.keys  # host side: not read on the GPU

    def run(self) -> torch.Tensor:
        return self.model(self.tokens, self.pos, self.view, self.mode, self.at, self.packed)

    def capture(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self.run()
        from selfspec.kernels.triton_linear import dequantize_scratch  # CUDA only: Triton is there

        self.scratch = dequantize_scratch(self.model.device)  # the buffer the graph writes stays alive


class _Graphed:
    """The model's forward with decode passes replayed from graphs captured on first use (module docstring)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.cfg = model.cfg
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None  # the graphs' shared memory pool, made at the first capture

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def captures(self) -> int:
        """Graphs captured so far (one capture stalls the engine for its eager run and the recording)."""
        return len(self._graphs)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _static(self, cache, rows: int) -> tuple[object, int]:
        """The cache object the graph of this pass is bound to, and its number of rows."""
        return cache, rows

    def release(self) -> None:
        """Destroy the captured graphs (a pass of each shape captures again on its next call). Under tensor
        parallelism every rank does so before leaving the process group: NCCL's teardown hangs while a graph that
        holds its kernels lives."""
        torch.cuda.synchronize(self.device)
        for graph in self._graphs.values():
            graph.graph.reset()
        self._graphs.clear()

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache, mode: Mode,
                 logits_at: torch.Tensor | None = None, packed: Packed | None = None,
                 tree: TreeLayout | None = None) -> torch.Tensor:
        # A prefill runs eagerly. Under tensor parallelism every rank captures the same passes in the same order (the
        # step plan is the same on every rank), so each graph holds the same collectives on every rank.
        width = tokens.shape[1] if tree is None else tree.rows.shape[1]
        eager = logits_at is not None or packed is not None or mode.prompt or width > MAX_GRAPHED_TOKENS
        if eager:
            return self.model(tokens, pos, cache, mode, logits_at, packed, tree)
        rows = tokens.shape[0] if tree is None else tree.rows.shape[0]
        static, rows = self._static(cache, rows)
        # The mode itself: its skipped layers too. A tree pass: its nodes padded to a power of two (>= 16), and
        # whether its rows share one cache row.
        shape = (rows, width) if tree is None else (rows, width, node_bucket(tokens.shape[1]), tree.tails is not None)
        key = (id(static), mode, shape)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(tokens, pos) if tree is None else graph(tokens, pos, tree)
        logits = self.model(tokens, pos, cache, mode, tree=tree)  # first time: eager (compiles kernels), then capture
        torch.cuda.synchronize()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        kind = _Graph if tree is None else _TreeGraph
        self._graphs[key] = kind(self.model, static, mode, shape, self._pool)
        return logits


class GraphedModel(_Graphed):
    """A Transformer on CUDA whose forward passes replay CUDA graphs (see the module docstring)."""

    def __init__(self, model: Transformer, max_len: int | None = None) -> None:
        super().__init__(model)
        self.max_len = max_len or model.cfg.max_seq_len
        self._caches: dict[int, KVCache] = {}

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """The persistent cache of this batch size, emptied (it holds self.max_len positions, >= max_len)."""
        if max_len > self.max_len:
            raise ValueError(f"a cache of {max_len} positions asked for; graphs were set up for {self.max_len}")
        cache = self._caches.get(batch)
        if cache is None:
            cache = self._caches[batch] = self.model.new_cache(self.max_len, batch)
        cache.commit(0)
        return cache


class PagedGraphedModel(_Graphed):
    """The serving engine's decode passes (views of its paged cache, no padding tokens) as CUDA graphs, batches
    padded to their bucket; each bucket's graphs read one static view, whose table holds max_len positions."""

    def __init__(self, model: Transformer, cache: PagedKVCache | PagedQuantKVCache, max_len: int) -> None:
        super().__init__(model)
        self.cache = cache
        self.width = cache.blocks_for(max_len)
        self._views: dict[int, PagedBatchView] = {}
        self._prompts: dict[tuple, _PromptGraph] = {}

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache, mode: Mode,
                 logits_at: torch.Tensor | None = None, packed: Packed | None = None,
                 tree: TreeLayout | None = None) -> torch.Tensor:
        if (packed is None or not mode.prompt or logits_at is None
                or isinstance(self.cache, PagedQuantKVCache)):  # a quantized cache's prompt passes: eager
            return super().__call__(tokens, pos, cache, mode, logits_at, packed, tree)
        n, rows, width = tokens.shape[1], len(packed.lengths), max(packed.lengths)
        padded = prompt_bucket(n)
        shape = (padded, rows if padded == n else bucket(rows + 1), min(prompt_bucket(width), padded))
        if len(logits_at) > shape[1]:  # more than a logits row per prompt (all positions): eager
            return super().__call__(tokens, pos, cache, mode, logits_at, packed)
        key = (mode, shape)
        graph = self._prompts.get(key)
        if graph is None:  # first time: eager on the static inputs (compiles kernels), then capture
            graph = _PromptGraph(self.model, self.cache, mode, shape, self.width)
            graph.fill(tokens, pos, cache.table, logits_at, packed)
            logits = graph.run()
            torch.cuda.synchronize()
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph.capture(self._pool)
            self._prompts[key] = graph
            return logits[:len(logits_at)]
        graph.fill(tokens, pos, cache.table, logits_at, packed)
        graph.graph.replay()
        return graph.logits[:len(logits_at)]

    @property
    def captures(self) -> int:
        return len(self._graphs) + len(self._prompts)

    def release(self) -> None:
        super().release()
        for graph in self._prompts.values():
            graph.graph.reset()
        self._prompts.clear()

    def _static(self, view: PagedBatchView | PagedQuantBatchView,
                rows: int) -> tuple[PagedBatchView | PagedQuantBatchView, int]:
        size = bucket(rows)
        static = self._views.get(size)
        if static is None:
            static = self._views[size] = trash_view(self.cache, size, self.width)
        pad_into(static.table, view.table)
        if isinstance(static, PagedQuantBatchView):  # padding rows write to the trash buffer row
            pad_into(static.rows, view.rows)
            pad_into(static.starts, view.starts)
        return static, size
