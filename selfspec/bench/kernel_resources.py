"""Registers, spills, shared memory and tensor-core instruction of the linear kernel's tile configs and of the
quantized attention's tiles, compiled for an H100 (sm_90) on any machine, GPU or not: Triton compiles ahead of time
and ships ptxas and cuobjdump.

A config that spills registers to the stack is slow however it is tuned (docs/bench-h100/gemm-many-tokens.md), and
whether Triton issues mma.sync or wgmma decides a row's bits: both show here before any GPU time is spent.

python -m selfspec.bench.kernel_resources --mode full --tiles 16x128x4 32x128x4 64x64x4 [--split 4]
python -m selfspec.bench.kernel_resources --attention [--warps 4 8] [--max-registers 168 128]  (Llama-3-8B heads)
python -m selfspec.bench.kernel_resources --warp-specialized  (kernels/gluon_linear.py: per nibble format, and bf16)
python -m selfspec.bench.kernel_resources --shape llama-3-8b --modes full w4a16 --m 1 32 160   (the tiles `linear`
    picks for each layer GEMM of the shape at each M, as the model runs them, and the instructions their K loop
    issues: a decode tile streaming its weights at an H200's 4.8 TB/s has ~3.5 lane-instructions a weight to spend
    on half-byte codes, ~7 on bytes; and the bank wavefronts its reads of shared tiles take against the least they
    could)
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Callable, Iterable
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import gluon_linear as gll
from selfspec.kernels import linear_tiles
from selfspec.kernels import triton_attention as ta
from selfspec.kernels import triton_linear as tlin
from selfspec.kernels import triton_quant_attention as tqa
from selfspec.quant.modes import MODES

H100 = GPUTarget("cuda", 90, 32)
# The stored format each weight-only or activation-quantized mode reads, as the kernels see it.
FORMATS = {"bf16": linear_tiles.DENSE.value, "w8a16": linear_tiles.INT8.value, "w8a8": linear_tiles.INT8.value,
           "w4a16": linear_tiles.INT4.value, "w4a8": linear_tiles.INT4.value, "w4a4": linear_tiles.INT4.value,
           "upper": linear_tiles.UPPER.value, "full": linear_tiles.FULL.value}


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int  # spilled registers (and locals) per thread
    shared_bytes: int
    mma: str  # "wgmma", "mma.sync" or "none"


def compile_linear(mode: str, cfg: linear_tiles.TileConfig, k: int = 4096, group: int = 128,
                   fmt: int | None = None) -> triton.compiler.CompiledKernel:
    """The kernel `_launch` would run for `mode` under `cfg` (K = k), compiled for sm_90 (no launch, no GPU); with
    its int8 codes' row sums where the kernel takes them. `fmt`: the weight's format where not the mode's FORMATS
    one (INT4G)."""
    fmt, act = FORMATS[mode] if fmt is None else fmt, MODES[mode].act_bits is not None
    nibble = linear_tiles.uses_nibble_kernel(fmt, act, group, cfg.block_m)
    words = linear_tiles.reads_words(fmt, act, group, cfg)
    word_type = "i32" if fmt == linear_tiles.INT8.value else "i16"
    w_type = word_type if words else {linear_tiles.DENSE.value: "bf16", linear_tiles.INT8.value: "i8"}.get(fmt, "u8")
    if words:
        w_cols = cfg.block_k // 4
    else:
        w_cols = cfg.block_k // 2 if fmt >= linear_tiles.INT4.value else cfg.block_k
    desc = f"tensordesc<{w_type}[{cfg.block_n}, {w_cols}]>"
    sig = {"x_ptr": "*i8" if act else "*bf16", "xs_ptr": "*fp32", "w_desc": desc,
           "w2_desc": desc if fmt == linear_tiles.FULL.value else "constexpr", "scale_ptr": "*fp32",
           "lo_ptr": "*i32" if fmt == linear_tiles.INT4G.value else "*fp32",
           "bias_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16",
           "part_ptr": "*i32" if act and fmt in (linear_tiles.INT8.value, linear_tiles.INT4G.value) else "*fp32",
           "count_ptr": "*i32"}
    sig.update(dict.fromkeys(("M", "N", "K", "K_CHUNK", "CHUNKS", "stride_xm", "stride_sn", "stride_sg",
                              "stride_ym", "stride_rm"), "i32"))
    consts = dict(FMT=fmt, ACT=act, GROUP=group if fmt >= linear_tiles.INT4.value else 0, HAS_BIAS=False, HAS_RES=False,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1 if cfg.in_program
                  else cfg.split_k, IN_PROGRAM=cfg.in_program, PDL=False)
    if fmt != linear_tiles.FULL.value:
        consts["w2_desc"] = None
    if nibble:  # as the model runs it: with its codes' row sums where the kernel takes them, x by TMA where it is
        row_sums = linear_tiles.takes_row_sums(fmt, act, group, cfg)
        sig["sums_ptr"] = "*fp32" if row_sums else "constexpr"
        if not row_sums:
            consts["sums_ptr"] = None
        x_desc = linear_tiles.x_by_tma(fmt, act, cfg)
        if x_desc:
            sig["x_ptr"] = f"tensordesc<{'i8' if act else 'bf16'}[{cfg.block_m}, {cfg.block_k}]>"
        consts.update(ROW_SUMS=row_sums, WORDS=words, ASM=True, X_DESC=x_desc)
        kernel = tlin._nibble_kernel
    else:
        consts.update(SHIFT=tlin._shift(fmt) if act else 0, SWAP=cfg.swap, WORDS=words, ASM=True)
        kernel = tlin._linear_kernel
    sig.update(dict.fromkeys(consts, "constexpr"))
    # As launched: the pointers, the sizes and x's and y's strides of a model's layers are 16-divisible, and Triton
    # specializes on it (vector loads, the shared buffers' swizzles).
    aligned = [name for name in kernel.arg_names if sig.get(name) in ("i32", "*bf16", "*fp32", "*i32", "*i8")
               and name not in ("M", "CHUNKS", "stride_sn", "stride_sg")]
    return triton.compile(ASTSource(kernel, sig, consts, _divisible_by_16(kernel, aligned)), target=H100,
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def compile_warp_specialized(mode: str, block_k: int = 128, group: int = 128, in_program: bool = True,
                             partial: bool = False, block_m: int = gll.BLOCK_M,
                             fmt: int | None = None) -> triton.compiler.CompiledKernel:
    """The warp-specialized nibble GEMM (kernels/gluon_linear.py) for `mode` (w4a16, upper, full, or w8a16: INT8
    codes as 32-bit words), compiled for sm_90 (no launch, no GPU), as `nibble_gemm` launches it on an 8B layer
    (16-byte aligned tensors; N, K and the strides multiples of 16, which Triton specializes on); `partial`: one K
    chunk per CTA, its fp32 sum stored (`chunks_apart`); `block_m`: rows of x per CTA (`nibble_block_m`); `fmt`:
    the weight's format where not the mode's FORMATS one (INT4G)."""
    fmt = FORMATS[mode] if fmt is None else fmt
    q = block_k // 4

    def desc(dtype: str, shape: list[int], layout: object) -> str:
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{layout!r}>"

    word, word_name = (gl.int32, "i32") if fmt == linear_tiles.INT8.value else (gl.int16, "i16")
    words = desc(word_name, [gll.BLOCK_N, q], gl.NVMMASharedLayout.get_default_for([gll.BLOCK_N, q], word))
    row_n = desc("fp32", [1, gll.BLOCK_N], gll.ROW_LAYOUT)
    sig = {"x_desc": desc("bf16", [block_m, q], gl.NVMMASharedLayout.get_default_for([block_m, q], gl.bfloat16)),
           "w_desc": words, "w2_desc": words, "scale_desc": row_n, "lo_desc": row_n,
           "scale_ptr": "*fp32", "bias_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*fp32" if partial else "*bf16"}
    if fmt == linear_tiles.INT8.value:  # the words' descriptor stands in for the ones it does not read
        sig.update(w2_desc=words, scale_desc=words, lo_desc=words)
    elif fmt != linear_tiles.INT4G.value:  # INT4G: its channel scales after the sum
        sig["scale_ptr"] = "constexpr"
    sig.update(dict.fromkeys(("M", "N", "K", "K_CHUNK", "CHUNKS", "stride_ym", "stride_rm"), "i32"))
    consts = dict(CHUNKS=1) if partial else {}  # a launch's 1 is specialized as a constant
    if fmt not in (linear_tiles.INT8.value, linear_tiles.INT4G.value) or partial:
        consts["scale_ptr"] = None
    consts |= dict(FMT=fmt, GROUP=group, HAS_BIAS=False, HAS_RES=False, IN_PROGRAM=in_program and not partial,
                   PARTIAL=partial, NARROWS=True,
                   BLOCK_M=block_m, BLOCK_N=gll.BLOCK_N, BLOCK_K=block_k,
                   STAGES=gll.nibble_stages(fmt, block_k, block_m))
    return _compile_as_launched(gll._nibble_ws_kernel, sig, consts)


def _divisible_by_16(kernel: triton.JITFunction, names: Iterable[str]) -> dict:
    """Triton's attributes marking the kernel's arguments `names` 16-divisible, as a launch specializes them."""
    return {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


def _compile_as_launched(kernel, sig: dict, consts: dict) -> triton.compiler.CompiledKernel:
    """A warp-specialized nibble GEMM for sm_90 with consts as constexprs and the pointers and sizes 16-aligned, as
    launched on an 8B layer."""
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = ("bias_ptr", "res_ptr", "y_ptr", "N", "K", "stride_ym", "stride_rm")
    return triton.compile(GluonASTSource(kernel, sig, consts, _divisible_by_16(kernel, aligned)), target=H100,
                          options=dict(num_warps=4, maxnreg=gll.MAX_REGISTERS))


def compile_dense_warp_specialized(block_k: int = 64, split_k: int = 2, block_n: int | None = None,
                                   scale: bool = False) -> triton.compiler.CompiledKernel:
    """The warp-specialized bf16 GEMM (kernels/gluon_linear.py) compiled for sm_90, as `dense_gemm` launches it
    (with `scale`, on INT8 codes with their channel scale: w8a16's scratch)."""
    block_n = block_n or gll.dense_block_n(split_k)

    def desc(shape: list[int]) -> str:
        return f"tensordesc<bf16[{shape[0]}, {shape[1]}],{gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)!r}>"

    sig = {"x_desc": desc([gll.BLOCK_M, block_k]), "w_desc": desc([block_n, block_k]), "scale_ptr": "*fp32",
           "bias_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16"}
    sig.update(dict.fromkeys(("M", "N", "K", "K_CHUNK", "CHUNKS", "stride_ym", "stride_rm"), "i32"))
    consts = dict(HAS_SCALE=scale, HAS_BIAS=False, HAS_RES=False, IN_PROGRAM=split_k > 1, BLOCK_M=gll.BLOCK_M,
                  BLOCK_N=block_n, BLOCK_K=block_k, STAGES=gll.dense_stages(block_k, block_n))
    sig.update(dict.fromkeys(consts, "constexpr"))
    return triton.compile(GluonASTSource(gll._dense_ws_kernel, sig, consts), target=H100,
                          options=dict(num_warps=4, maxnreg=gll.MAX_REGISTERS))


def compile_int8_warp_specialized(partial: bool = False,
                                  block_k: int = gll.INT8_BLOCK_K) -> triton.compiler.CompiledKernel:
    """The warp-specialized int8 GEMM (kernels/gluon_linear.py, w8a8) compiled for sm_90, as `int8_gemm` launches
    it (with `partial`, a piece of K's int32 sums)."""
    box = gll.INT8_BOX.value

    def desc(rows: int) -> str:
        return f"tensordesc<i8[{rows}, {box}],{gl.NVMMASharedLayout.get_default_for([rows, box], gl.int8)!r}>"

    sig = {"x_desc": desc(gll.BLOCK_M), "w_desc": desc(gll.INT8_BLOCK_N), "xs_ptr": "*fp32", "scale_ptr": "*fp32",
           "bias_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*i32" if partial else "*bf16"}
    sig.update(dict.fromkeys(("M", "N", "K", "K_PIECE", "PIECES", "stride_ym", "stride_rm"), "i32"))
    consts = dict(HAS_BIAS=False, HAS_RES=False, PARTIAL=partial, BLOCK_M=gll.BLOCK_M, BLOCK_N=gll.INT8_BLOCK_N,
                  BLOCK_K=block_k, STAGES=gll.int8_stages(block_k))
    sig.update(dict.fromkeys(consts, "constexpr"))
    return triton.compile(GluonASTSource(gll._int8_ws_kernel, sig, consts), target=H100,
                          options=dict(num_warps=4, maxnreg=gll.MAX_REGISTERS))


def compile_act_warp_specialized(block_k: int = 128, group: int = 128, in_program: bool = True,
                                 block_m: int = gll.ACT_BLOCK_M, ints: bool = False,
                                 partial: bool = False) -> triton.compiler.CompiledKernel:
    """The warp-specialized GEMM of INT4 codes with int8 activations (kernels/gluon_linear.py, w4a8 / w4a4)
    compiled for sm_90, as `nibble_act_gemm` launches it on an 8B layer; `ints`: INT4G's, as `int_scale_gemm`
    launches it."""
    q = block_k // 4

    def desc(dtype: str, shape: list[int], layout: object) -> str:
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{layout!r}>"

    row_n = desc("fp32", [1, gll.BLOCK_N], gll.ROW_LAYOUT)
    sig = {"x_desc": desc("i8", [block_m, q], gl.NVMMASharedLayout.get_default_for([block_m, q], gl.int8)),
           "w_desc": desc("i16", [gll.BLOCK_N, q], gl.NVMMASharedLayout.get_default_for([gll.BLOCK_N, q], gl.int16)),
           "scale_desc": row_n, "lo_desc": row_n, "sums_desc": desc("fp32", [1, block_m], gll.ROW_LAYOUT),
           "xs_ptr": "*fp32", "scale_ptr": "*fp32" if ints else "constexpr", "bias_ptr": "*bf16",
           "res_ptr": "*bf16", "y_ptr": "*i32" if partial else "*bf16"}
    sig.update(dict.fromkeys(("M", "N", "K", "K_CHUNK", "CHUNKS", "stride_ym", "stride_rm"), "i32"))
    consts = dict(GROUP=group, HAS_BIAS=False, HAS_RES=False, IN_PROGRAM=in_program and not ints, INTS=ints,
                  PARTIAL=partial,
                  BLOCK_M=block_m, BLOCK_N=gll.BLOCK_N, BLOCK_K=block_k,
                  STAGES=gll.nibble_act_stages(block_k, block_m, ints))
    if not ints:
        consts["scale_ptr"] = None
    return _compile_as_launched(gll._nibble_act_ws_kernel, sig, consts)


def compile_attention(in_program: bool, tails: bool, block_t: int = 16, warps: int = 8,
                      dim: int = 128) -> triton.compiler.CompiledKernel:
    """The bf16 attention's chunk kernel (or its in-program kernel), with or without tails (a tree's branch rows
    over one sequence's row), compiled for sm_90 (no launch, no GPU)."""
    kernel = ta._attention_in_program_kernel if in_program else ta._attention_chunk_kernel
    return compile_bf16_attention(kernel, dict(TAILS=tails), block_t, warps, dim)


def compile_tree_attention(block_t: int = 16, warps: int = 4, dim: int = 128) -> triton.compiler.CompiledKernel:
    """The tree attention's chunk kernel (each node's query once), compiled for sm_90 (no launch, no GPU)."""
    return compile_bf16_attention(ta._tree_chunk_kernel, {}, block_t, warps, dim)


def compile_bf16_attention(kernel: triton.JITFunction, flags: dict, block_t: int, warps: int,
                           dim: int) -> triton.compiler.CompiledKernel:
    """A bf16 attention kernel (the merge kernel too) for sm_90 with its tiles, flags (constexprs: TAILS, TILE_IN_BLOCK
    (default: key tiles within a block), ...) and the pointers, strides and block size 16-divisible, as a launch
    on heads of `dim` specializes them: compiled without that, every store reads as 2-byte and the registers are
    not the launch's."""
    consts = dict(D=dim, BLOCK_D=dim, BLOCK_T=block_t, BLOCK_S=ta.BLOCK_S, CHUNK=ta.CHUNK, TILE_IN_BLOCK=True,
                  PDL=False)
    consts = {name: value for name, value in {**consts, **flags}.items() if name in kernel.arg_names}
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*i64" if name in ("table_ptr", "tails_ptr", "pos_ptr", "first_ptr", "starts_ptr") else (
                "*bf16" if name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr") else "*fp32")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    aligned = [name for name in kernel.arg_names
               if name not in consts and (name.endswith("_ptr") or name.startswith("stride") or name == "BS")]
    return triton.compile(ASTSource(kernel, sig, consts, _divisible_by_16(kernel, aligned)), target=H100,
                          options=dict(num_warps=warps, num_stages=2))


