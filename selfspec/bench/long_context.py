"""Long-context benchmark of the quantized KV cache (QuantSpec; docs/long-context.md), at Llama-3-8B heads.

python -m selfspec.bench.long_context [--contexts 4096 8192 ... 131072] [--gamma 1 2 3 4] [--json out.json]
    [--plot attention.png] [--acceptance A | --acceptance-json FILE] [--sinks 4] [--parts attention,memory,steps]
    [--loop-tokens 128]
(also `selfspec bench long_context ...`)

1. attention: one layer's decode attention (1 query) and verify attention (gamma + 1 queries) at batch 1 per
   context, microseconds under CUDA graph replays (median), for the bf16 cache (paged 16-key blocks: the serving
   engine's path; contiguous: solo decoding's), `int8`, `hier` both planes (verify), `hier` upper plane (draft),
   and a StreamingLLM-style sparse draft (bf16 keys of the first blocks holding --sinks tokens plus a recent
   window, as many bytes as the upper plane reads). Caches hold random keys and values committed a group at a time
   through QuantKVCache (the layout decode reads).
2. memory: bytes of the whole model's KV cache per format (QuantKVCache / KVCache nbytes: codes, scales, zeros and
   the full-precision buffer) against bf16, and the peak GPU memory of a decode step (part 3).
3. steps: forward passes of the synthetic 8B model (random weights) at each context, replayed as CUDA graphs (as
   decode runs them): AR (bf16 weights, bf16 KV) and each recipe's verify (gamma + 1 tokens, each --gamma) and
   draft step, and the speedup over AR predicted from these step costs and a per-token acceptance a (each judged
   draft accepted with probability a: policy.expected_tokens), per gamma, the best marked (the gamma policy picks
   it), checked against the end-to-end bars at 128k. a is --acceptance, else the `per_token` of each recipe's line
   in --acceptance-json (a `kv_quality --acceptance` output), else assumed 0.9. An older file's `rate` (accepted /
   proposed at a fixed gamma, which counts the unjudged drafts after a rejection) understates a: it is used, but
   labelled so.
4. loop (not in the default parts): the real decoding loop (speculative/decode.py) of the same model under CUDA graphs
   from a cache filled to each context: AR, and each recipe at each gamma with each round's accepted drafts replayed
   at its acceptance a (`replayed_runs`); tokens/s and the speedup over AR measured, not predicted, checked against
   the same bars. The buffer's groups are quantized as decoding fills them, as in serving.

--tiny runs parts 1 and 2 on the CPU with tiny heads and contexts (torch references, not the Triton kernels).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from selfspec import kernels
from selfspec.bench.device import copies_past_l2, graph_time_ms, time_ms
from selfspec.cache.kv import KVCache
from selfspec.cache.quant_kv import QuantKVCache, QuantPools, quantized_below
from selfspec.errors import SelfspecError
from selfspec.quant.modes import get_mode
from selfspec.speculative.policy import expected_tokens
from selfspec.speculative.recipes import PRESETS

SHAPE = "llama-3-8b"
BLOCK_SIZE = 16  # the serving engine's bf16 KV blocks (cli.py --block-size)
ASSUMED_ACCEPTANCE = 0.9
# Kernel name -> KV format and whether it reads the upper plane only ("bf16*" and "sparse" read a bf16 cache).
QUANT_KERNELS = {"int8": ("int8", False), "hier-full": ("hier", False), "hier-upper": ("hier", True)}
KERNELS = ("bf16", "bf16-contiguous", *QUANT_KERNELS, "sparse")
BARS = {"hier-upper": 2.5, "hier-full": 1.4}  # speedup over bf16 wanted from BAR_CONTEXT keys on
BAR_CONTEXT = 65536
E2E_BARS = {"quantspec": 2.0, "selfspec": 2.3}  # predicted speedup over bf16 AR wanted at E2E_CONTEXT keys
E2E_CONTEXT = 131072
LOOP_WARM = 16  # tokens of the real loop before its clock starts (they capture the CUDA graphs)
LOOP_TOKENS = 128  # tokens it times
MAX_RUN = 16  # the longest run of accepted drafts a replayed round draws
RECIPES = ("quantspec", "selfspec")


@dataclass(frozen=True)
class Heads:
    """One layer's attention shape and the KV quantization group."""
    q: int
    kv: int
    dim: int
    group: int
    layers: int


