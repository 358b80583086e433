"""`selfspec bench`: every GPU speed measurement in one run, written as JSON, a markdown report and PNG plots.

    selfspec bench all --shape llama-3-8b --out bench-results/   (synthetic weights, labelled so everywhere)
    selfspec bench all --parts gemm prefill --out bench-results/   (some parts; the others already in
                                                                  results.json stay, so one report can be filled
                                                                  over several calls of a time-limited machine)

Parts: `steps` (AR tokens/s per mode at batch 1/8/16/32 with a 1k-token context, the weight bandwidth each reaches
against the device's measured copy bandwidth, draft / verify / AR step times), `spec` (speculative tokens/s with
acceptance replayed from traces recorded on real models), `draft-peer` (the self-drafts against recipe draft-model,
Qwen2.5-Coder-0.5B drafting for the 1.5B, at the pair's shapes), `peer` (HF transformers), `gemm` (per-layer GEMM
time vs M up to 4096 against cuBLAS), `prefill` (tokens/s against a cuBLAS + SDPA peer and HF), `serve` (the serving
benchmark at batch 1/8/16/32/64 with 512-token prompts: throughput, TTFT and ITL, AR vs speculative per recipe, and
the step-cost bound of each run).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.bench import gemm, peer, prefill, serve, spec, steps
from selfspec.bench.device import copy_bandwidth
from selfspec.bench.traces import load
from selfspec.engine.engine import DEFAULT_DECODE_STEPS, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_WAIT
from selfspec.errors import SelfspecError

PARTS = ("steps", "spec", "draft-peer", "peer", "gemm", "prefill", "serve")


def ar_table(rows: list[dict], copy_gb_s: float) -> str:
    batches = sorted({r["batch"] for r in rows if r["kind"] == "ar"})
    out = ["| storage | mode | " + " | ".join(f"B={b} tok/s" for b in batches) + " | B=1 ms/step | weights read "
           "| of copy bandwidth |", "|---|---|" + "---|" * (len(batches) + 3)]
    for storage, mode in dict.fromkeys((r["storage"], r["mode"]) for r in rows if r["kind"] == "ar"):
        ar = {r["batch"]: r for r in rows if r["kind"] == "ar" and r["mode"] == mode and r["storage"] == storage}
        one = ar[batches[0]]
        gb_s = one["weight_bytes"] / one["ms"] / 1e6
        out.append(f"| {storage} | {mode} | " + " | ".join(f"{ar[b]['tokens_per_s']:.0f}" for b in batches)
                   + f" | {one['ms']:.2f} | {one['weight_bytes'] / 1e9:.2f} GB | {100 * gb_s / copy_gb_s:.0f}% |")
    return "\n".join(out)


def plot(results: dict, traces: list, out: Path, title: str) -> list[Path]:
    """One PNG per figure of the parts in `results`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    if "steps" in results:
        rows = results["steps"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode in dict.fromkeys(r["mode"] for r in rows if r["kind"] == "ar"):
            ar = sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["kind"] == "ar" and r["mode"] == mode)
            ax.plot(*zip(*ar), marker="o", label=mode)
        ax.set(xlabel="batch", ylabel="tokens/s (AR, CUDA graphs)", title=f"{title}: tokens/s vs batch",
               xscale="log", yscale="log")
        ax.legend(fontsize=8)
        figures.append((fig, "tokens_per_s_vs_batch.png"))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        b1 = min(r["batch"] for r in rows if r["kind"] == "pass")
        for mode in dict.fromkeys(r["mode"] for r in rows if r["kind"] == "pass"):
            ms = sorted((r["tokens"], r["ms"]) for r in rows
                        if r["kind"] == "pass" and r["mode"] == mode and r["batch"] == b1)
            ax.plot(*zip(*ms), marker="o", label=mode)
        ax.set(xlabel="tokens per pass (1 = AR / draft step, k+1 = verify)", ylabel="ms",
               title=f"{title}: step time vs tokens (batch {b1})")
        ax.legend(fontsize=8)
        figures.append((fig, "step_time_vs_tokens.png"))
    if "spec" in results and traces:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for t in traces:
            for task, rounds in t.tasks.items():
                ks = range(1, t.gamma + 1)
                ax.plot(ks, [sum(r.cut(k).accepted for r in rounds) / max(1, sum(r.cut(k).proposed for r in rounds))
                             for k in ks], marker="o", label=f"{t.recipe} ({t.draft}->{t.verify}) {t.label(task)}")
        ax.set(xlabel="gamma (drafted tokens per round)", ylabel="acceptance rate", ylim=(0, 1),
               title="acceptance vs gamma (recorded traces)")
        ax.legend(fontsize=7)
        figures.append((fig, "acceptance_vs_gamma.png"))
    if "draft-peer" in results:
        figures.append((peer_figure(results["draft-peer"], plt), "self_drafts_vs_draft_model.png"))
    if "gemm" in results:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        name = "gate/up"
        rows = [r for r in results["gemm"] if r["gemm"] == name]
        for mode in dict.fromkeys(gemm.row_name(r) for r in rows):
            t = sorted((r["m"], 1000 * r["ms"]) for r in rows if gemm.row_name(r) == mode)
            ax.plot(*zip(*t), marker="o", label=mode)
        ax.set(xlabel="M (rows)", ylabel="us", title=f"{title}: {name} GEMM time vs M", xscale="log", yscale="log")
        ax.legend(fontsize=8)
        figures.append((fig, "gemm_time_vs_m.png"))
    if "serve" in results:
        figures.append((serve_figure(results["serve"]["rows"], title, plt), "serve_vs_batch.png"))
    paths = []
    for fig, name in figures:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def peer_figure(rows: list[dict], plt):
    """Tokens/s per task, a bar per recipe (the draft-model peer among them), each recipe's AR a dashed line."""
    import numpy as np

    def task(r: dict) -> str:  # the trace label's task: "model/task (draft, ...)"
        return r["trace"].split("/")[1].split(" ")[0]

    def recipe(r: dict) -> str:
        return f"{r['recipe']} ({r['draft']})"

    tasks = list(dict.fromkeys(map(task, rows)))
    recipes = list(dict.fromkeys(map(recipe, rows)))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(recipes)
    for i, name in enumerate(recipes):
        got = {task(r): r["tokens_per_s"] for r in rows if recipe(r) == name}
        ax.bar(np.arange(len(tasks)) + i * width, [got.get(t, 0) for t in tasks], width, label=name)
    ar = sum(r["ar_tokens_per_s"] for r in rows) / len(rows)
    ax.axhline(ar, color="gray", linestyle="--", label=f"AR of the verify mode ({ar:.0f})")
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks)
    ax.set(ylabel="tokens/s (batch 1, CUDA graphs)",
           title=f"self-drafts vs a draft model ({rows[0]['shape']}, synthetic weights, acceptance replayed)")
    ax.legend(fontsize=8)
    return fig