def compile_quant_attention(fmt: str, upper: bool, block_r: int, warps: int, dim: int = 128, group: int = 128,
                            max_registers: int | None = None) -> triton.compiler.CompiledKernel:
    """The quantized attention's chunk kernel over `fmt` ("int8" or "hier"; the upper plane alone where `upper`)
    with tiles of block_r query rows on `warps` warps, compiled for sm_90 (no launch, no GPU)."""
    hier = fmt == "hier"
    sig = dict.fromkeys(("kq0", "kq1", "vq0", "vq1"), "*u8")
    sig.update(dict.fromkeys(("pos_ptr", "table_ptr", "buf_ptr", "start_ptr"), "*i64"))
    sig.update(dict.fromkeys(("ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr"), "*fp16"))
    sig.update(dict.fromkeys(("q_ptr", "kb_ptr", "vb_ptr"), "*bf16"))
    sig.update(dict.fromkeys(("m_ptr", "l_ptr", "acc_ptr"), "*fp32"))
    sig["sm_scale"] = "fp32"
    sig.update(dict.fromkeys(("T", "HQ", "HKV", "QBS", "W", "BS", "N_CHUNKS", "N_SLICES", "sqb", "sqh", "sqt"),
                             "i32"))
    consts = {**tqa.chunk_constants(group, dim, hier, upper), "BLOCK_R": block_r}
    sig.update(dict.fromkeys(consts, "constexpr"))
    # As a launch specializes them: tensors 16-byte aligned, block sizes (whole KV groups) multiples of 16.
    aligned = [name for name, kind in sig.items() if kind.startswith("*")] + ["QBS", "BS"]
    attrs = _divisible_by_16(tqa._quant_attention_chunks, aligned)
    return triton.compile(ASTSource(tqa._quant_attention_chunks, sig, consts, attrs), target=H100,
                          options=dict(num_warps=warps, num_stages=tqa.NUM_STAGES, maxnreg=max_registers))


