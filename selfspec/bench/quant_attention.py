"""Quantized KV attention vs bf16 for decode (1 query) and verify passes (several queries of one row), batch 1.

python -m selfspec.bench.quant_attention [--contexts 16384 ... 131072] [--queries 1 5] [--json out.json]
    [--chunk-keys 1024] [--block-n 64] [--warps 4] [--stages 2] [--max-registers 128]
(also `selfspec bench quant_attention ...`)

One layer at Llama-3-8B heads (32 query, 8 kv, head dim 128, KV group 128): the paged bf16 attention
(kernels/triton_attention.py) and the quantized one (kernels/triton_quant_attention.py) over `int8`, `hier` both
planes (verify) and `hier` upper plane (draft), microseconds per call under CUDA graph replays (median), caches
filled as bench/long_context.py fills them. Each row gives its time over bf16's at the same context and queries,
and over its own decode query's (what a verify pass of T queries costs against one). --chunk-keys, --block-n,
--warps, --stages and --max-registers (ptxas's cap per thread; 0: none) set the quantized kernel's constants for
the run, for a tuning sweep (the kernel's own come back after it). --tiny runs tiny heads on the CPU (torch
references): a check that it runs.
"""
from __future__ import annotations

import argparse
import json

import torch

from selfspec.bench import long_context as lc
from selfspec.errors import SelfspecError
from selfspec.kernels import triton_quant_attention as tqa

KERNELS = ("bf16", *lc.QUANT_KERNELS)
CONTEXTS = [16384, 32768, 65536, 131072]
QUERIES = [1, 5]


def rows_for(heads: lc.Heads, contexts: list[int], queries: list[int], device: torch.device) -> list[dict]:
    """long_context's attention rows of KERNELS per context and queries, each with x_decode: its time over the same
    kernel's at one query (where 1 is among `queries`)."""
    rows = []
    for context in contexts:
        for t in queries:
            rows += lc.attention_rows(heads, context, t, 1, device, KERNELS)
    decode = {(r["context"], r["kernel"]): r["us"] for r in rows if r["queries"] == 1}
    for r in rows:
        if (r["context"], r["kernel"]) in decode:
            r["x_decode"] = r["us"] / decode[(r["context"], r["kernel"])]
    return rows


def table(rows: list[dict]) -> str:
    out = ["| context | queries | kernel | KV read (MiB) | us | GB/s | x bf16 | time / decode query |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['x_decode']:.2f}" if "x_decode" in r else "-"
        out.append(f"| {r['context']} | {r['queries']} | {r['kernel']} | {r['read_bytes'] / 2**20:.2f} | "
                   f"{r['us']:.1f} | {r['gb_s']:.0f} | {r['x_bf16']:.2f} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help=f"keys before the first query (default {CONTEXTS}; --tiny: {lc.TINY_CONTEXTS})")
    ap.add_argument("--queries", type=int, nargs="+", default=QUERIES, help="query tokens of one row per call")
    ap.add_argument("--chunk-keys", type=int, default=tqa.CHUNK_KEYS, help="quantized keys per program")
    ap.add_argument("--block-n", type=int, default=tqa.BLOCK_N, help="keys per online-softmax step (16, 32, 64)")
    ap.add_argument("--warps", type=int, default=tqa.NUM_WARPS, help="warps of the quantized kernel")
    ap.add_argument("--stages", type=int, default=tqa.NUM_STAGES, help="software pipelining stages of the key steps")
    ap.add_argument("--max-registers", type=int, default=tqa.MAX_REGISTERS, metavar="N",
                    help=f"registers per thread of the quantized kernel (default {tqa.MAX_REGISTERS}; 0: the "
                         "compiler's choice)")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--tiny", action="store_true", help="tiny heads and contexts on the CPU (torch references)")
    args = ap.parse_args(argv)
    heads = lc.TINY if args.tiny else lc.LLAMA_3_8B
    contexts = args.contexts or (lc.TINY_CONTEXTS if args.tiny else CONTEXTS)
    if min(contexts) < 1 or min(args.queries) < 1 or max(args.queries) >= heads.group:
        raise SelfspecError(f"contexts must be at least 1 and --queries in 1..{heads.group - 1} (a pass writes fewer "
                            f"tokens than the KV group {heads.group}); got {contexts}, {args.queries}")
    powers = (1, 2, 4, 8, 16, 32, 64, 128)
    if args.block_n not in powers[4:] or args.chunk_keys < 1 or args.warps not in powers[:5]:
        raise SelfspecError(f"--block-n is a power of two from 16, --chunk-keys at least 1 and --warps a power of two "
                            f"up to 16; got {args.block_n}, {args.chunk_keys}, {args.warps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        raise SelfspecError("the quantized attention benchmark needs a CUDA GPU; --tiny runs a small check on the CPU")
    config = {"chunk_keys": args.chunk_keys, "block_n": args.block_n, "warps": args.warps, "stages": args.stages,
              "max_registers": args.max_registers or None}
    kept = tqa.CHUNK_KEYS, tqa.BLOCK_N, tqa.NUM_WARPS, tqa.NUM_STAGES, tqa.MAX_REGISTERS
    tqa.CHUNK_KEYS, tqa.BLOCK_N, tqa.NUM_WARPS, tqa.NUM_STAGES = args.chunk_keys, args.block_n, args.warps, args.stages
    tqa.MAX_REGISTERS = config["max_registers"]
    try:  # the kernel's own constants back afterwards: a later run in this process starts from them
        torch.manual_seed(0)
        rows = rows_for(heads, contexts, args.queries, device)
    finally:
        tqa.CHUNK_KEYS, tqa.BLOCK_N, tqa.NUM_WARPS, tqa.NUM_STAGES, tqa.MAX_REGISTERS = kept
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "heads": vars(heads), "quant_kernel": config,
                       "rows": rows}, f, indent=1)
    how = "CUDA graph replays" if device.type == "cuda" else "wall clock, torch references"
    print(f"\n{where}; heads {heads.q} query / {heads.kv} kv of {heads.dim}, KV group {heads.group}, batch 1; "
          f"quantized kernel {config}\n\n## Attention, one layer (us: {how}, median)\n\n" + table(rows))


if __name__ == "__main__":
    try:
        main()
    except SelfspecError as e:
        raise SystemExit(f"error: {e}") from None
