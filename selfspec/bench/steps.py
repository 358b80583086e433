"""Decode step costs under CUDA graphs: AR tokens/s per mode and batch, and draft / verify step times.

python -m selfspec.bench.steps [--shape llama-3-8b] [--context 1024] [--batch 1 8 16 32] [--tensor-parallel N]
                               [--profile]

With --tensor-parallel N, the same measurements on N GPUs (one process each, NCCL, the collectives captured in the
graphs), rank 0's timings reported. Each mode's AR step at the first batch size is also profiled there (alone with
--profile): the GPU time of its collectives' kernels a step against all its kernels', and its kernels by time
(`collectives` rows).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

import torch

from selfspec.bench.device import copy_bandwidth, time_ms
from selfspec.bench.shapes import SHAPES
from selfspec.bench.synthetic import synthetic_model
from selfspec.engine.graphs import GraphedModel
from selfspec.parallel import SOLO, TensorParallel, check_tensor_parallel
from selfspec.parallel.launch import on_ranks
from selfspec.quant.modes import MODES, Mode

# Each stored format and the modes measured from it.
STORAGE_MODES = {"dense": ["bf16"], "int8": ["w8a16", "w8a8"], "int4": ["w4a16", "w4a8", "w4a4"],
                 "int4g": ["w4a16", "w4a8", "w4a4"], "planes": ["upper", "full"]}


@torch.inference_mode()  # a graphed model's persistent cache may have been made under inference mode already
def filled_cache(model, batch: int, context: int, max_len: int):
    """A cache (of `model`, eager or graphed) whose first `context` positions hold random keys and values."""
    cache = model.new_cache(max_len, batch)
    cache.k.normal_()
    cache.v.normal_()
    cache.commit(context)
    return cache


def ar_steps(gm: GraphedModel, mode_name: str, batch: int, context: int, steps: int) -> Callable[[], None]:
    """`steps` greedy AR steps after `context` cached positions, each step's argmax feeding the next on the device
    (no host sync), their graphs captured before the first call."""
    mode = MODES[mode_name]
    cache = filled_cache(gm, batch, context, gm.max_len)
    dev = gm.device
    tok = torch.randint(0, gm.cfg.vocab_size, (batch, 1), device=dev)
    pos = torch.full((batch, 1), context, device=dev)
    gm(tok, pos, cache, mode)
    gm(tok, pos, cache, mode)

    def run() -> None:
        t = tok
        for i in range(steps):
            t = gm(t, pos + i, cache, mode)[:, -1:].argmax(-1)

    return run


def ar_ms_per_step(gm: GraphedModel, mode_name: str, batch: int, context: int, steps: int = 48) -> float:
    """Milliseconds per greedy AR step (ar_steps)."""
    return time_ms(ar_steps(gm, mode_name, batch, context, steps), warmup=1, reps=5) / steps


def pass_ms(gm: GraphedModel, mode: Mode | str, batch: int, tokens: int, context: int) -> float:
    """Milliseconds of one forward of `tokens` new tokens per row (a draft, verify or AR pass) in a mode or the
    mode of that name."""
    mode = MODES[mode] if isinstance(mode, str) else mode
    cache = filled_cache(gm, batch, context, gm.max_len)
    dev = gm.device
    tok = torch.randint(0, gm.cfg.vocab_size, (batch, tokens), device=dev)
    pos = context + torch.arange(tokens, device=dev).expand(batch, tokens)
    return time_ms(lambda: gm(tok, pos, cache, mode), warmup=3, reps=20)


# Kernels of the tensor-parallel collectives: NCCL's, and PyTorch symmetric memory's all-reduce.
COLLECTIVE_KERNELS = ("nccl", "all_reduce")


TOP_KERNELS = 8  # the profile's kernels by GPU time a step


def kernel_profile(kernels: list[tuple[str, float]], steps: int) -> dict:
    """From the GPU kernels (name, microseconds) of `steps` profiled steps: per step, the collectives' kernels (how
    many, their ms), all kernels' ms, and the TOP_KERNELS kernels by time (name, launches and ms a step: what TP 1
    and TP 2 spend differently). A collective's time holds its wait for the slower rank."""
    ours = [us for name, us in kernels if any(k in name.lower() for k in COLLECTIVE_KERNELS)]
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {"collectives": len(ours) / steps, "collective_ms": sum(ours) / 1e3 / steps,
            "kernel_ms": sum(us for _, us in kernels) / 1e3 / steps,
            "top_kernels": [{"name": name, "per_step": len(us) / steps, "ms": sum(us) / 1e3 / steps}
                            for name, us in top]}


