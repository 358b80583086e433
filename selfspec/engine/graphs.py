"""CUDA-graph forward passes: the model's forward, captured once per (cache, mode, batch, tokens) and replayed.

The host of a GPU machine is slow; an eager decode step launches hundreds of kernels and the GPU waits on
Python. A graph replays them in one launch. `GraphedModel` has the model's call signature, so the decoding
loop and the engine run unchanged: a step shape seen for the first time runs eagerly (that run compiles the
kernels and its result is returned), is captured, and every later call with that shape replays the graph.
Graphs are bound to a cache's buffers, so `new_cache` hands out one persistent cache per batch size. Passes
of more than MAX_GRAPHED_TOKENS tokens per row (prefill) run eagerly: they are few, and each length would
need its own graph.
"""
from __future__ import annotations

import torch

from selfspec.cache import KVCache
from selfspec.model import Transformer
from selfspec.quant.modes import Mode

MAX_GRAPHED_TOKENS = 16  # decode steps: AR (1), draft (1), verify (gamma + 1)


class _Graph:
    """One captured forward: static token and position inputs, static logits output."""

    def __init__(self, model: Transformer, cache: KVCache, mode: Mode, shape: tuple[int, int], pool) -> None:
        self.tokens = torch.zeros(shape, dtype=torch.long, device=model.device)
        self.pos = torch.zeros(shape, dtype=torch.long, device=model.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.tokens, self.pos, cache, mode)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos.copy_(pos.expand(self.pos.shape), non_blocking=True)
        self.graph.replay()
        return self.logits


class GraphedModel:
    """A Transformer on CUDA whose forward passes replay CUDA graphs (see the module docstring)."""

    def __init__(self, model: Transformer, max_len: int | None = None) -> None:
        self.model = model
        self.cfg = model.cfg
        self.max_len = max_len or model.cfg.max_seq_len
        self._caches: dict[int, KVCache] = {}
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """The persistent cache of this batch size, emptied (it holds self.max_len positions, >= max_len)."""
        if max_len > self.max_len:
            raise ValueError(f"a cache of {max_len} positions asked for; graphs were set up for {self.max_len}")
        cache = self._caches.get(batch)
        if cache is None:
            cache = self._caches[batch] = self.model.new_cache(self.max_len, batch)
        cache.commit(0)
        return cache

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache, mode: Mode) -> torch.Tensor:
        if tokens.shape[1] > MAX_GRAPHED_TOKENS:
            return self.model(tokens, pos, cache, mode)
        key = (id(cache), mode.name, *tokens.shape)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(tokens, pos)
        logits = self.model(tokens, pos, cache, mode)  # first time: eager (compiles kernels), then capture
        torch.cuda.synchronize()
        self._graphs[key] = _Graph(self.model, cache, mode, tuple(tokens.shape), self._pool)
        return logits