def cuobjdump(kernel: triton.compiler.CompiledKernel, flag: str) -> str:
    """What Triton's bundled cuobjdump prints with `flag` for the kernel's cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def resources(kernel: triton.compiler.CompiledKernel) -> Resources:
    """What ptxas gave the compiled kernel (cuobjdump's resource usage of its cubin)."""
    usage = cuobjdump(kernel, "--dump-resource-usage")
    field = {name: int(value) for name, value in re.findall(r"(REG|STACK):(\d+)", usage)}
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return Resources(field["REG"], field["STACK"], kernel.metadata.shared, mma)


@dataclass(frozen=True)
class Loop:
    instructions: int  # SASS instructions a warp issues per trip
    ops: dict[str, int]  # by opcode (HMMA, LOP3, PRMT, ...)


def mma_loop(kernel: triton.compiler.CompiledKernel) -> Loop:
    """The innermost loop of the kernel's SASS that issues tensor-core instructions (a GEMM's K loop): the shortest
    backward branch whose body holds an MMA. What a decode tile issues per K tile, against what the SMs can issue
    while the weights stream (docs/gpu.md, session 13)."""
    loops = mma_loops(kernel)
    if not loops:
        raise ValueError("the kernel has no loop that issues MMA instructions")
    return loops[0]


def mma_loops(kernel: triton.compiler.CompiledKernel) -> list[Loop]:
    """Every loop of the kernel's SASS (a backward branch) whose body issues tensor-core instructions and holds no
    other such loop, shortest first: a GEMM's K loop; an attention kernel's loops over key tiles."""
    sass = cuobjdump(kernel, "-sass")
    code = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
            for m in [re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)] if m]
    spans = []
    for at, op, line in code:
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if op != "BRA" or target is None or int(target.group(1), 16) >= at:
            continue
        body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= at]
        if any(o in ("HMMA", "HGMMA", "IMMA", "IGMMA") for o in body):
            spans.append(((int(target.group(1), 16), at), body))
    inner = [body for span, body in spans
             if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o, _ in spans)]
    return sorted((Loop(len(body), dict(Counter(body))) for body in inner), key=lambda loop: loop.instructions)


