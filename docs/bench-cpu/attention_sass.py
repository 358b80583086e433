"""The bf16 attention kernels compiled for sm_90 on the CPU as a launch on 8B heads specializes them
(`selfspec.bench.kernel_resources.compile_bf16_attention`): registers, spilled bytes, the output stores, and each
loop over key tiles (the innermost loops issuing MMA: SASS instructions a warp issues a key tile, and spill loads and
stores in them).

python docs/bench-cpu/attention_sass.py                           (this tree)
PYTHONPATH=.ab/TREE python docs/bench-cpu/attention_sass.py       (a tree of docs/bench-h200/lease/prepare.sh)
"""
from __future__ import annotations

import triton

from selfspec.bench import kernel_resources as kr
from selfspec.kernels import triton_attention as ta

STORES = ("STG.E.128", "STG.E.64", "STG.E.U16")


def row(name: str, kernel: triton.compiler.CompiledKernel) -> str:
    r = kr.resources(kernel)
    sass = kr.cuobjdump(kernel, "-sass")
    stores = ", ".join(f"{sass.count(op)} {op}" for op in STORES if sass.count(op))
    loops = ", ".join(f"{loop.instructions}" + (f" ({spill} spill)" if spill else "")
                      for loop in kr.mma_loops(kernel)
                      for spill in [loop.ops.get("STL", 0) + loop.ops.get("LDL", 0)])
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
