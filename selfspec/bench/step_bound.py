"""The step-cost bound of a serving run: the throughput the run would reach if the GPU ran its passes back to back,
each at the cost it has alone. measured / bound says how much the host (scheduling, sampling, Python between
passes) and idle gaps took: 1.0 is a run that never waits on the host.

`PassLog` (bench/passes.py) stands in for the engine's runner during a run and logs every pass by what sets its
cost: the mode, rows and tokens of a decode, draft or verify pass (the CUDA graphs replay these), the packed rows'
lengths and keys of a prefill pass, the rows, width and nodes of a node-packed tree pass. `bound_seconds` then times
each distinct pass alone on padding rows (trash blocks), decode and tree passes at a given context length, and adds
them up. A draft model's own passes run outside the engine's runner and are not counted (the bound of `draft-model`
is optimistic by their cost).
"""
from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

from selfspec.cache.paged import PagedBatchView
from selfspec.engine.engine import Engine
from selfspec.model import Packed, TreeLayout
from selfspec.quant.modes import Mode
from selfspec.speculative.drafters import SHARED_TREE_BATCH


def pass_seconds(engine: Engine, mode: Mode, shape: tuple, context: int, repeats: int = 5) -> float:
    """The median time of one pass of this shape alone (after one untimed run), on padding rows."""
    dev = engine.llm.model.device
    if shape[0] == "prefill":
        _, lengths, keys = shape
        table = torch.zeros(len(lengths), engine.cache.blocks_for(max(keys)), dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(k - n, k) for n, k in zip(lengths, keys)]).to(dev)[None]
        args = (torch.zeros_like(pos), pos, PagedBatchView(engine.cache, table), mode,
                torch.arange(len(lengths), device=dev), Packed.of(list(lengths), list(keys), dev))
    elif shape[0] == "tree":  # rows of this width over these nodes (several sequences' trees, rows padded): a
        _, rows, t, nodes, shared = shape  # sequence a row (shared rows: up to SHARED_TREE_BATCH sequences, their
        context = min(context, engine.max_len - t)  # rows dealt out among them), the draft nodes dealt out as chains
        seqs = min(rows, SHARED_TREE_BATCH) if shared else rows
        drafts = nodes - seqs  # each sequence holds its pending token: nodes <= rows x width
        depths = [drafts // rows + (i < drafts % rows) for i in range(rows)]
        trees = [(0, context, [[j + 1] * d for j, d in enumerate(depths[i::seqs])]) for i in range(seqs)]
        tree, toks, pos = TreeLayout.of(trees, dev, shared, t)
        table = torch.zeros(rows, engine.cache.blocks_for(context + t), dtype=torch.long, device=dev)
        args = (toks[None], pos[None], PagedBatchView(engine.cache, table), mode, None, None, tree)
    else:
        rows, t = shape
        context = min(context, engine.max_len - t)
        table = torch.zeros(rows, engine.cache.blocks_for(context + t), dtype=torch.long, device=dev)
        pos = (context + torch.arange(t, device=dev)).expand(rows, t).contiguous()
        args = (torch.zeros_like(pos), pos, PagedBatchView(engine.cache, table), mode)
    times = []
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            engine.runner(*args)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bound_seconds(engine: Engine, passes: Counter, context: int, costs: dict) -> float:
    """The time the counted passes take back to back; `costs` keeps each pass shape's time across runs."""
    total = 0.0
    for (mode, shape), n in passes.items():
        key = (mode, shape, context)
        if key not in costs:
            costs[key] = pass_seconds(engine, mode, shape, context)
        total += n * costs[key]
    return total


def pass_table(passes: Counter, context: int, costs: dict) -> list[dict]:
    """The counted passes for a JSON report, the dearest in all first: mode, shape, count, ms each, ms in all."""
    rows = [{"mode": mode.name, "prompt": mode.prompt, "shape": list(shape), "count": n,
             "ms": 1e3 * costs[(mode, shape, context)]} for (mode, shape), n in passes.items()]
    for r in rows:
        r["ms_total"] = r["count"] * r["ms"]
    return sorted(rows, key=lambda r: -r["ms_total"])
