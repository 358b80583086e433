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
position 0 whose block table is all trash block, so their writes land there and their logits are dropped.
"""
from __future__ import annotations

import torch

from selfspec.cache import KVCache
from selfspec.cache.paged import PagedBatchView, PagedKVCache
from selfspec.model import Packed, Transformer
from selfspec.quant.modes import Mode

MAX_GRAPHED_TOKENS = 16  # decode steps: AR (1), draft (1), verify (gamma + 1)


def bucket(rows: int) -> int:
    """The batch size of the graph a pass of `rows` rows replays: the next power of two."""
    return 1 << (rows - 1).bit_length()


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
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _static(self, cache, rows: int) -> tuple[object, int]:
        """The cache object the graph of this pass is bound to, and its number of rows."""
        return cache, rows

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache, mode: Mode,
                 logits_at: torch.Tensor | None = None, packed: Packed | None = None) -> torch.Tensor:
        # A prefill runs eagerly; so does a tensor-parallel pass until capturing its collectives is proven on GPUs.
        eager = (logits_at is not None or packed is not None or mode.prompt or tokens.shape[1] > MAX_GRAPHED_TOKENS
                 or self.model.tp.size > 1)
        if eager:
            return self.model(tokens, pos, cache, mode, logits_at, packed)
        static, rows = self._static(cache, tokens.shape[0])
        key = (id(static), mode, rows, tokens.shape[1])  # the mode itself: its skipped layers too
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(tokens, pos)
        logits = self.model(tokens, pos, cache, mode)  # first time: eager (compiles kernels), then capture
        torch.cuda.synchronize()
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        self._graphs[key] = _Graph(self.model, static, mode, (rows, tokens.shape[1]), self._pool)
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

    def __init__(self, model: Transformer, cache: PagedKVCache, max_len: int) -> None:
        super().__init__(model)
        self.cache = cache
        self.width = cache.blocks_for(max_len)
        self._views: dict[int, PagedBatchView] = {}

    def _static(self, view: PagedBatchView, rows: int) -> tuple[PagedBatchView, int]:
        size = bucket(rows)
        static = self._views.get(size)
        if static is None:
            table = torch.zeros(size, self.width, dtype=torch.long, device=self.device)
            static = self._views[size] = PagedBatchView(self.cache, table)
        pad_into(static.table, view.table)
        return static, size
