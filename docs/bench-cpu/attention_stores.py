"""Registers, spills and output stores of the bf16 attention's in-program and merge kernels, compiled for sm_90 on
the CPU with the pointers, strides and block size 16-divisible, as a launch on 8B heads specializes them (without
those attributes every store reads as a 2-byte STG.E.U16 and the spills are not the launch's).

python docs/bench-cpu/attention_stores.py                      (this tree)
PYTHONPATH=.ab/x-quartered-attention python docs/bench-cpu/attention_stores.py   (a tree whose kernels take QUARTERED)
"""
from __future__ import annotations

import triton
from triton.compiler import ASTSource

from selfspec.bench import kernel_resources as kr
from selfspec.kernels import triton_attention as ta

INDEX_POINTERS = ("table_ptr", "tails_ptr", "pos_ptr")
BF16_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "o_ptr")
STORES = ("STG.E.128", "STG.E.64", "STG.E.U16")


def compile_as_launched(kernel: triton.JITFunction, consts: dict, warps: int) -> triton.compiler.CompiledKernel:
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i64" if name in INDEX_POINTERS else "*bf16" if name in BF16_POINTERS else "*fp32"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    aligned = [n for n in kernel.arg_names
               if n not in consts and (n.endswith("_ptr") or n.startswith("stride") or n == "BS")]
    return triton.compile(ASTSource(kernel, sig, consts, kr._divisible_by_16(kernel, aligned)), target=kr.H100,
                          options=dict(num_warps=warps, num_stages=2))


def row(name: str, kernel: triton.compiler.CompiledKernel) -> str:
    r = kr.resources(kernel)
    sass = kr.cuobjdump(kernel, "-sass")
    stores = ", ".join(f"{sass.count(op)} {op}" for op in STORES if sass.count(op))
    return f"| {name} | {r.registers} | {r.stack_bytes} | {stores} |"


def main() -> None:
    quartering = "QUARTERED" in ta._attention_in_program_kernel.arg_names
    widths = (0, 64, 128, 256) if quartering else (None,)
    print("| kernel | registers | stack bytes | output stores |\n|---|---|---|---|")
    tiles = {"prompt": ta.PROMPT_TILES, "prefill": ta.PREFILL_TILES, "wide verify": ta.WIDE_VERIFY_TILES}
    for label, tile in tiles.items():
        for dim in (64, 128):
            for q in widths:
                consts = dict(D=dim, BLOCK_D=dim, BLOCK_T=tile.block_t, BLOCK_S=ta.BLOCK_S, CHUNK=ta.CHUNK,
                              TILE_IN_BLOCK=True, PDL=False, TAILS=False)
                if "ONE_CHAIN" in ta._attention_in_program_kernel.arg_names:  # prompt tokens' one chain of keys
                    consts["ONE_CHAIN"] = tile is ta.PROMPT_TILES
                if q is not None:
                    consts["QUARTERED"] = q
                name = f"in-program, {label} ({tile.block_t} rows, {tile.warps} warps), D {dim}, quartered {q}"
                print(row(name, compile_as_launched(ta._attention_in_program_kernel, consts, tile.warps)), flush=True)
    for dim in (64, 128):
        for q in widths:
            consts = dict(D=dim, BLOCK_D=dim, BLOCK_T=ta.MERGE_BLOCK_T, CHUNK=ta.CHUNK, PDL=False)
            if q is not None:
                consts["QUARTERED"] = q
            print(row(f"merge, D {dim}, quartered {q}", compile_as_launched(ta._attention_merge_kernel, consts, 4)),
                  flush=True)


if __name__ == "__main__":
    main()
