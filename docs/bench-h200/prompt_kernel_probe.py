"""Prompt tokens of the INT4 nibbles through the nibble kernel (K as one chain) against the dequantize pass and the
bf16 GEMM, in one process (session 30): per layer GEMM of an 8B model, the GPU time under a CUDA graph, the eager
time (events around the call: launch gaps included) and the host's time to issue one call; then a whole prefill
from position 0 in eager mode (selfspec.bench.prefill's `our_prefill`, w4a16 on `int4`).

python docs/bench-h200/prompt_kernel_probe.py [--m 512 2048] [--sizes 1x512 1x2048 8x512]
"""
from __future__ import annotations

import argparse
import time

import torch

import selfspec.kernels.triton_linear as tlin
from selfspec.bench.device import copies_past_l2, graph_time_ms, time_ms
from selfspec.bench.prefill import our_prefill, size
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.bench.synthetic import synthetic_model
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES, prompt_mode

KERNEL = tlin.takes_prompt_kernel
PATHS = {"dequantize": lambda weight, fmt, x2: False, "kernel": KERNEL}


def host_ms(fn, calls: int = 50) -> float:
    """The host's milliseconds to issue one call (the GPU left to catch up after)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--sizes", type=size, nargs="+", default=[(1, 512), (1, 2048), (8, 512)])
    p.add_argument("--profile", action="store_true", help="the first size's prefill under torch.profiler, each path")
    args = p.parse_args()
    mode = prompt_mode(MODES["w4a16"])
    print("| gemm | M | path | graph us | eager us | host us a call |\n|---|---|---|---|---|---|")
    for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
        weights = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int4", 128)
                   for _ in range(copies_past_l2(n * k // 2))]
        for m in args.m:
            x = torch.randn(m, k, device="cuda").bfloat16()
            for path, rule in PATHS.items():
                tlin.takes_prompt_kernel = rule
                graph = graph_time_ms([lambda w=w: linear(x, w, mode) for w in weights])
                eager = time_ms(lambda: linear(x, weights[0], mode), warmup=3, reps=20)
                host = host_ms(lambda: linear(x, weights[0], mode))
                print(f"| {name} | {m} | {path} | {graph * 1e3:.1f} | {eager * 1e3:.1f} | {host * 1e3:.1f} |",
                      flush=True)
    tlin.takes_prompt_kernel = KERNEL
    model = synthetic_model("llama-3-8b", "int4")
    print("\n| B x T | path | prefill ms | tok/s |\n|---|---|---|---|")
    for b, t in args.sizes:
        tokens = torch.randint(0, model.cfg.vocab_size, (b, t), device="cuda")
        for path, rule in PATHS.items():
            tlin.takes_prompt_kernel = rule
            with torch.inference_mode():
                ms = time_ms(lambda: our_prefill(model, tokens, "w4a16"), warmup=2, reps=5)
            print(f"| {b} x {t} | {path} | {ms:.1f} | {b * t / ms * 1e3:,.0f} |", flush=True)
    if args.profile:
        b, t = args.sizes[0]
        tokens = torch.randint(0, model.cfg.vocab_size, (b, t), device="cuda")
        for path, rule in PATHS.items():
            tlin.takes_prompt_kernel = rule
            with torch.inference_mode():
                our_prefill(model, tokens, "w4a16")
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    our_prefill(model, tokens, "w4a16")
                    torch.cuda.synchronize()
            print(f"\n{b} x {t}, {path}:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    tlin.takes_prompt_kernel = KERNEL


if __name__ == "__main__":
    main()