def wgmma_serialized(kernel: triton.compiler.CompiledKernel) -> bool:
    """Whether ptxas serializes the kernel's wgmma (its C7511 warning: too few registers for the wgmma pipeline, so
    each wgmma waits for the one before): the kernel's PTX through the bundled ptxas again, which reports it."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "kernel.o")],
                             capture_output=True, text=True, check=True).stderr
    return "C7511" in log


def parse_tiles(text: str) -> tuple[int, int, int]:
    """'64x128x4' -> (block_m, block_n, warps)."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"tiles are BLOCK_MxBLOCK_NxWARPS, e.g. 64x128x4, got '{text}'")
    return int(parts[0]), int(parts[1]), int(parts[2])


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="full", choices=list(FORMATS))
    ap.add_argument("--tiles", type=parse_tiles, nargs="+", default=[(16, 128, 4), (32, 128, 4), (64, 128, 4)])
    ap.add_argument("--k", type=int, default=4096, help="the weight's K (input features)")
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--split", type=int, default=1, help="K chunks (walked in one program past 16 rows)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--swap", action="store_true", help="the weight tile as the dot's left operand")
    ap.add_argument("--shape", choices=list(SHAPES), default=None,
                    help="instead of --tiles: the tiles linear picks for each layer GEMM of this shape")
    ap.add_argument("--modes", nargs="+", default=["full", "upper", "w4a16", "w8a16", "w4a8"], choices=list(FORMATS),
                    help="with --shape")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 64, 160, 1024], help="with --shape: rows")
    ap.add_argument("--group", type=int, default=128, help="with --shape: the quantization group")
    ap.add_argument("--warp-specialized", action="store_true",
                    help="the warp-specialized GEMMs (kernels/gluon_linear.py) per format instead")
    ap.add_argument("--attention", action="store_true",
                    help="the quantized attention's tiles (16 and 32 query rows) per KV format instead")
    ap.add_argument("--warps", type=int, nargs="+", default=[tqa.NUM_WARPS], help="with --attention")
    ap.add_argument("--max-registers", type=int, nargs="+", default=None, metavar="N",
                    help="with --attention: registers per thread ptxas may use (default: the launch's, MAX_REGISTERS)")
    args = ap.parse_args(argv)
    if tlin.INTERPRETING:
        ap.error("TRITON_INTERPRET=1 is set: interpreted kernels do not compile; unset it")
    if args.attention:
        attention_table(args.warps, args.max_registers or [tqa.MAX_REGISTERS])
        return
    if args.warp_specialized:
        print("warp-specialized GEMMs (nibbles: K tiles of 128; bf16: of 64; w8a8: of 256 unless said), sm_90")
        print("| mode | stages | registers at launch | stack bytes | shared bytes | MMA | wgmma serialized |\n"
              "|---|---|---|---|---|---|---|")
        kernels = [(mode, gll.nibble_stages(FORMATS[mode], 128), compile_warp_specialized(mode))
                   for mode in ("w4a16", "upper", "full", "w8a16")]
        kernels += [(f"{mode} chunks apart", gll.nibble_stages(FORMATS[mode], 128),
                     compile_warp_specialized(mode, partial=True)) for mode in ("full", "w8a16")]
        kernels += [(f"{mode} 64 rows", gll.nibble_stages(FORMATS[mode], 128, 64),
                     compile_warp_specialized(mode, block_m=64)) for mode in ("w4a16", "full", "w8a16")]
        kernels += [(f"bf16 split {split}", "-", compile_dense_warp_specialized(64, split)) for split in (1, 4)]
        kernels.append(("bf16 split 4, 64 columns", "-", compile_dense_warp_specialized(64, 4, block_n=64)))
        kernels.append(("w8a16 scratch, split 4", "-", compile_dense_warp_specialized(128, 4, scale=True)))
        kernels += [(f"w8a8{' piece of K' if partial else ''}", gll.int8_stages(gll.INT8_BLOCK_K),
                     compile_int8_warp_specialized(partial)) for partial in (False, True)]
        kernels.append(("w8a8, K tiles of 128", gll.int8_stages(gll.INT8_SHORT_BLOCK_K),
                        compile_int8_warp_specialized(block_k=gll.INT8_SHORT_BLOCK_K)))
        kernels += [(f"w4a8 / w4a4, {rows} rows", gll.nibble_act_stages(128, rows),
                     compile_act_warp_specialized(block_m=rows)) for rows in (gll.ACT_BLOCK_M, 2 * gll.ACT_BLOCK_M)]
        kernels += [(f"w4a8 / w4a4 on int4g, {rows} rows{', piece of K' if partial else ''}",
                     gll.nibble_act_stages(128, rows, ints=True),
                     compile_act_warp_specialized(block_m=rows, ints=True, partial=partial))
                    for rows in (gll.INTS_BLOCK_M, 2 * gll.INTS_BLOCK_M) for partial in (False, True)]
        for name, stages, kernel in kernels:
            r = resources(kernel)
            print(f"| {name} | {stages} | {r.registers} | {r.stack_bytes} | {r.shared_bytes} | {r.mma} | "
                  f"{'yes' if wgmma_serialized(kernel) else 'no'} |")
        return
    if args.shape:
        shape_table(args.shape, args.modes, args.m, args.group)
        return
    print(f"{args.mode}, K {args.k} in tiles of {args.block_k}, split {args.split}, {args.stages} stages, sm_90")
    print("| tiles (M x N x warps) | registers | stack bytes | shared bytes | MMA |\n|---|---|---|---|---|")
    for block_m, block_n, warps in args.tiles:
        cfg = linear_tiles.TileConfig(block_n, args.block_k, args.split, warps, args.stages, args.swap, block_m,
                                      in_program=block_m > linear_tiles.BLOCK_M and args.split > 1)
        r = resources(compile_linear(args.mode, cfg, args.k))
        print(f"| {block_m} x {block_n} x {warps} | {r.registers} | {r.stack_bytes} | {r.shared_bytes} | {r.mma} |")