def serve_figure(rows: list[dict], title: str, plt):
    """Serving tokens/s (AR solid, speculative dashed, per recipe) and TTFT p99 against the batch size."""
    fig, (ax, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["batch"])
        batches = [r["batch"] for r in mine]
        for side, style in (("ar", "-"), ("spec", "--")):
            ax.plot(batches, [r[side]["tokens_per_s"] for r in mine], style, marker="o", label=f"{recipe} {side}")
            ax_ttft.plot(batches, [r[side]["ttft_s"]["p99"] for r in mine], style, marker="o",
                         label=f"{recipe} {side}")
        ax.plot(batches, [r["ar"]["step_bound_tokens_per_s"] for r in mine], ":", label=f"{recipe} AR step-cost bound")
    ax.set(ylabel="tokens/s", title=f"{title}: serving")
    ax_ttft.set(ylabel="TTFT p99 (s)", title="time to first token")
    batches = sorted({r["batch"] for r in rows})
    for a in (ax, ax_ttft):
        a.set(xlabel="batch (requests in flight)", xscale="log")
        a.set_xticks(batches, [str(b) for b in batches])
        a.minorticks_off()
        a.legend(fontsize=7)
    return fig


def serve_args(shape: str, batch_sizes: list[int], recipes: list[str], requests_per_row: int) -> argparse.Namespace:
    """`selfspec bench serve` on the synthetic `shape` with 512-token prompts and 128 new tokens, each batch size
    serving max(8, requests_per_row x batch) requests, the engine's defaults."""
    p = argparse.ArgumentParser()
    serve.add_args(p)
    args = p.parse_args(["--shape", shape, "--device", "cuda", "--prompt-tokens", "512", "--max-new-tokens", "128",
                         "--requests", str(requests_per_row * max(batch_sizes)), "--requests-per-row",
                         str(requests_per_row), "--batch-sizes", *map(str, batch_sizes), "--recipes", *recipes,
                         "--no-check"])
    args.prefill_chunk, args.prefill_wait, args.decode_steps = (DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_WAIT,
                                                                 DEFAULT_DECODE_STEPS)
    return args


