"""w8a16 decode tiles (M = 1 and 16) on the 8B layers: the INT8 codes as bytes in K tiles of 256 (the tiles before
32-bit words) and of 128, against the words in K tiles of 128 over N tiles, splits, swaps, warps and stages.
Session 11 (H200).

PYTHONPATH=. python docs/bench-h200/w8a16_decode_probe.py OUT.json"""
import itertools
import json
import sys
from dataclasses import replace

import torch
import triton

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import triton_linear as tlin
from selfspec.kernels import linear_tiles as tiles
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

mode = MODES["w8a16"]
words_rule = tiles.reads_words
rows = []
for gemm, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    weights = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int8", 128)
               for _ in range(copies_past_l2(n * k))]
    xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in (1, 16)}
    base = tiles.decode_config(tiles.INT8.value, False, n, k, 0)

    def cost(cfg, words: bool) -> float:
        tiles.reads_words = words_rule if words else (lambda *a: False)
        try:
            return sum(1000 * graph_time_ms([lambda w=w, m=m: tlin._launch(xs[m], None, w, tiles.INT8.value, False,
                                                                           None, cfg) for w in weights])
                       for m in (1, 16)) / 2
        finally:
            tiles.reads_words = words_rule

    old = replace(base, block_k=256, split_k=max(1, min(triton.cdiv(k, 256), 8, 528 // triton.cdiv(n, 32))))
    row = {"gemm": gemm, "n": n, "k": k, "bytes_256_us": cost(old, False), "bytes_128_us": cost(base, False),
           "words_128_us": cost(base, True), "words": []}
    row["words_256_us"] = cost(replace(old, block_k=256), True)
    for bn, split, swap, warps, stages in itertools.product((64, 128), (2, 4, 8, 16), (False, True), (4, 8), (3, 4, 5)):
        if split > triton.cdiv(k, 128) or (bn == 64 and warps == 8):
            continue
        cfg = replace(base, block_n=bn, split_k=split, swap=swap, num_warps=warps, num_stages=stages)
        try:
            row["words"].append({"block_n": bn, "split_k": split, "swap": swap, "warps": warps, "stages": stages,
                                 "us": cost(cfg, True)})
        except Exception as e:  # noqa: BLE001 (a tile that does not compile: say so)
            row["words"].append({"block_n": bn, "split_k": split, "swap": swap, "warps": warps, "stages": stages,
                                 "error": str(e)[:200]})
    best = min((c for c in row["words"] if "us" in c), key=lambda c: c["us"])
    print(f"{gemm}: bytes/256 {row['bytes_256_us']:.2f} us, bytes/128 {row['bytes_128_us']:.2f}, words/128 "
          f"{row['words_128_us']:.2f} (base {base.block_n} x split {base.split_k}), "
          f"words/256 {row['words_256_us']:.2f}; "
          f"best words/128 {best}", flush=True)
    rows.append(row)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
