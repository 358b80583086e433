"""Compile the prototype w8a16 decode kernel (docs/leads/w8a16-gluon-decode.patch applied) for sm_90, no GPU:
registers, spills, shared memory, and whether any layout conversion is left in its TTGIR.

git apply docs/leads/w8a16-gluon-decode.patch && python docs/leads/w8a16_gluon_decode_compile.py"""
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from selfspec.bench import kernel_resources as kr
from selfspec.kernels import gluon_linear as gll


def compile_decode(split_k: int, block_k: int = 128) -> triton.compiler.CompiledKernel:
    q = block_k // 4
    layout = gl.NVMMASharedLayout.get_default_for([gll.DECODE_BLOCK_N, q], gl.int32)
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    sig = {"x_desc": f"tensordesc<bf16[16, {block_k}],{x_layout!r}>",
           "w_desc": f"tensordesc<i32[{gll.DECODE_BLOCK_N}, {q}],{layout!r}>",
           "scale_ptr": "*fp32", "bias_ptr": "*bf16", "res_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "count_ptr": "*i32"}
    sig.update(dict.fromkeys(("M", "N", "K", "K_CHUNK", "stride_ym", "stride_rm"), "i32"))
    consts = dict(HAS_BIAS=False, HAS_RES=False, SPLIT_K=split_k, BLOCK_N=gll.DECODE_BLOCK_N, BLOCK_K=block_k,
                  STAGES=gll.DECODE_STAGES)
    if split_k == 1:
        consts["part_ptr"] = None
    sig.update(dict.fromkeys(consts, "constexpr"))
    return triton.compile(GluonASTSource(gll._int8_decode_kernel, sig, consts), target=kr.H100,
                          options=dict(num_warps=4))


for split in (1, 8):
    kernel = compile_decode(split)
    conversions = [line.strip() for line in kernel.asm["ttgir"].splitlines() if "convert_layout" in line]
    print(f"split {split}: {kr.resources(kernel)}, {len(conversions)} layout conversions")