def measure(part: str, args: argparse.Namespace) -> list[dict] | dict:
    """One part's results (PARTS)."""
    if part == "steps":
        return steps.measure(args.shape, args.batch, args.context, args.verify_tokens, list(steps.STORAGE_MODES))
    if part == "spec":
        return spec.measure(args.shape, args.trace, args.gamma, args.context)
    if part == "draft-peer":
        return spec.measure(spec.PEER_SHAPE, spec.PEER_TRACES, [5], args.context, spec.PEER_DRAFT_SHAPE)
    if part == "peer":
        return peer.measure(args.shape, args.context, 64, args.peer_compile)
    if part == "gemm":
        return gemm.measure(args.shape, args.gemm_m)
    if part == "prefill":
        return prefill.measure(args.shape, args.prefill_sizes, ["bf16", "full", "w4a16"], hf=True)
    return serve.measure(serve_args(args.shape, args.serve_batch_sizes, args.serve_recipes,
                                    args.serve_requests_per_row))


def report(results: dict, title: str) -> str:
    """The markdown report of the parts in `results`, each headed with the device it ran on."""
    copy = results["copy_gb_per_s"]
    where = results.get("part_devices", {})
    sections = {
        "steps": lambda r: (f"## AR decoding\n\n{ar_table(r, copy)}\n\n## Pass time vs tokens\n\n"
                            f"{steps.verify_table(r)}"),
        "spec": lambda r: f"## Speculative decoding (acceptance replayed from traces)\n\n{spec.markdown(r)}",
        "draft-peer": lambda r: (f"## Self-drafts against a draft model ({spec.PEER_SHAPE} verifying, "
                                 f"{spec.PEER_DRAFT_SHAPE} drafting)\n\n{spec.means(r)}\n\n{spec.markdown(r)}"),
        "peer": lambda r: "## Peer (batch 1)\n\n" + "\n".join(f"- {p['peer']}: {p['tokens_per_s']:.1f} tok/s"
                                                                 for p in r),
        "gemm": lambda r: f"## GEMM time vs M\n\n{gemm.table(r, copy)}",
        "prefill": lambda r: f"## Prefill (from position 0, last-position logits)\n\n{prefill.table(r)}",
        "serve": lambda r: f"## Serving (closed loop, 512-token prompts)\n\n{serve.report(r)}",
    }
    body = [f"{sections[p](results[p])}\n\n({where[p]})" if p in where else sections[p](results[p])
            for p in PARTS if p in results]
    return (f"# selfspec bench: {title}, context {results['context']}, CUDA graphs\n\n"
            f"Weights are synthetic (randn * 0.02). Copy bandwidth {copy:.0f} GB/s.\n\n" + "\n\n".join(body) + "\n")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                    help="what to measure (default: all); results.json in --out keeps the other parts it holds")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--verify-tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--gemm-m", type=int, nargs="+", default=[1, 4, 16, 32, 64, 160, 256, 1024, 4096])
    ap.add_argument("--gamma", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--prefill-sizes", type=prefill.size, nargs="+", default=[(1, 512), (1, 2048), (1, 8192), (8, 512)])
    ap.add_argument("--trace", type=Path, nargs="+", default=spec.replayable_traces(),
                    help="default: every replayable trace in selfspec/bench/traces")
    ap.add_argument("--peer-compile", action="store_true", help="also HF with static cache + torch.compile")
    ap.add_argument("--serve-batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--serve-recipes", nargs="+", default=["planes", "qspec"])
    ap.add_argument("--serve-requests-per-row", type=int, default=2, metavar="R",
                    help="each serving batch size B serves max(8, R x B) requests")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    if results.get("shape", args.shape) != args.shape or results.get("context", args.context) != args.context:
        raise SelfspecError(f"{saved} holds {results['shape']} at context {results['context']}, not {args.shape} at "
                            f"{args.context}: give another --out")
    device = torch.cuda.get_device_name()
    title = f"{device}, {args.shape} (synthetic)"
    copy = copy_bandwidth()
    print(f"{device}: copy bandwidth {copy:.0f} GB/s (read + write)", flush=True)
    results |= {"device": device, "shape": args.shape, "synthetic": True, "context": args.context,
                "copy_gb_per_s": copy}
    for part in args.parts:
        results[part] = measure(part, args)
        results.setdefault("part_devices", {})[part] = device
        saved.write_text(json.dumps(results, indent=1))  # a part at a time: a run cut short keeps what it measured
    text = report(results, title)
    (args.out / "results.md").write_text(text)
    plot(results, [load(p) for p in args.trace] if "spec" in results else [], args.out, title)
    print(text)


if __name__ == "__main__":
    main()