LLAMA_3_8B = Heads(32, 8, 128, 128, 32)
TINY = Heads(4, 2, 32, 16, 2)  # the smallest heads the Triton kernel takes (on a GPU)
CONTEXTS = [4096, 8192, 16384, 32768, 65536, 131072]
TINY_CONTEXTS = [256, 512]


def fill_quant_cache(cache: QuantKVCache, context: int) -> None:
    """Commit `context` positions of random keys and values a group at a time, as decoding does: each group written
    into the buffer (and every slot past it, so a query's own key is random too), then quantized by `commit`."""
    for length in [*range(cache.group, context, cache.group), context]:
        cache.k[..., cache.length - cache.start:, :].normal_()
        cache.v[..., cache.length - cache.start:, :].normal_()
        cache.commit(length)


def fill_cache(cache: KVCache | QuantKVCache, context: int) -> KVCache | QuantKVCache:
    """`cache` holding `context` committed positions of random keys and values (a quantized one filled as
    decoding fills it: `fill_quant_cache`)."""
    if isinstance(cache, QuantKVCache):
        fill_quant_cache(cache, context)
    else:
        cache.k.normal_()
        cache.v.normal_()
        cache.commit(context)
    return cache


def quant_cache(heads: Heads, fmt: str, context: int, extra: int, layers: int, device: torch.device) -> QuantKVCache:
    cache = QuantKVCache(layers, 1, heads.kv, context + extra, heads.dim, torch.bfloat16, device, fmt, heads.group)
    fill_quant_cache(cache, context)
    return cache


