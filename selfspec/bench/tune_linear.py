"""Search the linear kernel's tile configs per format on the GPU: at decode sizes (M = 1 and 9), or with --many
the M and N tiles, warps and stages for many tokens (each candidate checked bit for bit against the decode tiles).

python -m selfspec.bench.tune_linear [--shape llama-3-8b]   -> best config per (format, GEMM), vs the current one
python -m selfspec.bench.tune_linear --many [--m 64 256 4096] -> MANY_TOKENS rows: fastest bit-exact tiles per bucket
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace

import torch

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import linear_tiles
from selfspec.kernels import triton_linear as tlin
from selfspec.kernels.launch import cdiv
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

KERNELS = {"bf16": ("dense", "bf16"), "w8a16": ("int8", "w8a16"), "w8a8": ("int8", "w8a8"),
           "w4a16": ("int4", "w4a16"), "w4a8": ("int4", "w4a8"), "upper": ("planes", "upper"),
           "full": ("planes", "full")}


def kernel_inputs(x: torch.Tensor, mode, fmt: int, group: int, n: int) -> tuple:
    """What the kernel reads for activations x (a GEMM of N outputs), as `linear` does for x's rows: x or its int8
    codes, their row scales, and the codes' row sums where the kernel reads them (act_quant's)."""
    m, k = x.shape
    cfg = linear_tiles.tile_config(fmt, mode.act_bits is not None, n, k, group, m)
    return tlin.kernel_inputs(x, mode, fmt, group, cfg, None)


def candidates(group_fmt: bool, nibble_kernel: bool) -> list[linear_tiles.TileConfig]:
    if nibble_kernel:  # _nibble_kernel: wider N tiles, never swapped, one group (128) per K tile
        return [linear_tiles.TileConfig(n, 128, s, 4, stages)
                for n, s, stages in itertools.product((64, 128, 256), (1, 2, 4, 8, 16), (2, 3))]
    ks = (64, 128) if group_fmt else (128, 256)
    return [linear_tiles.TileConfig(n, k, s, 4, 3, swap) for n, k, s, swap
            in itertools.product((32, 64, 128), ks, (1, 2, 4, 8, 16), (False, True))]


def tune(shape: str, ms: tuple[int, ...], kernels: list[str]) -> list[dict]:
    rows = []
    for kname in kernels:
        storage, mode_name = KERNELS[kname]
        mode = MODES[mode_name]
        for gemm, n, k in layer_gemms(SHAPES[shape]):
            copies = copies_past_l2(n * k * (2 if storage == "dense" else 1))
            weights = [quantize_weight(torch.randn(n, k, device="cuda").bfloat16() * 0.02 if storage == "dense"
                                       else torch.randn(n, k, device="cuda") * 0.02, storage, 128)
                       for _ in range(copies)]
            weight = weights[0]
            fmt, act = tlin.kernel_format(weight, mode), mode.act_bits is not None
            group = getattr(weight, "group_size", 0)
            xs = {m: kernel_inputs(torch.randn(m, k, device="cuda").bfloat16(), mode, fmt, group, n) for m in ms}

            def cost(cfg: linear_tiles.TileConfig) -> float:
                return sum(graph_time_ms([lambda w=w, m=m: tlin._launch(*xs[m][:2], w, fmt, act, None, cfg,
                                                                        sums=xs[m][2])
                                          for w in weights])
                           for m in ms)

            current = linear_tiles.tile_config(fmt, act, n, k, getattr(weight, "group_size", 0))
            results = []
            nibble = linear_tiles.uses_nibble_kernel(fmt, act, getattr(weight, "group_size", 0))
            for cfg in candidates(fmt >= linear_tiles.INT4.value, nibble):
                if cfg.split_k > cdiv(k, cfg.block_k):
                    continue
                if nibble and not act and cdiv(k, cfg.split_k * cfg.block_k) > linear_tiles.MAX_TILES_PER_PROGRAM:
                    continue
                results.append((cost(cfg), cfg))
            results.sort(key=lambda r: r[0])
            for warps, stages in ((8, 3), (4, 4), (4, 2), (8, 4)):  # refine the best tile shape
                c = results[0][1]
                cfg = linear_tiles.TileConfig(c.block_n, c.block_k, c.split_k, warps, stages, c.swap)
                results.append((cost(cfg), cfg))
            results.sort(key=lambda r: r[0])
            best_t, best = results[0]
            row = {"kernel": kname, "gemm": gemm, "n": n, "k": k, "best": best.__dict__,
                   "best_us": 1000 * best_t / len(ms),
                   "current": current.__dict__, "current_us": 1000 * cost(current) / len(ms),
                   "weight_mb": weight.nbytes() / 1e6,
                   "candidates": [{**cfg.__dict__, "us": 1000 * t / len(ms)} for t, cfg in results]}
            rows.append(row)
            print(f"{kname:6s} {gemm:8s} best {row['best_us']:7.1f} us {best}  current {row['current_us']:7.1f} us",
                  flush=True)
    return rows



# (block_m, block_n, warps, stages, K chunks in one program) per kernel kind (MANY_TOKENS says which kept the bits).
_MMA_SYNC = [(32, 128, 4, 3, False), (32, 128, 4, 3, True), (32, 256, 8, 3, True), (32, 64, 4, 4, True),
             (32, 128, 8, 3, True), (32, 128, 8, 3, False), (32, 64, 8, 3, False), (32, 64, 8, 3, True),
             (64, 128, 4, 3, True)]  # the last one on wgmma: shows the bits it changes
# The nibble kernel with bf16 activations reads its codes in mma.sync's natural k order (16-bit words, kWidth 2),
# the order wgmma reads: whether its wgmma tiles keep decode's bits, as the bf16 weights' do, is what these show.
_NIBBLE = _MMA_SYNC + [(64, 128, 4, 3, False), (64, 256, 8, 3, True), (128, 128, 8, 3, True),
                       (128, 128, 8, 3, False), (128, 256, 8, 3, True)]
_ANY = [(64, 128, 4, 3, False), (64, 128, 4, 3, True), (128, 128, 8, 3, True), (128, 256, 8, 2, True),
        (128, 128, 4, 3, True)]
MANY_CANDIDATES = {"bf16": _MMA_SYNC, "int8": _MMA_SYNC, "nibble": _NIBBLE, "planes": _NIBBLE, "int8-act": _ANY,
                   "nibble-act": _ANY}
MANY_KERNELS = {**KERNELS, "w4a4": ("int4", "w4a4")}
TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "in_program")


def tune_many(shape: str, ms: tuple[int, ...], kernels: list[str], save: str | None = None) -> list[dict]:
    """Per kernel, GEMM, M and candidate: microseconds and whether every row has the decode tiles' bits (written
    to `save` after each GEMM, so a run cut short keeps what it measured)."""
    rows = []
    for kname in kernels:
        storage, mode_name = MANY_KERNELS[kname]
        mode = MODES[mode_name]
        for gemm, n, k in layer_gemms(SHAPES[shape]):
            w = torch.randn(n, k, device="cuda") * 0.02
            weight = quantize_weight(w.bfloat16() if storage == "dense" else w, storage, 128)
            group = getattr(weight, "group_size", 0)
            fmt, act = tlin.kernel_format(weight, mode), mode.act_bits is not None
            base = linear_tiles.decode_config(fmt, act, n, k, group, max(ms))
            kind = linear_tiles.kernel_kind(fmt, act, group, max(ms))
            dense = w.bfloat16()
            for m in ms:
                x = torch.randn(m, k, device="cuda").bfloat16()
                xq, xs, sums = kernel_inputs(x, mode, fmt, group, n)

                def launch(cfg: linear_tiles.TileConfig) -> torch.Tensor:
                    return tlin._launch(xq, xs, weight, fmt, act, None, cfg, sums=sums)

                ref = launch(base)
                row = {"kernel": kname, "kind": kind, "gemm": gemm, "n": n, "k": k, "m": m, "base": base.__dict__,
                       "base_us": 1000 * graph_time_ms([lambda: launch(base)]),
                       "cublas_us": 1000 * graph_time_ms([lambda: torch.nn.functional.linear(x, dense)]),
                       "candidates": []}
                for bm, bn, warps, stages, in_program in MANY_CANDIDATES[kind]:
                    if not in_program and base.split_k > 1 and m > 64:
                        continue  # split partials in memory: only for few tokens
                    cfg = replace(base, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                  in_program=in_program and base.split_k > 1)
                    try:
                        same = torch.equal(launch(cfg), ref)
                        us = 1000 * graph_time_ms([lambda: launch(cfg)])
                    except Exception as e:  # noqa: BLE001 (a config past the shared memory: recorded, skipped)
                        row["candidates"].append({**cfg.__dict__, "error": str(e)[:200]})
                        continue
                    row["candidates"].append({**cfg.__dict__, "us": us, "bitwise": same})
                ok = [c for c in row["candidates"] if c.get("bitwise")]
                changed = [tuple(c[f] for f in TILE_FIELDS[:3]) for c in row["candidates"] if c.get("bitwise") is False]
                best = min(ok, key=lambda c: c["us"]) if ok else None
                rows.append(row)
                print(f"{kname:6s} {gemm:8s} M={m:5d} decode {row['base_us']:8.1f} best "
                      f"{best['us'] if best else float('nan'):8.1f} cuBLAS {row['cublas_us']:8.1f}  "
                      f"{best and tuple(best[f] for f in TILE_FIELDS)} not bitwise: {changed}",
                      flush=True)
            if save:
                with open(save, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernels", nargs="+", default=None, choices=list(MANY_KERNELS))
    ap.add_argument("--many", action="store_true", help="tiles for many tokens (M > 16), checked bit for bit")
    ap.add_argument("--m", type=int, nargs="+", default=[64, 256, 4096])
    args = ap.parse_args(argv)
    if args.many:
        rows = tune_many(args.shape, tuple(args.m), args.kernels or list(MANY_KERNELS), args.json)
    else:
        rows = tune(args.shape, (1, 9), args.kernels or list(KERNELS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