def unswizzled_tiles(kernel: triton.compiler.CompiledKernel) -> list[str]:
    """The kernel's shared-memory tiles (both dims over 1) laid out with no swizzle: rows that start on the same bank,
    so reading them in the tensor cores' operand layout conflicts. A load whose value feeds a register permute, not
    a dot, gets such a buffer from Triton's pipeliner (the decode tiles' x in quarter order: 1.3-2.3x their time on
    an H100, docs/gpu.md session 33)."""
    ir = kernel.asm["ttgir"]
    plain = set(re.findall(r"^(#shared\d*) = #ttg\.swizzled_shared<\{vec = 1, perPhase = 1, maxPhase = 1,", ir, re.M))
    tiles = re.findall(r"memdesc<(\d+(?:x\d+)*)x[a-z]\w*, (#shared\d*),", ir)  # shape, then element type
    return sorted({dims for dims, layout in tiles if layout in plain and all(int(d) > 1 for d in dims.split("x")[-2:])})


@dataclass(frozen=True)
class SharedLoad:
    tile: str  # e.g. "64x64xi8"
    load_bytes: int  # what a thread reads at once
    loads: int  # a warp's loads of the tile
    wavefronts: int  # what they take on the banks
    least: int  # what they would take without bank conflicts


def shared_loads(kernel: triton.compiler.CompiledKernel) -> list[SharedLoad]:
    """Each read of a 2-D shared-memory tile into registers of a linear layout (`ttg.local_load`), as one warp makes
    it: each thread's contiguous bytes a load (up to 16), and the wavefronts the loads take on the 32 banks of 4
    bytes, 8-byte loads served a half-warp at a time and 16-byte loads a quarter. A model from the Triton IR (the
    buffer's swizzle and the lanes' layout), not a measurement: it gives the 2-way conflicts Nsight Compute saw in
    the w4a8 decode tiles of session 34's quarter-order patch (H100, docs/gpu.md session 34). Reads straight into a
    dot operand (ldmatrix) are not modelled."""
    return shared_loads_of(kernel.asm["ttgir"])


