"""w8a16 (INT8 codes as 32-bit words): the K split fixes each row's bits, so it is chosen once for decode and for
many tokens. Per 8B layer and split: the decode tiles' time at M = 1 and 16 (N tiles of 64 and 128) against the
bytes' tiles before (K tiles of 256), and the warp-specialized kernel's at 256 / 1024 / 4096 rows against cuBLAS
BF16. Session 11. PYTHONPATH=. python docs/bench-h200/w8a16_split_probe.py OUT.json"""
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

words_rule = tiles.reads_words
rows = []
for gemm, n, k in layer_gemms(SHAPES["llama-3-8b"]):
    weights = [quantize_weight(torch.randn(n, k, device="cuda") * 0.02, "int8", 128)
               for _ in range(copies_past_l2(n * k))]
    dense = torch.randn(n, k, device="cuda").bfloat16() * 0.02
    xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in (1, 16, 256, 1024, 4096)}

    def us(cfg, m: int, words: bool = True) -> float:
        tiles.reads_words = words_rule if words else (lambda *a: False)
        try:
            return 1000 * graph_time_ms([lambda w=w: tlin._launch(xs[m], None, w, tiles.INT8.value, False, None, cfg)
                                         for w in weights])
        finally:
            tiles.reads_words = words_rule

    base = tiles.decode_config(tiles.INT8.value, False, n, k, 0)
    old = tiles.TileConfig(32, 256, max(1, min(triton.cdiv(k, 256), 8, 528 // triton.cdiv(n, 32))))
    row = {"gemm": gemm, "bytes_us": {m: us(old, m, False) for m in (1, 16)},
           "cublas_us": {m: 1000 * graph_time_ms([lambda: torch.nn.functional.linear(xs[m], dense)])
                         for m in (256, 1024, 4096)}, "splits": []}
    for split in (1, 2, 4, 8):
        if split > triton.cdiv(k, 128):
            continue
        entry = {"split": split, "ws_us": {m: us(replace(base, split_k=split, warp_specialized=True), m)
                                           for m in (256, 1024, 4096)}}
        for bn in (64, 128):
            entry[f"decode_n{bn}_us"] = {m: us(replace(base, block_n=bn, split_k=split), m) for m in (1, 16)}
        row["splits"].append(entry)
        d = {bn: [round(entry[f"decode_n{bn}_us"][m] / row["bytes_us"][m], 3) for m in (1, 16)] for bn in (64, 128)}
        print(gemm, "split", split, "decode/bytes (M=1, 16):", d, "ws/cuBLAS (256, 1024, 4096):",
              [round(entry["ws_us"][m] / row["cublas_us"][m], 2) for m in (256, 1024, 4096)], flush=True)
    rows.append(row)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