def profiled_step(gm: GraphedModel, mode_name: str, batch: int, context: int, steps: int = 8) -> dict:
    """kernel_profile of greedy AR steps (ar_steps) under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run = ar_steps(gm, mode_name, batch, context, steps)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return kernel_profile(kernels, steps)


def weight_bytes_read(model, mode_name: str) -> int:
    """Bytes one decode step reads from the weights in a mode: every linear's stored tensors (`upper` skips
    the lower planes) and the head; the embedding lookup reads a row per token (not counted)."""
    mode = MODES[mode_name]
    return model.lm_head.nbytes() + sum(lin.weight.nbytes_read(mode) for lin in model.linears())


def measure(shape: str, batches: list[int], context: int, verify_tokens: list[int], storages: list[str],
            draft_vocab: int = 0, profile: bool = False, tp: TensorParallel = SOLO) -> list[dict]:
    """Every row on this process's GPU; under tensor parallelism (`tp`), of this rank's shard (every rank runs the
    same passes: they meet in each pass's collectives). With `draft_vocab` N, also each mode's 1-token pass at the
    first batch size with its head over N tokens (mode "MODE vN"), as a draft step with a draft vocabulary runs.
    With `profile` (always under tensor parallelism), each mode's AR step at the first batch size profiled
    (`kernel_profile`)."""
    rows = []
    log = print if tp.rank == 0 else lambda *a, **k: None
    for storage in storages:
        modes = STORAGE_MODES[storage]
        model = synthetic_model(shape, storage, tp=tp)
        if draft_vocab:  # synthetic weights: which tokens' rows the draft head holds does not change its cost
            model.set_draft_vocab(list(range(draft_vocab)))
        gm = GraphedModel(model, max_len=context + 64)
        for mode in modes:
            for b in batches:
                ms = ar_ms_per_step(gm, mode, b, context)
                rows.append({"kind": "ar", "storage": storage, "mode": mode, "batch": b, "tokens": 1, "ms": ms,
                             "tokens_per_s": b * 1000 / ms, "weight_bytes": weight_bytes_read(model, mode)})
                log(f"{storage:7s} {mode:6s} B={b:3d} AR {ms:7.3f} ms/step  {b * 1000 / ms:8.1f} tok/s", flush=True)
            if profile or tp.size > 1:
                c = profiled_step(gm, mode, batches[0], context)
                rows.append({"kind": "collectives", "storage": storage, "mode": mode, "batch": batches[0], **c})
                log(f"{storage:7s} {mode:6s} B={batches[0]:3d} collectives: {c['collectives']:.0f} a step, "
                    f"{c['collective_ms']:.3f} ms of {c['kernel_ms']:.3f} ms of kernels", flush=True)
                for k in c["top_kernels"]:
                    log(f"    {k['ms']:7.3f} ms {k['per_step']:5.0f}x  {k['name'][:100]}", flush=True)
            for b in batches[:1] + batches[-1:]:
                for t in verify_tokens:
                    rows.append({"kind": "pass", "storage": storage, "mode": mode, "batch": b, "tokens": t,
                                 "ms": pass_ms(gm, mode, b, t, context)})
            if draft_vocab:
                rows.append({"kind": "pass", "storage": storage, "mode": f"{mode} v{draft_vocab}", "batch": batches[0],
                             "tokens": 1, "ms": pass_ms(gm, replace(MODES[mode], draft_vocab=True), batches[0], 1,
                                                        context)})
        del gm, model
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--verify-tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--storages", nargs="+", default=list(STORAGE_MODES), choices=list(STORAGE_MODES),
                    help="stored formats to measure (each its modes)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="also time each mode's 1-token pass with its head over N tokens (a draft vocabulary)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split the model across N GPUs")
    ap.add_argument("--profile", action="store_true",
                    help="profile each mode's AR step at the first batch size: its kernels by GPU time (always "
                         "under --tensor-parallel)")
    args = ap.parse_args(argv)
    n = args.tensor_parallel
    measured = (args.shape, args.batch, args.context, args.verify_tokens, args.storages, args.draft_vocab,
                args.profile)
    if n > 1:
        check_tensor_parallel(SHAPES[args.shape], n, 128)
    rows = on_ranks(measure, n, *measured)
    bandwidth = copy_bandwidth() * 1e9  # bytes/s, read + write counted (DESIGN.md's roofline)
    for r in rows:  # AR steps against reading this GPU's weights once at the measured copy bandwidth
        if r["kind"] == "ar":
            r["of_weight_bound"] = r["weight_bytes"] / bandwidth / (r["ms"] / 1e3)
            print(f"{r['storage']:7s} {r['mode']:6s} B={r['batch']:3d} {r['weight_bytes'] / 1e9:6.1f} GB of weights "
                  f"per GPU: {r['of_weight_bound']:.2f} of the copy-bandwidth bound ({bandwidth / 1e12:.2f} TB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "synthetic": True,
                       "context": args.context, "tensor_parallel": n, "copy_bandwidth": bandwidth, "rows": rows},
                      f, indent=1)
    how = "CUDA graphs" if n == 1 else f"CUDA graphs, tensor parallel {n}"
    print(f"\n{torch.cuda.get_device_name()}, {args.shape} (synthetic weights), context {args.context}, {how}")
    print(verify_table(rows))


def verify_table(rows: list[dict]) -> str:
    """Markdown: a pass of T tokens per row, in ms and as a multiple of the 1-token step, per mode and batch (what
    a verify pass of gamma + 1 tokens costs against the AR step it replaces)."""
    passes = [r for r in rows if r["kind"] == "pass"]
    batches, tokens = sorted({r["batch"] for r in passes}), sorted({r["tokens"] for r in passes})
    lines = ["| storage | mode | batch | " + " | ".join(f"T={t} ms (x T=1)" for t in tokens) + " |",
             "|---|---|---|" + "---|" * len(tokens)]
    for s, m in dict.fromkeys((r["storage"], r["mode"]) for r in rows):
        for b in batches:
            ms = {r["tokens"]: r["ms"] for r in rows
                  if r["kind"] == "pass" and (r["storage"], r["mode"], r["batch"]) == (s, m, b)}
            if ms:
                one = ms.get(1)
                cells = [f"{ms[t]:.3f}" + (f" ({ms[t] / one:.2f})" if one else "") for t in tokens if t in ms]
                lines.append(f"| {s} | {m} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