def shared_loads_of(ir: str) -> list[SharedLoad]:
    """`shared_loads` of Triton IR text."""
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
    reads = re.findall(r"ttg\.local_load [^:]*: !ttg\.memdesc<(\d+)x(\d+)x([a-z]+)(\d+), (#\w+),[^>]*> -> "
                       r"tensor<[^,]+, (#\w+)>", ir)
    out = []
    for rows, cols, kind, bits, buffer, dest in reads:
        rows, cols, elem = int(rows), int(cols), int(bits) // 8
        offset = _shared_offset(layouts[buffer], rows, cols, elem)
        if offset is None or min(rows, cols) < 2 or not layouts.get(dest, "").startswith("#ttg.linear"):
            continue
        register, lane = _linear_bases(layouts[dest], "register"), _linear_bases(layouts[dest], "lane")
        vec = 0  # the leading register bases that step along a row: one thread's contiguous elements
        while vec < len(register) and register[vec] == (0, 1 << vec) and (2 << vec) * elem <= 16:
            vec += 1
        load = (1 << vec) * elem
        per_phase = 32 if load <= 4 else 128 // load  # lanes the banks serve at once
        wavefronts = 0
        rest = register[vec:]
        for r in range(1 << len(rest)):
            base = _combine(rest, r)
            words = [offset(*_xor(base, _combine(lane, ln))) // 4 for ln in range(32)]
            for p in range(0, 32, per_phase):
                banks: dict[int, set[int]] = {}
                for w in words[p:p + per_phase]:
                    for word in range(w, w + max(1, load // 4)):
                        banks.setdefault(word % 32, set()).add(word)
                wavefronts += max(len(ws) for ws in banks.values())
        loads = 1 << len(rest)
        out.append(SharedLoad(f"{rows}x{cols}x{kind}{bits}", load, loads, wavefronts,
                              loads * max(1, 32 * load // 128)))
    return out


def _linear_bases(layout: str, name: str) -> list[tuple[int, int]]:
    """A #ttg.linear layout's bases of one kind (register, lane): the (row, column) each bit of its index adds."""
    found = re.search(name + r" = \[((?:\[-?\d+, -?\d+\](?:, )?)*)\]", layout)
    return [(int(a), int(b)) for a, b in re.findall(r"\[(-?\d+), (-?\d+)\]", found.group(1))] if found else []


def _combine(bases: list[tuple[int, int]], index: int) -> tuple[int, int]:
    """The (row, column) of a linear layout's index: the XOR of the bases its set bits name."""
    at = (0, 0)
    for i, b in enumerate(bases):
        if index >> i & 1:
            at = _xor(at, b)
    return at


def _xor(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] ^ b[0], a[1] ^ b[1]


def _shared_offset(encoding: str, rows: int, cols: int, elem: int) -> Callable[[int, int], int] | None:
    """(row, column) -> byte offset in a [rows, cols] buffer of this shared encoding, or None where it is not
    modelled: the NVMMA swizzle (rows of at most the swizzle's width, wider tiles stored as column blocks of it;
    16-byte chunks XORed with the index of their 128-byte line) and Triton's swizzled_shared, row-major."""
    nvmma = re.search(r"nvmma_shared<\{swizzlingByteWidth = (\d+), transposed = false", encoding)
    plain = re.search(r"swizzled_shared<\{vec = (\d+), perPhase = (\d+), maxPhase = (\d+), order = \[1, 0\]",
                      encoding)
    if nvmma:
        width = int(nvmma.group(1)) or cols * elem
        mask = max(width // 16 - 1, 0)

        def offset(r: int, c: int) -> int:
            block, within = divmod(c * elem, width)
            o = (block * rows + r) * width + within
            return o ^ ((o >> 7 & mask) << 4)
        return offset
    if plain:
        vec, per, most = map(int, plain.groups())

        def offset(r: int, c: int) -> int:
            return r * cols * elem + ((c // vec ^ r // per % most) * vec + c % vec) * elem
        return offset
    return None


def shape_table(shape: str, modes: list[str], ms: list[int], group: int) -> None:
    """Registers and spills of the tile config `linear` picks (linear_tiles.tile_config) per layer GEMM, mode and M."""
    print(f"{shape}: the tiles linear picks, quantization group {group}, sm_90")
    print("| GEMM (N x K) | mode | M | tiles (M x N x warps, K tile, split, chunks in a program) | registers | "
          "stack bytes | MMA | K loop: instructions a warp (lane-instructions a weight) | shared reads: wavefronts "
          "/ least, a warp (`shared_loads`) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, n, k in layer_gemms(SHAPES[shape]):
        for mode in modes:
            fmt, act = FORMATS[mode], MODES[mode].act_bits is not None
            for m in ms:
                cfg = linear_tiles.tile_config(fmt, act, n, k, group if fmt >= linear_tiles.INT4.value else 0, m)
                kernel = compile_linear(mode, cfg, k, group)
                r, loop = resources(kernel), mma_loop(kernel)
                tiles = (f"{cfg.block_m} x {cfg.block_n} x {cfg.num_warps}, {cfg.block_k}, {cfg.split_k}, "
                         f"{'yes' if cfg.in_program else 'no'}")
                per_weight = loop.instructions * cfg.num_warps * 32 / (cfg.block_n * cfg.block_k)
                reads = ", ".join(f"{t.tile} {t.wavefronts} / {t.least}" for t in shared_loads(kernel)) or "-"
                print(f"| {name} ({n} x {k}) | {mode} | {m} | {tiles} | {r.registers} | {r.stack_bytes} | {r.mma} | "
                      f"{loop.instructions} ({per_weight:.2f}) | {reads} |")


def attention_table(warps: list[int], max_registers: list[int | None]) -> None:
    print("quantized attention, Llama-3-8B heads (head dim 128), KV group 128, sm_90")
    print("| query rows x warps | KV read | register cap | registers | stack bytes | shared bytes | MMA |\n"
          "|---|---|---|---|---|---|---|")
    for name, (fmt, upper) in (("int8", ("int8", False)), ("hier both planes", ("hier", False)),
                               ("hier upper plane", ("hier", True))):
        for block_r in (tqa.TILE_ROWS, 2 * tqa.TILE_ROWS):  # the tile, and the taller one it does not use
            for w in warps:
                for cap in max_registers:
                    r = resources(compile_quant_attention(fmt, upper, block_r, w, max_registers=cap))
                    print(f"| {block_r} x {w} | {name} | {cap or '-'} | {r.registers} | {r.stack_bytes} "
                          f"| {r.shared_bytes} | {r.mma} |")


if __name__ == "__main__":
    main()
