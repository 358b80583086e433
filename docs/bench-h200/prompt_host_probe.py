"""Where the host's time of one prompt-token GEMM goes (session 31): cProfile over calls of `linear` at 512 rows of
an 8B qkv in w4a16, through the dequantize pass + bf16 GEMM and through the nibble kernel, and the host time of
each piece alone (x quartered, the TMA descriptors, a launch).

python docs/bench-h200/prompt_host_probe.py
"""
from __future__ import annotations

import cProfile
import pstats

import torch
from prompt_kernel_probe import KERNEL, PATHS, host_ms  # its sibling in this folder (the script's own path)

import selfspec.kernels.gluon_linear as glin
import selfspec.kernels.triton_linear as tlin
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES, prompt_mode


def host_us(fn) -> float:
    return host_ms(fn, calls=200) * 1e3


def main() -> None:
    mode = prompt_mode(MODES["w4a16"])
    weight = quantize_weight(torch.randn(6144, 4096, device="cuda") * 0.02, "int4", 128)
    x = torch.randn(512, 4096, device="cuda").bfloat16()
    for path, rule in PATHS.items():
        tlin.takes_prompt_kernel = rule
        print(f"\n{path}: {host_us(lambda: linear(x, weight, mode)):.1f} us a call")
        with cProfile.Profile() as prof:
            for _ in range(200):
                linear(x, weight, mode)
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    tlin.takes_prompt_kernel = KERNEL
    fmt = tlin.kernel_format(weight, mode)
    block_k = tlin.dequantize_block_k(fmt, weight.group_size)
    tensors = tlin._tensors(weight, fmt)
    xq = glin.quartered(x, block_k)
    print(f"quartered: {host_us(lambda: glin.quartered(x, block_k)):.1f} us")
    w, _, scale, lo = tensors
    print(f"descriptors: {host_us(lambda: glin.descriptors(xq, w, None, scale, lo, block_k, 256)):.1f} us")
    print(f"torch.empty: {host_us(lambda: torch.empty((512, 6144), dtype=torch.bfloat16, device='cuda')):.1f} us")
    print(f"torch add: {host_us(lambda: x + x):.1f} us")


if __name__ == "__main__":
    main()