def paged_bf16(heads: Heads, keys: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 pools [N, Hkv, 16, D] of one layer and a block table [1, keys / 16] at shuffled ids (block 0 unused,
    as the engine's trash block)."""
    w = -(-keys // BLOCK_SIZE)
    table = (torch.randperm(w, device=device) + 1)[None]
    k, v = (torch.randn(w + 1, heads.kv, BLOCK_SIZE, heads.dim, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    return k, v, table


def read_bytes(heads: Heads, fmt: str, upper: bool, pos: int) -> int:
    """Bytes one layer's attention reads for a query at position pos (keys 0..pos): bf16 keys and values, or the
    quantized groups below quantized_below(pos) (one plane where `upper`, with their scales and zeros) and the rest
    from the bf16 buffer. Counted from a QuantPools of those groups (meta tensors: no memory)."""
    row = heads.kv * heads.dim * 2 * 2  # bf16 key + value of one position
    if fmt == "bf16":
        return (pos + 1) * row
    below = int(quantized_below(torch.tensor(pos), heads.group))
    pools = QuantPools(1, 1, heads.kv, below, heads.dim, "meta", fmt, heads.group)
    planes = [p[:1] if upper else p for p in (pools.k_planes, pools.v_planes)]
    tensors = [*planes[0], *planes[1], pools.k_scale, pools.k_zero, pools.v_scale, pools.v_zero]
    return sum(t.numel() * t.element_size() for t in tensors) + (pos + 1 - below) * row


def sparse_blocks(heads: Heads, context: int, sinks: int) -> tuple[int, int]:
    """(sink blocks, window blocks) of the sparse draft: whole 16-key blocks, the first holding the `sinks` tokens,
    then the recent window, together reading no more bytes than the upper plane at this context."""
    budget = read_bytes(heads, "hier", True, context) // (heads.kv * heads.dim * 2 * 2 * BLOCK_SIZE)
    sink_blocks = -(-sinks // BLOCK_SIZE)
    return sink_blocks, max(1, budget - sink_blocks)


def sparse_view(table: torch.Tensor, pos: int, sink_blocks: int, window_blocks: int) -> tuple[torch.Tensor, int]:
    """A block table [1, W'] holding the sink blocks and the window's blocks ending at position pos, and pos's
    index in it: the bf16 attention kernel then reads exactly those keys, causal, with no kernel of its own (keys
    carry their rope angles from when they were stored, so where they sit in the table does not matter)."""
    last = pos // BLOCK_SIZE
    first = max(sink_blocks, last - window_blocks + 1)
    blocks = [*range(sink_blocks), *range(first, last + 1)]
    return table[:, blocks], pos - (first - sink_blocks) * BLOCK_SIZE


def median_us(fns: list[Callable[[], object]], device: torch.device) -> float:
    """Microseconds per call: CUDA graph replays cycling through fns on the GPU, a wall-clock median on the CPU."""
    if device.type == "cuda":
        return 1000 * graph_time_ms(fns)
    times = []
    for _ in range(3):
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def attention_rows(heads: Heads, context: int, queries: int, sinks: int, device: torch.device,
                   names: tuple[str, ...] = KERNELS) -> list[dict]:
    """One row per kernel of `names` (bf16 first): microseconds of one layer's attention of `queries` queries at
    positions context.., the bytes it reads, and its effective bandwidth. Each kernel cycles through enough caches
    to stream from HBM."""
    pos = context + torch.arange(queries, device=device)[None]
    last = context + queries - 1
    q = torch.randn(1, heads.q, queries, heads.dim, device=device, dtype=torch.bfloat16)
    attend = kernels.lookup("attention", "", device.type)
    n_copies = copies_past_l2(2 * (context + queries) * heads.kv * heads.dim * 2) if device.type == "cuda" else 1
    rows = []

    def add(kernel: str, fns: list[Callable[[], object]], nbytes: int, **extra) -> None:
        if kernel not in names:
            return
        us = median_us(fns, device)
        rows.append({"part": "attention", "context": context, "queries": queries, "kernel": kernel, "us": us,
                     "read_bytes": nbytes, "gb_s": nbytes / us / 1e3, **extra})
        print(f"attention context {context:6d} T={queries} {kernel:15s} {us:9.1f} us", flush=True)

    bf16_bytes = read_bytes(heads, "bf16", False, last)
    paged = [paged_bf16(heads, context + queries, device) for _ in range(n_copies)]
    add("bf16", [partial(attend, q, k, v, table, pos) for k, v, table in paged], bf16_bytes)
    if queries == 1 and "sparse" in names:  # a draft: its verify pass is the full bf16 attention above
        sink_blocks, window_blocks = sparse_blocks(heads, context, sinks)
        views = [(k, v, *sparse_view(table, context, sink_blocks, window_blocks)) for k, v, table in paged]
        keys = views[0][3] + 1  # the sink blocks' keys and the window's up to the query
        add("sparse", [partial(attend, q, k, v, table, torch.full_like(pos, at)) for k, v, table, at in views],
            read_bytes(heads, "bf16", False, keys - 1), sink_blocks=sink_blocks, window_blocks=window_blocks)
    del paged
    if "bf16-contiguous" in names:
        contiguous = [KVCache(1, 1, heads.kv, context + queries, heads.dim, torch.bfloat16, device)
                      for _ in range(n_copies)]
        for c in contiguous:
            c.k.normal_()
            c.v.normal_()
        add("bf16-contiguous", [partial(attend, q, c.k[0], c.v[0], c.table, pos) for c in contiguous], bf16_bytes)
        del contiguous
    quant_attend = kernels.lookup("quantized_attention", "", device.type)
    if device.type == "cuda":  # the positions known on the host: no sync inside the call, so graphs capture it
        quant_attend = partial(quant_attend, max_pos=last)
    for fmt in {QUANT_KERNELS[k][0]: None for k in names if k in QUANT_KERNELS}:
        one = read_bytes(heads, fmt, False, last)
        n = copies_past_l2(one) if device.type == "cuda" else 1
        caches = [quant_cache(heads, fmt, context, queries, 1, device) for _ in range(n)]
        for kernel, (f, upper) in QUANT_KERNELS.items():
            if f == fmt:
                add(kernel, [partial(quant_attend, q, c.layer(0), pos, upper) for c in caches],
                    read_bytes(heads, fmt, upper, last))
        del caches
    base = rows[0]["us"]
    for r in rows:
        r["x_bf16"] = base / r["us"]
    return rows


def memory_rows(heads: Heads, contexts: list[int]) -> list[dict]:
    """Bytes of every layer's KV cache of one sequence of `context` positions per format, from the cache objects
    (meta tensors: exact sizes, no memory); the sparse draft keeps the bf16 cache (its verify reads all of it)."""
    rows = []
    for context in contexts:
        bf16 = KVCache(heads.layers, 1, heads.kv, context, heads.dim, torch.bfloat16, "meta")
        sizes = {"bf16": bf16.k.nbytes + bf16.v.nbytes, "sparse": bf16.k.nbytes + bf16.v.nbytes}
        for fmt in ("int8", "hier"):
            sizes[fmt] = QuantKVCache(heads.layers, 1, heads.kv, context, heads.dim, torch.bfloat16, "meta", fmt,
                                      heads.group).nbytes()
        rows += [{"part": "memory", "context": context, "format": fmt, "bytes": n, "x_bf16": n / sizes["bf16"]}
                 for fmt, n in sizes.items()]
    return rows


def step_rows(contexts: list[int], gammas: list[int], log: Callable[[str], None]) -> list[dict]:
    """Forward passes of the synthetic 8B model at each context that fits (CUDA graph replays on the GPU, each
    pass rewriting the same positions' KV): AR (bf16 weights and KV) and each recipe's verify (gamma + 1 tokens,
    for each gamma) and draft pass, with the peak GPU memory of each."""
    from selfspec.bench.synthetic import synthetic_model

    max_len = max(contexts) + max(gammas) + 1
    runs = {"ar": ("dense", "bf16", [("ar", get_mode("bf16"), 1)])}
    for name in RECIPES:
        r = PRESETS[name]
        draft = replace(get_mode(r.draft), kv_upper=r.kv == "hier")
        verify = [("verify", get_mode(r.verify), g + 1) for g in sorted(gammas)]
        runs[name] = (r.storage, r.kv, [*verify, ("draft", draft, 1)])
    rows = []
    for recipe, (storage, kv, passes) in runs.items():
        model = synthetic_model(SHAPE, storage, max_seq_len=max_len)
        model.set_kv_format(kv, LLAMA_3_8B.group)
        for context in contexts:
            try:
                cache = fill_cache(model.new_cache(context + max(gammas) + 1), context)
            except torch.cuda.OutOfMemoryError:
                log(f"{recipe} context {context}: the cache does not fit next to the weights; skipped")
                rows.append({"part": "steps", "recipe": recipe, "context": context, "skipped": "out of memory"})
                continue
            for kind, mode, tokens in passes:
                tok = torch.randint(0, model.cfg.vocab_size, (1, tokens), device=model.device)
                pos = context + torch.arange(tokens, device=model.device)[None]
                step = partial(model, tok, pos, cache, mode)
                ms = graph_time_ms([step], rounds=1) if model.device.type == "cuda" else time_ms(step, reps=10)
                torch.cuda.reset_peak_memory_stats()
                model(tok, pos, cache, mode)
                peak = torch.cuda.max_memory_allocated()
                rows.append({"part": "steps", "recipe": recipe, "context": context, "pass": kind, "mode": mode.name,
                             "kv": kv, "kv_upper": mode.kv_upper, "tokens": tokens, "ms": ms, "peak_bytes": peak})
                log(f"{recipe:9s} context {context:6d} {kind:6s} {mode.name:5s} T={tokens}: {ms:.3f} ms, "
                    f"peak {peak / 2**30:.1f} GiB")
            del cache
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    return rows


def acceptance_rates(value: float | None, path: str | None) -> dict[str, tuple[float, str]]:
    """Each recipe's per-token acceptance a (policy.expected_tokens' a: each judged draft is accepted with
    probability a) and where it comes from: --acceptance, else its line in a `kv_quality --acceptance` output (JSON
    lines), else ASSUMED_ACCEPTANCE, labelled as assumed. A line's `per_token` (accepted / (accepted + rejected)) is
    that a. A line of an older output holds only `rate` = accepted / proposed, the share of drafts accepted at its
    fixed gamma: the drafts after a rejection count as proposed though never judged, so it understates a (and a
    cannot be recovered from accepted and proposed alone). It is used, labelled as such, never silently."""
    if value is not None:
        if not 0 <= value <= 1:
            raise SelfspecError(f"--acceptance is a rate between 0 and 1, got {value}")
        return {r: (value, "given") for r in RECIPES}
    measured = {}
    if path is not None:
        with open(path) as f:
            for line in f:
                if line.strip().startswith("{"):
                    item = json.loads(line)
                    if "recipe" not in item:
                        continue
                    if "per_token" in item:
                        measured[item["recipe"]] = (float(item["per_token"]), f"measured per-token ({path})")
                    elif "rate" in item:
                        gamma = item.get("gamma", "?")
                        measured[item["recipe"]] = (
                            float(item["rate"]),
                            f"draft share at gamma {gamma} (understates per-token acceptance) ({path})")
    return {r: measured.get(r, (ASSUMED_ACCEPTANCE, "ASSUMED")) for r in RECIPES}


def predictions(rows: list[dict], gammas: list[int], rates: dict[str, tuple[float, str]]) -> list[dict]:
    """Per recipe, context and gamma: tokens per round E(gamma) at acceptance a (policy.expected_tokens) over the
    round's cost (gamma draft steps + one verify pass of gamma + 1 tokens) in AR steps: the speedup over bf16 AR
    predicted from step costs. `best` marks each recipe and context's fastest gamma (what the policy would pick)."""
    steps = {(r["recipe"], r["context"], r["pass"], r["tokens"]): r["ms"] for r in rows
             if r["part"] == "steps" and "ms" in r}
    out = []
    for recipe, (a, source) in rates.items():
        for context in sorted({c for _, c, _, _ in steps}):
            ar, draft = steps.get(("ar", context, "ar", 1)), steps.get((recipe, context, "draft", 1))
            found = []
            for gamma in sorted(gammas):
                verify = steps.get((recipe, context, "verify", gamma + 1))
                if None in (ar, verify, draft):
                    continue
                tokens = expected_tokens(a, gamma)
                found.append({"part": "prediction", "recipe": recipe, "context": context, "acceptance": a,
                              "acceptance_source": source, "gamma": gamma, "verify_over_ar": verify / ar,
                              "draft_over_verify": draft / verify, "expected_tokens": tokens,
                              "speedup": tokens * ar / (gamma * draft + verify), "best": False})
            if found:
                max(found, key=lambda r: r["speedup"])["best"] = True
            out += found
    return out


def replayed_runs(a: float, rounds: int, seed: int = 0) -> list[int]:
    """Each round's run of accepted drafts at per-token acceptance a: how many Bernoulli(a) draws succeed before
    the first failure (at most MAX_RUN), seeded, so that every recipe and gamma replays the same rounds."""
    gen = torch.Generator().manual_seed(seed)
    fails = torch.rand(rounds, MAX_RUN, generator=gen) >= a
    return torch.where(fails.any(1), fails.int().argmax(1), MAX_RUN).tolist()


def loop_speed(model, cache, context: int, verify, draft, gamma: int, runs: list[int], new_tokens: int,
               warm: int = LOOP_WARM) -> dict:
    """The real decoding loop (speculative/decode.py, batch 1) from a cache holding `context` committed positions:
    one prompt token, then `new_tokens` tokens, each round accepting its replayed run of drafts (ReplayAcceptance;
    draft None: AR). Tokens per second over the tokens after the first `warm` (those capture the CUDA graphs)."""
    from selfspec.bench.traces import ReplayAcceptance
    from selfspec.engine.stats import GenerationStats
    from selfspec.speculative.decode import decode
    from selfspec.speculative.sampling import SamplingParams

    stats = GenerationStats()
    params = SamplingParams(max_new_tokens=new_tokens + warm, ignore_eos=True)
    n, t0, tokens = 0, None, 0
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for chunk in decode(model, [1], verify, draft, gamma if draft is not None else 0, params, stats, cache=cache,
                        accept=ReplayAcceptance(runs), start=context):
        n += len(chunk)
        if t0 is None and n >= warm:
            sync()
            t0, tokens, rounds = time.perf_counter(), n, stats.rounds
        if n >= warm + new_tokens:
            break
    sync()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": (n - tokens) / seconds, "tokens": n - tokens, "rounds": stats.rounds - rounds,
            "accepted": stats.draft_accepted}


def loop_rows(contexts: list[int], gammas: list[int], rates: dict[str, tuple[float, str]], new_tokens: int,
              log: Callable[[str], None]) -> list[dict]:
    """The real loop (`loop_speed`) of the synthetic 8B model under CUDA graphs at each context: AR (bf16 weights
    and KV), and each recipe at each gamma with its acceptance replayed, from a cache filled with random keys and
    values (no prefill: the bars are about decoding). The speedup is over AR at the same context."""
    from selfspec.bench.synthetic import synthetic_model
    from selfspec.engine.graphs import GraphedModel

    max_len = max(contexts) + LOOP_WARM + new_tokens + max(gammas) + 2
    rows, ar = [], {}
    for recipe in ("ar", *RECIPES):
        r = None if recipe == "ar" else PRESETS[recipe]
        storage, kv = ("dense", "bf16") if r is None else (r.storage, r.kv)
        model = synthetic_model(SHAPE, storage, max_seq_len=max_len)
        model.set_kv_format(kv, LLAMA_3_8B.group)
        gm = GraphedModel(model, max_len)
        verify = get_mode("bf16" if r is None else r.verify)
        draft = None if r is None else replace(get_mode(r.draft), kv_upper=kv == "hier")
        a, source = rates.get(recipe, (0.0, "-"))
        runs = replayed_runs(a, 4 * (LOOP_WARM + new_tokens))
        for context in contexts:
            for gamma in ([0] if r is None else sorted(gammas)):
                cache = fill_cache(gm.new_cache(max_len), context)
                out = loop_speed(gm, cache, context, verify, draft, gamma, runs, new_tokens)
                row = {"part": "loop", "recipe": recipe, "context": context, "gamma": gamma, **out}
                if r is None:
                    ar[context] = out["tokens_per_s"]
                else:
                    row.update(acceptance=a, acceptance_source=source, speedup=out["tokens_per_s"] / ar[context])
                rows.append(row)
                log(f"loop {recipe:9s} context {context:6d} gamma {gamma}: {out['tokens_per_s']:.1f} tok/s"
                    + (f" ({row['speedup']:.2f}x AR)" if "speedup" in row else ""))
        del gm, model
        torch.cuda.empty_cache()
    return rows


def attention_table(rows: list[dict]) -> str:
    out = ["| context | queries | kernel | KV read (MiB) | us | GB/s | x bf16 |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "attention"):
        name = r["kernel"] + (f" ({r['sink_blocks']} sink + {r['window_blocks']} window blocks)"
                              if r["kernel"] == "sparse" else "")
        out.append(f"| {r['context']} | {r['queries']} | {name} | {r['read_bytes'] / 2**20:.2f} | {r['us']:.1f} | "
                   f"{r['gb_s']:.0f} | {r['x_bf16']:.2f} |")
    return "\n".join(out)


def bar_lines(rows: list[dict]) -> list[str]:
    """Whether the wanted decode speedups over bf16 hold from BAR_CONTEXT keys on, and the recipes' predicted
    speedups over bf16 AR (at their best gamma) at E2E_CONTEXT."""
    lines = []
    for recipe, want in E2E_BARS.items():
        best = [r for r in rows if r["part"] == "prediction" and r["recipe"] == recipe and r["best"]
                and r["context"] == E2E_CONTEXT]
        if best:
            r = best[0]
            lines.append(f"bar: {recipe} >= {want}x bf16 AR at {E2E_CONTEXT // 1024}k keys (predicted, gamma "
                         f"{r['gamma']}, acceptance {r['acceptance']:.3f} {r['acceptance_source']}): "
                         f"{'met' if r['speedup'] >= want else 'MISSED'} ({r['speedup']:.2f}x)")
    for recipe, want in E2E_BARS.items():
        loops = [r for r in rows if r["part"] == "loop" and r["recipe"] == recipe and r["context"] == E2E_CONTEXT]
        if loops:
            r = max(loops, key=lambda r: r["speedup"])
            lines.append(f"bar: {recipe} >= {want}x bf16 AR at {E2E_CONTEXT // 1024}k keys (the real loop, gamma "
                         f"{r['gamma']}, acceptance {r['acceptance']:.3f} {r['acceptance_source']} replayed): "
                         f"{'met' if r['speedup'] >= want else 'MISSED'} ({r['speedup']:.2f}x)")
    for kernel, want in BARS.items():
        hits = [r for r in rows if r["part"] == "attention" and r["kernel"] == kernel and r["queries"] == 1
                and r["context"] >= BAR_CONTEXT]
        if hits:
            worst = min(r["x_bf16"] for r in hits)
            lines.append(f"bar: {kernel} decode >= {want}x bf16 at >= {BAR_CONTEXT // 1024}k keys: "
                         f"{'met' if worst >= want else 'MISSED'} (worst {worst:.2f}x)")
    return lines


def memory_table(rows: list[dict]) -> str:
    peaks = {(r["context"], r["recipe"], r["pass"]): r["peak_bytes"] for r in rows
             if r["part"] == "steps" and "peak_bytes" in r}
    step_of = {"bf16": ("ar", "ar"), "hier": ("selfspec", "verify")}  # a decode step over each cache, where run
    out = ["| context | KV format | KV cache (MiB, all layers) | x bf16 | peak of a step (GiB) |",
           "|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "memory"):
        recipe, kind = step_of.get(r["format"], (None, None))
        peak = peaks.get((r["context"], recipe, kind))
        out.append(f"| {r['context']} | {r['format']} | {r['bytes'] / 2**20:.2f} | {r['x_bf16']:.3f} | "
                   f"{'-' if peak is None else f'{peak / 2**30:.1f} ({recipe} {kind})'} |")
    return "\n".join(out)


def steps_table(rows: list[dict]) -> str:
    out = ["| context | recipe | pass | weights mode | KV read | tokens | ms | peak GiB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "steps"):
        if "skipped" in r:
            out.append(f"| {r['context']} | {r['recipe']} | skipped: {r['skipped']} | | | | | |")
            continue
        kv = r["kv"] + (" upper" if r["kv_upper"] else "")
        out.append(f"| {r['context']} | {r['recipe']} | {r['pass']} | {r['mode']} | {kv} | {r['tokens']} | "
                   f"{r['ms']:.3f} | {r['peak_bytes'] / 2**30:.1f} |")
    return "\n".join(out)


def prediction_table(rows: list[dict]) -> str:
    out = ["| context | recipe | acceptance a | gamma | verify / AR | draft / verify | tokens per round | "
           "predicted speedup vs AR |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "prediction"):
        speedup = f"**{r['speedup']:.2f}x**" if r["best"] else f"{r['speedup']:.2f}x"
        out.append(f"| {r['context']} | {r['recipe']} | {r['acceptance']:.3f} ({r['acceptance_source']}) | "
                   f"{r['gamma']} | {r['verify_over_ar']:.3f} | {r['draft_over_verify']:.3f} | "
                   f"{r['expected_tokens']:.2f} | {speedup} |")
    return "\n".join(out)


def loop_table(rows: list[dict]) -> str:
    loops = [r for r in rows if r["part"] == "loop"]
    best = {id(max(group, key=lambda r: r["tokens_per_s"])) for group in _by_recipe_context(loops).values()}
    out = ["| context | recipe | acceptance a | gamma | rounds | tokens/s | speedup vs AR |",
           "|---|---|---|---|---|---|---|"]
    for r in loops:
        a = f"{r['acceptance']:.3f} ({r['acceptance_source']})" if "acceptance" in r else "-"
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
        if id(r) in best and "speedup" in r:
            speedup = f"**{speedup}**"
        out.append(f"| {r['context']} | {r['recipe']} | {a} | {r['gamma']} | {r['rounds']} | {r['tokens_per_s']:.1f} | "
                   f"{speedup} |")
    return "\n".join(out)


def _by_recipe_context(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["recipe"], r["context"]), []).append(r)
    return groups


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    attention = [r for r in rows if r["part"] == "attention"]
    for t, style in zip(sorted({r["queries"] for r in attention}), ("-", "--")):
        for i, kernel in enumerate(KERNELS):  # a color per kernel, a line style per number of queries
            points = sorted((r["context"], r["us"]) for r in attention if r["kernel"] == kernel and r["queries"] == t)
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", marker="o",
                        label=f"{kernel}, {t} quer{'y' if t == 1 else 'ies'}")
    ax.set(xlabel="context (keys)", ylabel="one layer's attention (us)", xscale="log", yscale="log",
           title="Decode / verify attention vs context, batch 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help=f"keys before the first query (default {CONTEXTS}; --tiny: {TINY_CONTEXTS})")
    ap.add_argument("--gamma", type=int, nargs="+", default=[4],
                    help="drafts per round (one or more): a verify pass reads gamma + 1 queries")
    ap.add_argument("--parts", default="attention,memory,steps",
                    help="comma-separated: attention, memory, steps, loop (the real decoding loop)")
    ap.add_argument("--loop-tokens", type=int, default=LOOP_TOKENS, help="tokens the real loop times per run")
    ap.add_argument("--acceptance", type=float, default=None,
                    help="per-token acceptance a for the predictions (each judged draft accepted with probability a)")
    ap.add_argument("--acceptance-json", default=None, metavar="FILE",
                    help="the output of `python -m selfspec.bench.kv_quality --acceptance quantspec,selfspec`: "
                         "each line's per_token (an older line's rate is used, labelled as understating it)")
    ap.add_argument("--sinks", type=int, default=4, help="attention-sink tokens of the sparse draft")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--plot", default=None, help="PNG of attention time vs context")
    ap.add_argument("--tiny", action="store_true",
                    help=f"tiny heads, contexts {TINY_CONTEXTS}, on the CPU where no GPU is: a check that it runs")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"attention", "memory", "steps", "loop"}:
        raise SelfspecError(f"unknown --parts {sorted(parts - {'attention', 'memory', 'steps', 'loop'})}; "
                            "choose from attention, memory, steps, loop")
    heads = TINY if args.tiny else LLAMA_3_8B
    contexts = args.contexts or (TINY_CONTEXTS if args.tiny else CONTEXTS)
    if min(contexts) < 1 or min(args.gamma) < 1 or max(args.gamma) >= heads.group or args.sinks < 1:
        raise SelfspecError(f"contexts and --sinks must be at least 1 and --gamma in 1..{heads.group - 1} (a pass "
                            f"writes fewer tokens than the KV group {heads.group}); got {contexts}, {args.gamma}, "
                            f"{args.sinks}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny and parts != {"memory"}:
        raise SelfspecError("the long-context benchmark needs a CUDA GPU (but --parts memory); --tiny runs a small "
                            "check on the CPU")
    rates = acceptance_rates(args.acceptance, args.acceptance_json)
    torch.manual_seed(0)
    rows = []
    if "attention" in parts:
        for context in contexts:
            for queries in sorted({1, *(g + 1 for g in args.gamma)}):
                rows += attention_rows(heads, context, queries, args.sinks, device)
    if "memory" in parts:
        rows += memory_rows(heads, contexts)
    if "steps" in parts and not args.tiny:
        rows += step_rows(contexts, args.gamma, print)
        rows += predictions(rows, args.gamma, rates)
    if "loop" in parts and not args.tiny:
        rows += loop_rows(contexts, args.gamma, rates, args.loop_tokens, print)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "heads": vars(heads), "gamma": args.gamma,
                       "sinks": args.sinks, "block_size": BLOCK_SIZE, "acceptance": rates, "bars": bar_lines(rows),
                       "rows": rows}, f, indent=1)
    print(f"\n{where}; heads {heads.q} query / {heads.kv} kv of {heads.dim}, KV group {heads.group}, batch 1")
    if "attention" in parts:
        how = "CUDA graph replays" if device.type == "cuda" else "wall clock, torch references"
        print(f"\n## Attention, one layer (us: {how}, median)\n\n" + attention_table(rows))
        if args.plot:
            plot(rows, args.plot)
    if "memory" in parts:
        print(f"\n## KV memory ({heads.layers} layers, nbytes of the cache objects)\n\n" + memory_table(rows))
    if any(r["part"] == "steps" for r in rows):
        print(f"\n## Forward passes of the synthetic {SHAPE} (random weights), CUDA graph replays for every format "
              "alike\n\n" + steps_table(rows))
        print("\n## Predicted from step costs and acceptance a (not measured end to end; bold: the best gamma)\n\n"
              + prediction_table(rows))
    if any(r["part"] == "loop" for r in rows):
        print(f"\n## The real decoding loop, batch 1, from a filled cache (synthetic {SHAPE}, CUDA graphs; each "
              "round's accepted drafts replayed at acceptance a; bold: the best gamma)\n\n" + loop_table(rows))
    print("\n".join(["", *bar_lines(rows)]))


if __name__ == "__main__":
    try:
        main()
    except SelfspecError as e:
        raise SystemExit(f"error: {e}") from None
