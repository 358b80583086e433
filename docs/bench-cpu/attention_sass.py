"""The bf16 attention kernels compiled for sm_90 on the CPU as a launch on 8B heads specializes them
(`selfspec.bench.kernel_resources.compile_bf16_attention`): registers, spilled bytes, the output stores, and each
loop over key tiles (the innermost loops issuing MMA: SASS instructions a warp issues a key tile, and spill loads and
stores in them).

python docs/bench-cpu/attention_sass.py                           (this tree)
PYTHONPATH=.ab/TREE python docs/bench-cpu/attention_sass.py       (a tree of docs/bench-h200/lease/prepare.sh)
"""
from __future__ import annotations

import re

import triton

from selfspec.bench import kernel_resources as kr
from selfspec.kernels import triton_attention as ta

STORES = ("STG.E.128", "STG.E.64", "STG.E.U16")
MMA = ("HMMA", "HGMMA")


def key_tile_loops(sass: str) -> list[tuple[int, int]]:
    """Each innermost loop (a backward branch holding no shorter one) that issues MMA: (instructions, spill loads
    and stores), shortest first."""
    code = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
            for m in [re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)] if m]
    spans = []
    for at, op, line in code:
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if op == "BRA" and target is not None and int(target.group(1), 16) < at:
            spans.append((int(target.group(1), 16), at))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    loops = []
    for lo, hi in inner:
        body = [o for a, o, _ in code if lo <= a <= hi]
        if any(o in MMA for o in body):
            loops.append((len(body), sum(o in ("STL", "LDL") for o in body)))
    return sorted(loops)


def row(name: str, kernel: triton.compiler.CompiledKernel) -> str:
    r = kr.resources(kernel)
    sass = kr.cuobjdump(kernel, "-sass")
    stores = ", ".join(f"{sass.count(op)} {op}" for op in STORES if sass.count(op))
    loops = ", ".join(f"{n} ({s} spill)" if s else str(n) for n, s in key_tile_loops(sass))
    return f"| {name} | {r.registers} | {r.stack_bytes} | {stores} | {loops} |"


def flags(kernel: triton.JITFunction, tile: ta.Tiles, quartered: int | None) -> dict:
    """The constexprs a lead's tree adds where its kernel takes them (o's quartering, prompt tokens' one chain)."""
    extra = {}
    if quartered is not None:
        extra["QUARTERED"] = quartered
    if "ONE_CHAIN" in kernel.arg_names:
        extra["ONE_CHAIN"] = tile is ta.PROMPT_TILES
    return extra


def main() -> None:
    in_program = ta._attention_in_program_kernel
    widths = (0, 64, 128, 256) if "QUARTERED" in in_program.arg_names else (None,)
    print("| kernel | registers | stack bytes | output stores | key-tile loops: instructions a warp |\n"
          "|---|---|---|---|---|")
    tiles = {"prompt": ta.PROMPT_TILES, "prefill": ta.PREFILL_TILES, "wide verify": ta.WIDE_VERIFY_TILES,
             "decode (split)": ta.DECODE_TILES}
    for label, tile in tiles.items():
        kernel = in_program if tile.in_program else ta._attention_chunk_kernel
        for dim in (64, 128):
            for in_block in (True, False):
                for q in widths if tile.in_program else (None,):
                    consts = dict(TILE_IN_BLOCK=in_block, TAILS=False, **flags(kernel, tile, q))
                    name = (f"{label} ({tile.block_t} rows, {tile.warps} warps), D {dim}, "
                            f"{'tiles in a block' if in_block else 'blocks of 16'}"
                            + ("" if q is None else f", quartered {q}"))
                    print(row(name, kr.compile_bf16_attention(kernel, consts, tile.block_t, tile.warps, dim)),
                          flush=True)
    for dim in (64, 128):
        for q in widths:
            consts = {} if q is None else dict(QUARTERED=q)
            name = f"merge, D {dim}" + ("" if q is None else f", quartered {q}")
            print(row(name, kr.compile_bf16_attention(ta._attention_merge_kernel, consts, ta.MERGE_BLOCK_T, 4, dim)),
                  flush=True)


if __name__ == "__main__":
    main()
