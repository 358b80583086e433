"""How much of the warp-specialized nibble GEMM's time is its weight build, and how much the rest (session 22).

Times one layer GEMM per variant of kernels/gluon_linear.py, each a copy of the module with one change, beside
today's module and cuBLAS BF16, all under CUDA graphs on weights that stream from HBM (as selfspec.bench.gemm):
- `main`: the module as it is;
- `no-build`: the consumers take the loaded 16-bit words, as they are, for their bf16 weights (the same registers
  for each quarter of the K tile): no shifts, masks, byte permutes, FMA or copies; what the kernel would take if
  building the weights cost nothing;
Wrong results for the probe, by design: timing only. (A build without the wgmma cannot be timed this way: ptxas
removes a build whose weights nothing reads, even from asm marked as having side effects.)

python docs/bench-h200/build_probe.py [--m 256 1024 4096] [--gemms qkv o gate/up down] [--modes w4a16 upper
    full]
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import tempfile

import torch

import selfspec.kernels.gluon_linear as main_module
import selfspec.kernels.triton_linear as tlin
from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.gemm import FIRST_STORAGE
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import linear
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

STORAGE = FIRST_STORAGE  # each mode from the storage the GEMM bench names it by


def no_build(src: str) -> str:
    out, n = re.subn(r"        c0, c1, c2, c3 = codes\n        weights = \(.*?\)\)\n",
                     "        weights = (w.to(gl.bfloat16, bitcast=True), ) * 4\n", src, flags=re.S)
    assert n == 1, "gluon_linear.py changed: update the probe's replacements"
    return out


def variant(name: str, edit) -> object:
    path = pathlib.Path(tempfile.mkdtemp()) / f"gluon_linear_{name.replace('-', '_')}.py"
    path.write_text(edit(pathlib.Path(main_module.__file__).read_text()))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--gemms", nargs="+", default=["qkv", "o", "gate/up", "down"])
    p.add_argument("--modes", nargs="+", default=["w4a16", "upper", "full"])
    args = p.parse_args()
    variants = {"main": main_module, "no-build": variant("no-build", no_build)}
    print("| gemm | mode | M | cuBLAS us | " + " | ".join(f"{v} us (x cuBLAS)" for v in variants) + " |")
    print("|---|---|---|---|" + "---|" * len(variants))
    for name, n, k in layer_gemms(SHAPES["llama-3-8b"]):
        if name not in args.gemms:
            continue
        ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(copies_past_l2(2 * n * k))]
        dense = [w.bfloat16() for w in ws]
        for mode_name in args.modes:
            mode = MODES[mode_name]
            weights = [quantize_weight(w, STORAGE[mode_name], 128) for w in ws]
            for m in args.m:
                x = torch.randn(m, k, device="cuda").bfloat16()
                cublas = graph_time_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
                cells = []
                for module in variants.values():
                    tlin.gluon_linear = module
                    t = graph_time_ms([lambda w=w: linear(x, w, mode) for w in weights])
                    cells.append(f"{t * 1e3:.1f} ({t / cublas:.2f})")
                tlin.gluon_linear = main_module
                print(f"| {name} | {mode_name} | {m} | {cublas * 1e3:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
