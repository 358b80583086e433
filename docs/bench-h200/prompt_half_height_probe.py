"""Prompt tokens of w4a16 / `upper` at 256 rows with K as one chain (session 31): 64-row CTAs (the rule) against
128-row ones, per 8B GEMM, graph time.

python docs/bench-h200/prompt_half_height_probe.py
"""
from __future__ import annotations

import torch

import selfspec.kernels.gluon_linear as glin
from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES, prompt_mode

RULE = glin.nibble_block_m


def main() -> None:
    print("| gemm | mode | M | 64-row rule us | 128 rows us |\n|---|---|---|---|---|")
    for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
        for mode_name, storage in (("w4a16", "int4"), ("upper", "planes")):
            mode = prompt_mode(MODES[mode_name])
            weights = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, storage, 128)
                       for _ in range(copies_past_l2(n * k // 2))]
            for m in (256, 512):
                x = torch.randn(m, k, device="cuda").bfloat16()
                times = []
                for rule in (RULE, lambda *a: glin.BLOCK_M):
                    glin.nibble_block_m = rule
                    times.append(graph_time_ms([lambda w=w: linear(x, w, mode) for w in weights]) * 1e3)
                glin.nibble_block_m = RULE
                print(f"| {name} | {mode_name} | {m} | {times[0]:.1f} | {times[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
