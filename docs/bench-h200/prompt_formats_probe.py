"""Prompt tokens of `full`, w8a16 and `int4g`'s w4a16 (session 31's lead), three ways: the nibble kernel with K as one
chain; the same sums from the quartered scratch (the bf16 GEMM, K as one chain); the plain dequantize pass and bf16
GEMM they replace. Graph time per 8B GEMM and row count beside cuBLAS BF16 (the issue's bar: 1.4x): where the
scratch overtakes the kernel is triton_linear.PROMPT_SCRATCH_ROWS.

python docs/bench-h200/prompt_formats_probe.py [--m 256 512 1024 2048 4096]
"""
from __future__ import annotations

import argparse

import torch

import selfspec.kernels.triton_linear as tlin
from selfspec.kernels import linear_tiles as tiles
from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES, prompt_mode

KERNEL, ROWS = tlin.takes_prompt_kernel, tlin.PROMPT_SCRATCH_ROWS
NEVER = {tiles.FULL.value: 1 << 62, tiles.INT8.value: 1 << 62, tiles.INT4G.value: 1 << 62}
ALWAYS = dict.fromkeys(NEVER, 0)
PATHS = {"kernel": (KERNEL, NEVER), "scratch": (KERNEL, ALWAYS), "dequantize": (lambda weight, fmt, x2: False, NEVER)}
CASES = [("full", "planes", 1), ("w8a16", "int8", 1), ("w4a16", "int4g", 2)]  # mode, storage, bytes / 2 a weight


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    args = p.parse_args()
    print("| gemm | mode | M | kernel us | scratch us | dequantize us | cuBLAS us | kernel / scratch | "
          "kernel / dequantize | kernel / cuBLAS |\n|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
        dense = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies_past_l2(2 * n * k))]
        xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in args.m}
        cublas = {m: graph_time_ms([lambda w=w, m=m: torch.nn.functional.linear(xs[m], w) for w in dense]) * 1e3
                  for m in args.m}
        del dense
        for mode_name, storage, per in CASES:
            mode = prompt_mode(MODES[mode_name])
            weights = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, storage, 128)
                       for _ in range(copies_past_l2(n * k // per))]
            for m in args.m:
                x, times = xs[m], {}
                for path, (rule, scratch_rows) in PATHS.items():
                    tlin.takes_prompt_kernel, tlin.PROMPT_SCRATCH_ROWS = rule, scratch_rows
                    times[path] = graph_time_ms([lambda w=w: linear(x, w, mode) for w in weights]) * 1e3
                tlin.takes_prompt_kernel, tlin.PROMPT_SCRATCH_ROWS = KERNEL, ROWS
                t = times["kernel"]
                print(f"| {name} | {mode_name} [{storage}] | {m} | {t:.1f} | {times['scratch']:.1f} | "
                      f"{times['dequantize']:.1f} | {cublas[m]:.1f} | {t / times['scratch']:.2f} | "
                      f"{t / times['dequantize']:.2f} | {t / cublas[m]:.2f} |", flush=True)
            del weights


if __name__ == "__main__":
    main()
