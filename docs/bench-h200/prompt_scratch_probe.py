"""Where the quartered scratch's time goes on prompt tokens from 2,048 rows (session 32): the plain dequantize pass and
bf16 GEMM against the scratch's (dequantize quartered, x quartered, the bf16 GEMM with K as one chain), whole and
piece by piece, each timed twice in alternating order; and the scratch's GEMM with 128-column K tiles (same bits?).

python docs/bench-h200/prompt_scratch_probe.py [--m 2048 4096]
"""
from __future__ import annotations

import argparse

import torch

import selfspec.kernels.gluon_linear as glin
import selfspec.kernels.triton_linear as tlin
from selfspec.kernels import linear_tiles as tiles
from selfspec.bench.device import graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES, prompt_mode

CASES = [("full", "planes"), ("w8a16", "int8"), ("w4a16", "int4g")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[2048, 4096])
    args = p.parse_args()
    kernel, rows = tlin.takes_prompt_kernel, dict(tlin.PROMPT_SCRATCH_ROWS)
    for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
        for mode_name, storage in CASES:
            mode = prompt_mode(MODES[mode_name])
            weight = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, storage, 128)
            fmt = tlin.kernel_format(weight, MODES[mode_name])
            block_k = tlin.dequantize_block_k(fmt, 128)
            plain = tlin.dequantize(weight, fmt).clone()
            wq, scale = tlin.quartered_scratch(weight, fmt)
            wq = wq.clone()
            for m in args.m:
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq = glin.quartered(x, block_k)
                cfg = tiles.tile_config(tiles.DENSE.value, False, n, k, 0, m)

                def whole(scratch: bool) -> None:
                    tlin.takes_prompt_kernel = kernel if scratch else (lambda weight, fmt, x2: False)
                    tlin.PROMPT_SCRATCH_ROWS[fmt] = 0
                    linear(x, weight, mode)

                pieces = {
                    "plain whole": lambda: whole(False),
                    "scratch whole": lambda: whole(True),
                    "plain dequantize": lambda: tlin.dequantize(weight, fmt),
                    "quartered dequantize": lambda: tlin.quartered_scratch(weight, fmt),
                    "x quartered": lambda: glin.quartered(x, block_k),
                    "plain gemm": lambda: tlin._run(x, None, (plain, None, None, None), n, 0, tiles.DENSE.value,
                                                    False, None, cfg, None),
                    "quartered gemm (k 64)": lambda: glin.dense_gemm(xq, wq, 64, k, 1, None, None, scale),
                    "quartered gemm (k 128)": lambda: glin.dense_gemm(xq, wq, 128, k, 1, None, None, scale),
                }
                times = {key: [] for key in pieces}
                for order in (list(pieces), list(pieces)[::-1]):
                    for key in order:
                        times[key].append(graph_time_ms([pieces[key]]) * 1e3)
                tlin.takes_prompt_kernel = kernel
                tlin.PROMPT_SCRATCH_ROWS.update(rows)
                same = torch.equal(glin.dense_gemm(xq, wq, 64, k, 1, None, None, scale),
                                   glin.dense_gemm(xq, wq, 128, k, 1, None, None, scale))
                print(f"\n{name} {mode_name} [{storage}] M={m} (plain gemm: {cfg}); k 128 same bits as k 64: {same}")
                for key, (a, b) in times.items():
                    print(f"  {key:24s} {a:8.1f} {b:8.1f} us")


if __name__ == "__main__":
    main()
