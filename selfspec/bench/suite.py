"""`selfspec bench`: every GPU speed measurement in one run, written as JSON, a markdown report and PNG plots.

    selfspec bench all --shape llama-3-8b --out bench-results/   (synthetic weights, labelled so everywhere)

AR tokens/s per mode at batch 1/8/16/32 with a 1k-token context, the weight bandwidth each reaches against the
device's measured copy bandwidth, per-layer GEMM time vs M, draft / verify / AR step times, speculative
tokens/s with acceptance replayed from traces recorded on real models, HF transformers as the peer, and prefill
tokens/s against a cuBLAS + SDPA peer.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.bench import gemm, peer, prefill, spec, steps
from selfspec.bench.device import copy_bandwidth
from selfspec.bench.traces import load


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


def plot(step_rows: list[dict], gemm_rows: list[dict], traces: list[dict], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in step_rows if r["kind"] == "ar"):
        ar = sorted((r["batch"], r["tokens_per_s"]) for r in step_rows if r["kind"] == "ar" and r["mode"] == mode)
        ax.plot(*zip(*ar), marker="o", label=mode)
    ax.set(xlabel="batch", ylabel="tokens/s (AR, CUDA graphs)", title=f"{title}: tokens/s vs batch", xscale="log",
           yscale="log")
    ax.legend(fontsize=8)
    paths.append(out / "tokens_per_s_vs_batch.png")

    fig2, ax2 = plt.subplots(figsize=(7, 4.5))
    b1 = min(r["batch"] for r in step_rows if r["kind"] == "pass")
    for mode in dict.fromkeys(r["mode"] for r in step_rows if r["kind"] == "pass"):
        ms = sorted((r["tokens"], r["ms"]) for r in step_rows
                    if r["kind"] == "pass" and r["mode"] == mode and r["batch"] == b1)
        ax2.plot(*zip(*ms), marker="o", label=mode)
    ax2.set(xlabel="tokens per pass (1 = AR / draft step, k+1 = verify)", ylabel="ms",
            title=f"{title}: step time vs tokens (batch {b1})")
    ax2.legend(fontsize=8)
    paths.append(out / "step_time_vs_tokens.png")

    fig3, ax3 = plt.subplots(figsize=(7, 4.5))
    for t in traces:
        for task, rounds in t.tasks.items():
            ks = range(1, t.gamma + 1)
            ax3.plot(ks, [sum(r.cut(k).accepted for r in rounds) / max(1, sum(r.cut(k).proposed for r in rounds))
                          for k in ks], marker="o", label=f"{t.recipe} ({t.draft}->{t.verify}) {t.label(task)}")
    ax3.set(xlabel="gamma (drafted tokens per round)", ylabel="acceptance rate", ylim=(0, 1),
            title="acceptance vs gamma (recorded traces)")
    ax3.legend(fontsize=7)
    paths.append(out / "acceptance_vs_gamma.png")

    fig4, ax4 = plt.subplots(figsize=(7, 4.5))
    name = "gate/up"
    for mode in dict.fromkeys(r["mode"] for r in gemm_rows):
        t = sorted((r["m"], 1000 * r["ms"]) for r in gemm_rows if r["mode"] == mode and r["gemm"] == name)
        ax4.plot(*zip(*t), marker="o", label=mode)
    ax4.set(xlabel="M (rows)", ylabel="us", title=f"{title}: {name} GEMM time vs M", xscale="log")
    ax4.legend(fontsize=8)
    paths.append(out / "gemm_time_vs_m.png")
    for f, p in zip((fig, fig2, fig3, fig4), paths):
        f.tight_layout()
        f.savefig(p, dpi=110)
    return paths


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--verify-tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--gemm-m", type=int, nargs="+", default=[1, 2, 4, 9, 16, 32, 64])
    ap.add_argument("--gamma", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--prefill-sizes", type=prefill.size, nargs="+", default=[(1, 512), (1, 2048), (1, 8192), (8, 512)])
    ap.add_argument("--trace", type=Path, nargs="+", default=spec.replayable_traces(),
                    help="default: every replayable trace in selfspec/bench/traces")
    ap.add_argument("--peer-compile", action="store_true", help="also HF with static cache + torch.compile")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    title = f"{device}, {args.shape} (synthetic)"
    copy = copy_bandwidth()
    print(f"{device}: copy bandwidth {copy:.0f} GB/s (read + write)", flush=True)
    results = {"device": device, "shape": args.shape, "synthetic": True, "context": args.context, "copy_gb_per_s": copy}
    results["steps"] = steps.measure(args.shape, args.batch, args.context, args.verify_tokens,
                                      list(steps.STORAGE_MODES))
    results["spec"] = spec.measure(args.shape, args.trace, args.gamma, args.context)
    results["peer"] = peer.measure(args.shape, args.context, 64, args.peer_compile)
    results["gemm"] = gemm.measure(args.shape, args.gemm_m)
    results["prefill"] = prefill.measure(args.shape, args.prefill_sizes, ["bf16", "full", "w4a16"], hf=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    peer_lines = "\n".join(f"- {r['peer']}: {r['tokens_per_s']:.1f} tok/s" for r in results["peer"])
    report = (f"# selfspec bench: {title}, context {args.context}, CUDA graphs\n\n"
              f"Weights are synthetic (randn * 0.02). Copy bandwidth {copy:.0f} GB/s.\n\n"
              f"## AR decoding\n\n{ar_table(results['steps'], copy)}\n\n## Pass time vs tokens\n\n"
              f"{steps.verify_table(results['steps'])}\n\n## Speculative decoding (acceptance replayed from traces)\n\n"
              f"{spec.markdown(results['spec'])}\n\n## Peer (batch 1)\n\n{peer_lines}\n\n## GEMM time vs M\n\n"
              f"{gemm.table(results['gemm'], copy)}\n\n## Prefill (from position 0, last-position logits)\n\n"
              f"{prefill.table(results['prefill'])}\n")
    (args.out / "results.md").write_text(report)
    plot(results["steps"], results["gemm"], [load(p) for p in args.trace], args.out, title)
    print(report)


if __name__ == "__main__":
    main()
