"""Probe: w4a16 as 'bf16 weights built in registers, one accumulator over K' (dequantize-then-MMA).

w_bf16 = round_bf16(c * s_b + lo_b) (one bf16x2 FMA per two weights, scales and offsets stored in bf16), then
acc = sum over K tiles of x @ w_bf16^T in fp32, K tiles of 128 (one group) as four dots of 32 (codes read as 16-bit
words, k = 4j + t), the split's chunks added in order. Checks each tile config's bits against the 16-row decode
config on all rows, and times it against today's w4a16 linear and cuBLAS BF16 (CUDA graphs, weights past L2).

A probe, not part of the package (H100, 2026-11-26, dequant-mma-probe.json):
PYTHONPATH=. python docs/bench-h100/dequant-mma-probe.py --m 1 16 160 1024 --json out.json
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

from selfspec.bench.device import copies_past_l2, graph_time_ms
from selfspec.bench.shapes import SHAPES, layer_gemms
from selfspec.kernels import triton_linear as tlin
from selfspec.kernels import linear_tiles as tiles
from selfspec.kernels.reference import row_sums
from selfspec.kernels.semaphores import group_counts, last_to_arrive
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# bf16x2: t = (128 + c) - 128 exactly, then w = t * s + lo rounded once.
FMA_ASM = tl.constexpr("{\n.reg .b32 t, k;\nmov.b32 k, 0x43004300;\nsub.bf16x2 t, $1, k;\n"
                       "fma.rn.bf16x2 $0, t, $2, $3;\n}\n")


@triton.jit
def _weights(c, s, lo, ASM: tl.constexpr):
    s = tl.broadcast_to(s[:, None], c.shape)
    lo = tl.broadcast_to(lo[:, None], c.shape)
    if ASM:
        return tl.inline_asm_elementwise(FMA_ASM, "=r,r,r,r", [c, s, lo], dtype=tl.bfloat16, is_pure=True, pack=2)
    return ((c.to(tl.float32) - 128.0) * s.to(tl.float32) + lo.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _chunk(x_ptr, w_desc, s_ptr, lo_ptr, offs_m, offs_n, n0, k_start, k_end, M, N, K, stride_xm,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
           ASM: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_start + tl.arange(0, BLOCK_K)[None, :]
    x_mask = (offs_m < M)[:, None]
    n_mask = offs_n < N
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=x_mask, other=0)
        x0, x1, x2, x3 = tlin._quarters(x)
        c0, c1, c2, c3 = tlin._word_codes(w_desc.load([n0, k0 // 4]), ASM)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0)
        lo = tl.load(lo_ptr + g * N + offs_n, mask=n_mask, other=0)
        acc = tl.dot(x0, tl.trans(_weights(c0, s, lo, ASM)), acc)
        acc = tl.dot(x1, tl.trans(_weights(c1, s, lo, ASM)), acc)
        acc = tl.dot(x2, tl.trans(_weights(c2, s, lo, ASM)), acc)
        acc = tl.dot(x3, tl.trans(_weights(c3, s, lo, ASM)), acc)
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _kernel(x_ptr, w_desc, s_ptr, lo_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_CHUNK, CHUNKS, stride_xm,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
            SPLIT_K: tl.constexpr, IN_PROGRAM: tl.constexpr, ASM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if IN_PROGRAM:  # the split's chunks, each from zero, added in order
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(0, CHUNKS):
            acc += _chunk(x_ptr, w_desc, s_ptr, lo_ptr, offs_m, offs_n, pid_n * BLOCK_N, c * K_CHUNK,
                          tl.minimum(K, (c + 1) * K_CHUNK), M, N, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, ASM)
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=mask)
    else:
        pid_k = tl.program_id(2)
        acc = _chunk(x_ptr, w_desc, s_ptr, lo_ptr, offs_m, offs_n, pid_n * BLOCK_N, pid_k * K_CHUNK,
                     tl.minimum(K, (pid_k + 1) * K_CHUNK), M, N, K, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, ASM)
        if SPLIT_K == 1:
            tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=mask)
        else:
            tile_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.store(tile_ptrs + pid_k * M * N, acc, mask=mask)
            if last_to_arrive(count_ptr + pid_m * tl.num_programs(1) + pid_n, SPLIT_K):
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(tile_ptrs + s * M * N, mask=mask, other=0, cache_modifier=".cg")
                tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], total.to(tl.bfloat16), mask=mask)


class Weight:
    """w4a16 codes as 16-bit words [N, K / 4], bf16 scales and offsets [K / G, N]."""

    def __init__(self, w: torch.Tensor, group: int = 128):
        q = quantize_weight(w, "int4", group)
        self.n, self.k, self.group = w.shape[0], w.shape[1], group
        self.words = q.packed.contiguous().view(torch.int16)
        self.s = q.scale.t().contiguous().bfloat16()  # [K / G, N]
        self.lo = q.lo.t().contiguous().bfloat16()
        self.q = q

    def dense(self) -> torch.Tensor:
        """The weights as the kernel builds them (one rounding of c s + lo: float64, then bf16 via float32)."""
        from selfspec.quant.formats import unpack_nibbles
        c = unpack_nibbles(self.q.packed).double()  # [N, K]
        s = self.s.t().double().repeat_interleave(self.group, dim=1)
        lo = self.lo.t().double().repeat_interleave(self.group, dim=1)
        return (c * s + lo).float().bfloat16()


def run(x: torch.Tensor, w: Weight, cfg: tuple, split: int) -> torch.Tensor:
    block_m, block_n, warps, stages, in_program = cfg
    in_program = in_program and split > 1  # one chunk: one accumulator
    m, k = x.shape
    n = w.n
    block_k = 128
    chunk = tiles.k_chunk(k, split, block_k)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    desc = tlin.TensorDescriptor.from_tensor(w.words, [block_n, block_k // 4])
    grid_split = 1 if in_program else split
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), grid_split)
    part = torch.empty(grid_split * m * n if grid_split > 1 else 1, dtype=torch.float32, device=x.device)
    counts = group_counts(x.device, grid[0] * grid[1])
    _kernel[grid](x, desc, w.s, w.lo, y, part, counts, m, n, k, chunk, split, x.stride(0), BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=block_k, GROUP=w.group, SPLIT_K=grid_split, IN_PROGRAM=in_program,
                  ASM=not INTERPRET, num_warps=warps, num_stages=stages)
    return y


DECODE = [(16, 128, 4, 3, False), (16, 64, 4, 3, False), (16, 256, 8, 3, False)]
MANY = [(32, 128, 4, 3, True), (64, 128, 4, 3, True), (64, 128, 8, 3, True), (64, 256, 8, 3, True),
        (128, 128, 8, 3, True), (128, 256, 8, 3, True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 32, 160, 256, 1024, 4096])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    mode = MODES["w4a16"]
    rows = []
    for gemm, n, k in layer_gemms(SHAPES[args.shape]):
        base = tiles.decode_config(tiles.INT4.value, False, n, k, 128)
        split = base.split_k
        copies = copies_past_l2(n * k // 2)
        ws = [Weight(torch.randn(n, k, device=dev) * 0.02) for _ in range(copies)]
        ours = [quantize_weight(torch.randn(n, k, device=dev) * 0.02, "int4", 128) for _ in range(copies)]
        dense = [torch.randn(n, k, device=dev).bfloat16() * 0.02 for _ in range(copies)]
        w = ws[0]
        wd = w.dense()
        for m in args.m:
            x = torch.randn(m, k, device=dev).bfloat16()
            sums = row_sums(x)
            ref = run(x, w, DECODE[0], split)
            err = ((ref.float() - x.float() @ wd.float().t()).norm() / (x.float() @ wd.float().t()).norm()).item()
            row = {"gemm": gemm, "n": n, "k": k, "m": m, "split": split, "rel_err_vs_dense": err,
                   "today_us": 1000 * graph_time_ms([lambda q=q: tlin.linear(x, q, mode, None, sums=sums)
                                                     for q in ours]),
                   "cublas_us": 1000 * graph_time_ms([lambda d=d: torch.nn.functional.linear(x, d) for d in dense]),
                   "configs": []}
            for cfg in DECODE + (MANY if m > 16 else []):
                try:
                    y = run(x, w, cfg, split)
                    same = torch.equal(y, ref)
                    us = 1000 * graph_time_ms([lambda v=v: run(x, v, cfg, split) for v in ws])
                    row["configs"].append({"cfg": cfg, "us": us, "bitwise": same})
                except Exception as e:  # noqa: BLE001
                    row["configs"].append({"cfg": cfg, "error": str(e)[:160]})
            rows.append(row)
            best = min((c for c in row["configs"] if "us" in c), key=lambda c: c["us"])
            nbad = sum(1 for c in row["configs"] if c.get("bitwise") is False)
            print(f"{gemm:8s} M={m:5d} today {row['today_us']:7.1f} cuBLAS {row['cublas_us']:7.1f} probe best "
                  f"{best['us']:7.1f} {best['cfg']} (x cuBLAS {best['us'] / row['cublas_us']:.2f}) not bitwise "
                  f"{nbad} err {err:.1e} | " + " ".join(f"{c['cfg'][0]}x{c['cfg'][1]}:{c['us']:.0f}"
                                                        for c in row["configs"] if "us" in c), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
