"""Per-layer GEMM time vs M for every mode, on the GPU: our op table vs cuBLAS BF16 (and torch._int_mm, cuBLAS's
int8 GEMM, for the int8-activation modes), and the bandwidth reached. "(prompt)" rows: the same weights read as
prompt tokens read them (Mode.prompt: K as one chain), past 16 rows. Each GEMM gets x as the model hands it, with
what comes with it (kernels.Handover, from the norm or swiglu that wrote x, not timed here): with int8 activations
x's codes and their row sums, which spare the GEMM its act_quant; with bf16 activations x quartered where the GEMM
would quarter it (`kernels.handover_request`: the nibble kernels' prompt tokens, and generated ones from 129 rows, 65
for w8a16), as the norm and swiglu write it. Not o's: attention writes neither.

python -m selfspec.bench.gemm [--shape llama-3-8b] [--m 1 16 64 256 1024 4096]
"""
from __future__ import annotations

import argparse
import json

import torch

from selfspec.bench.device import copies_past_l2, copy_bandwidth, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import Handover, handover_request, linear, rms_norm_handover
from selfspec.quant.formats import QuantWeight, quantize_weight, storage_supports
from selfspec.quant.modes import MODES, Mode, prompt_mode

# (storage, mode) pairs measured: each mode from the cheapest storage that runs it, plus the plane views and the
# INT4 codes of integer group scales (their int8-activation GEMMs exact in int32 over all of K).
PAIRS = [("dense", "bf16"), ("int8", "w8a16"), ("int8", "w8a8"), ("int4", "w4a16"), ("int4", "w4a8"),
         ("int4", "w4a4"), ("planes", "upper"), ("planes", "full"), ("int4g", "w4a16"), ("int4g", "w4a8"),
         ("int4g", "w4a4")]
FIRST_STORAGE = {m: s for s, m in reversed(PAIRS)}  # a mode's row is named by the mode alone on this storage


def handed_over(gemm: str, x: torch.Tensor, weight: QuantWeight, mode: Mode) -> tuple[torch.Tensor, Handover | None]:
    """x as the model's block hands it to this GEMM, and what comes with it: x through the device's norm (unit
    weight), which does for the GEMM what its `handover_request` asks of the op writing x, as the model's norms and
    swiglu do (model.py): with int8 activations x's codes and their row sums, with bf16 activations x quartered
    where the GEMM would quarter it. Attention hands o nothing: a token's scale needs all its heads, so o quantizes
    (and quarters) its input itself."""
    if gemm == "o":
        return x, None
    request = handover_request(weight, mode, x.shape[0], x.device)
    return rms_norm_handover(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 1e-6, request)


def measure(shape: str, ms: list[int], group_size: int = 128, modes: list[str] | None = None) -> list[dict]:
    """One row per (layer GEMM, storage, mode, M): time under CUDA graphs and GB/s of the weight bytes read, for
    `modes` (default: every pair's) and cuBLAS. Each timing cycles through enough distinct weights (>= 150 MB) that
    they stream from HBM, not L2."""
    rows = []
    for name, n, k in layer_gemms(SHAPES[shape]):
        ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies_past_l2(2 * n * k))]
        xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in ms}
        for storage, mode_name in (p for p in PAIRS if modes is None or p[1] in modes):
            mode = MODES[mode_name]
            assert storage_supports(storage, mode)
            weights = [quantize_weight(w.bfloat16() if storage == "dense" else w, storage, group_size) for w in ws]
            nbytes = weights[0].nbytes_read(mode)
            for m in ms:
                x, given = handed_over(name, xs[m], weights[0], mode)
                t = graph_time_ms([lambda w=w, x=x: linear(x, w, mode, handover=given) for w in weights])
                rows.append({"gemm": name, "n": n, "k": k, "storage": storage, "mode": mode_name, "m": m,
                             "ms": t, "gb_per_s": nbytes / t / 1e6})
            if storage != "dense" and mode.act_bits is None:  # prompt tokens: their own kernels' paths
                prompt = prompt_mode(mode)
                for m in (m for m in ms if m > 16):
                    x, given = handed_over(name, xs[m], weights[0], prompt)
                    t = graph_time_ms([lambda w=w, x=x: linear(x, w, prompt, handover=given) for w in weights])
                    rows.append({"gemm": name, "n": n, "k": k, "storage": storage, "mode": f"{mode_name} (prompt)",
                                 "m": m, "ms": t, "gb_per_s": nbytes / t / 1e6})
            del weights
        dense = [w.bfloat16() for w in ws]
        for m in ms:
            t = graph_time_ms([lambda w=w, m=m: torch.nn.functional.linear(xs[m], w) for w in dense])
            rows.append({"gemm": name, "n": n, "k": k, "storage": "dense", "mode": "cublas-bf16", "m": m,
                         "ms": t, "gb_per_s": dense[0].nbytes / t / 1e6})
        codes = [(w * 1000).clamp(-127, 127).to(torch.int8).t() for w in ws]  # [K, N] column-major, as _int_mm wants
        for m in ms:
            if m <= 16:
                continue  # torch._int_mm takes M > 16 only
            xq = xs[m].to(torch.int8)
            try:
                t = graph_time_ms([lambda w=w: torch._int_mm(xq, w) for w in codes])
            except RuntimeError as e:  # a torch build without this int8 GEMM: the other rows still stand
                print(f"torch._int_mm at M={m}: {e}")
                continue
            rows.append({"gemm": name, "n": n, "k": k, "storage": "int8", "mode": "cublas-int8", "m": m,
                         "ms": t, "gb_per_s": codes[0].nbytes / t / 1e6})
        del ws, dense, codes
    return rows


def row_name(row: dict) -> str:
    """A row's mode as tables and plots name it: with its storage where that is not the mode's first (PAIRS)."""
    mode, storage = row["mode"], row["storage"]
    return mode if FIRST_STORAGE.get(mode.split(" (")[0], storage) == storage else f"{mode} [{storage}]"


def table(rows: list[dict], copy_gb_s: float) -> str:
    """Microseconds per GEMM, each with its ratio to cuBLAS BF16 at the same shape and M."""
    ms = sorted({r["m"] for r in rows})
    out = ["| gemm | mode | " + " | ".join(f"M={m} us (x cuBLAS)" for m in ms) + " | BW@M=1 (of copy) |",
           "|---|---|" + "---|" * (len(ms) + 1)]
    keys = list(dict.fromkeys((r["gemm"], row_name(r)) for r in rows))
    for g, name in keys:
        sel = {r["m"]: r for r in rows if (r["gemm"], row_name(r)) == (g, name)}
        cublas = {r["m"]: r["ms"] for r in rows if r["gemm"] == g and r["mode"] == "cublas-bf16"}
        cells = [f"{1000 * sel[m]['ms']:.1f} ({sel[m]['ms'] / cublas[m]:.2f})" if m in sel else "-" for m in ms]
        first = sel.get(ms[0])
        bw = f"{first['gb_per_s']:.0f} GB/s ({100 * first['gb_per_s'] / copy_gb_s:.0f}%)" if first else "-"
        out.append(f"| {g} | {name} | " + " | ".join(cells) + f" | {bw} |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b", choices=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--modes", nargs="+", default=None, choices=[m for _, m in PAIRS],
                    help="only these modes (and cuBLAS); default all")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    copy = copy_bandwidth()
    rows = measure(args.shape, args.m, modes=args.modes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gb_per_s": copy, "synthetic": True,
                       "rows": rows}, f, indent=1)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (read + write); synthetic weights randn * 0.02")
    print(table(rows, copy))


if __name__ == "__main__":
    main()
