"""Triton row-wise ops: rms_norm, rope_and_store (rotate-half RoPE + KV store), swiglu, the sum of a GEMM's K
chunks. One program per row or token (or elementwise): a row's output never depends on how many rows there are."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from selfspec.errors import SelfspecError
from selfspec.kernels import ops, register
from selfspec.kernels.launch import cdiv, launch_options, next_power_of_2, wait
from selfspec.kernels.reference import rope_and_store as reference_rope_and_store

# The producers of a GEMM's input (rms_norm, swiglu) can also write its int8 codes and their row sums per this many
# columns, which the nibble GEMMs with int8 activations need for their group offsets (triton_linear): summed once
# per row here, not once per N tile there.
ROW_SUM_COLS = tl.constexpr(ops.ROW_SUM_COLS)


def row_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@triton.jit
def store_row_sums(y, sums_ptr, first, count):
    """The fp32 sums of the values y [BLOCK] (codes) per ROW_SUM_COLS columns, stored as the sums first .. first +
    BLOCK / ROW_SUM_COLS of a row that has `count`: a GEMM reading y takes them instead of summing its tiles of y
    itself (triton_linear's nibble kernel)."""
    n: tl.constexpr = y.shape[0] // ROW_SUM_COLS
    sums = tl.sum(tl.reshape(y.to(tl.float32), (n, ROW_SUM_COLS)), axis=1)
    idx = first + tl.arange(0, n)
    tl.store(sums_ptr + idx, sums, mask=idx < count)


@triton.jit
def round_half_even(v):
    # Adding 1.5 * 2^23 leaves no fraction bits, so the add rounds to an integer (ties to even, as torch.round)
    # for |v| < 2^22; Triton does not reassociate float adds, so the pair is not folded away.
    return (v + 12582912.0) - 12582912.0


@triton.jit
def row_scale(amax, QMAX: tl.constexpr):
    """A row's per-token scale from its largest magnitude: max(amax / QMAX, 1e-8) (quant/act.py)."""
    return tl.maximum(tl.math.div_rn(amax, QMAX), 1e-8)


@triton.jit
def row_codes(v, scale, QMAX: tl.constexpr):
    """fp32 values -> their codes under a row's scale, round(v / scale) clamped to +-QMAX (still fp32)."""
    return tl.minimum(tl.maximum(round_half_even(tl.math.div_rn(v, scale)), -QMAX), QMAX)


@triton.jit
def store_row_codes(y, q_ptr, s_ptr, sums_ptr, row, D, offs, mask, QMAX: tl.constexpr, SUMS: tl.constexpr):
    """A whole row's per-token codes and scale, as act_quant makes them from y (zeros past D change no max and no
    sum), and with SUMS the codes' sums: what a producer hands an int8-activation linear."""
    yf = y.to(tl.float32)
    scale = row_scale(tl.max(tl.abs(yf), axis=0), QMAX)
    q = row_codes(yf, scale, QMAX)
    tl.store(q_ptr + row * D + offs, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)
    if SUMS:
        store_row_sums(q, sums_ptr + row * (D // ROW_SUM_COLS), 0, D // ROW_SUM_COLS)


@triton.jit
def quartered_columns(offs, QUARTERED: tl.constexpr):
    """Where column offs of a row goes with each QUARTERED-column K tile's columns quartered (column 4j + t of a tile
    at t * QUARTERED / 4 + j: gluon_linear.quartered's order); 0: where it is."""
    if QUARTERED:
        r = offs % QUARTERED
        return offs - r + (r % 4) * (QUARTERED // 4) + r // 4
    return offs


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, sums_ptr, q_ptr, s_ptr, D, stride_x, eps, QMAX: tl.constexpr,
                     BLOCK: tl.constexpr, SUMS: tl.constexpr, QUANT: tl.constexpr, QUARTERED: tl.constexpr,
                     PDL: tl.constexpr):
    """One row's norm; with QUANT its per-token codes and scale too (and with SUMS the codes' sums); with QUARTERED
    its columns stored quartered (`quartered_columns`)."""
    wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * r * w).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * D + quartered_columns(offs, QUARTERED), y, mask=mask)
    if QUANT:
        store_row_codes(y, q_ptr, s_ptr, sums_ptr, row, D, offs, mask, QMAX, SUMS)


def _sums_buffer(rows: int, d: int, like: torch.Tensor) -> torch.Tensor | None:
    """[rows, d / ROW_SUM_COLS] fp32 for a producer's row sums; None where d is not a multiple of it."""
    if d % ROW_SUM_COLS.value:
        return None
    return torch.empty((rows, d // ROW_SUM_COLS.value), dtype=torch.float32, device=like.device)


def _handover_buffers(rows: int, d: int, like: torch.Tensor, act_bits: int | None,
                      quartered: int = 0) -> ops.Handover:
    """Empty buffers for what a producer of x [rows, d] hands its linear: with act_bits its codes, their scales and
    the codes' sums; for bf16 activations x quartered where asked (`quarters_input`, prompt or generated rows) and
    d is whole tiles of it."""
    if act_bits is None:
        return ops.Handover(quartered=quartered if quartered and d % quartered == 0 else 0)
    return ops.Handover(sums=_sums_buffer(rows, d, like),
                        codes=torch.empty((rows, d), dtype=torch.int8, device=like.device),
                        scale=torch.empty((rows, 1), dtype=torch.float32, device=like.device), bits=act_bits)


def qmax(act_bits: int | None) -> float:
    """The largest code of act_bits-bit activations (0 for none: a constexpr the kernels do not read then)."""
    return 2.0 ** (act_bits - 1) - 1 if act_bits else 0.0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, act_bits: int | None = None,
              quartered: int = 0) -> tuple[torch.Tensor, ops.Handover | None]:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = next_power_of_2(d)
    out = _handover_buffers(x2.shape[0], d, x, act_bits, quartered)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, out.sums, out.codes, out.scale, d, x2.stride(0), eps,
                                    QMAX=qmax(act_bits), BLOCK=block, SUMS=out.sums is not None,
                                    QUANT=out.codes is not None, QUARTERED=out.quartered,
                                    num_warps=row_warps(block), **launch_options())
    return y.view(x.shape), _given(out)


def _given(out: ops.Handover) -> ops.Handover | None:
    """The handover, or None where it carries nothing."""
    return None if out.sums is None and out.codes is None and not out.quartered else out


@register("rms_norm", "", "cuda")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps)[0]


@register("rms_norm_handover", "", "cuda")
def rms_norm_handover(x: torch.Tensor, weight: torch.Tensor, eps: float, act_bits: int | None = None,
                      quartered: int = 0) -> tuple[torch.Tensor, ops.Handover | None]:
    """rms_norm, and (kernels/ops.py `Handover`) with act_bits its output's per-token codes, scales and the codes'
    sums per ROW_SUM_COLS columns (sums None where D is not a multiple of it); without them, with `quartered` the
    output written quartered (where D is whole tiles of it); else None."""
    return _rms_norm(x, weight, eps, act_bits, quartered)


@triton.jit
def _rotate_half(x_ptr, offs, mask, c1, c2, s1, s2, HALF: tl.constexpr):
    """RoPE of the rows at x_ptr + offs (their first halves) in fp32, each product rounded as in the reference."""
    x1 = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_and_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_pool_ptr, v_pool_ptr,
                           T, HQ, HKV, BS, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                           stride_vb, stride_vh, stride_vt, stride_kpn, stride_kph, stride_kps,
                           stride_vpn, stride_vph, stride_vps,
                           HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                           PDL: tl.constexpr):
    wait(PDL)
    row = tl.program_id(0)  # one (b, t) token with all its heads: its angles and its slot are loaded once
    b = row // T
    t = row % T
    offs = tl.arange(0, BLOCK)[None, :]
    in_half = offs < HALF
    cs_row = row * 2 * HALF  # cos/sin [B, T, D]: each row's own positions
    c1 = tl.load(cos_ptr + cs_row + offs, mask=in_half, other=0)
    c2 = tl.load(cos_ptr + cs_row + HALF + offs, mask=in_half, other=0)
    s1 = tl.load(sin_ptr + cs_row + offs, mask=in_half, other=0)
    s2 = tl.load(sin_ptr + cs_row + HALF + offs, mask=in_half, other=0)

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (hq < HQ) & in_half
    q1, q2 = _rotate_half(q_ptr + b * stride_qb + t * stride_qt, hq * stride_qh + offs, q_mask, c1, c2, s1, s2, HALF)
    q_out = q_out_ptr + ((b * HQ + hq) * T + t) * 2 * HALF + offs  # [B, Hq, T, D], contiguous
    dtype = q_out_ptr.dtype.element_ty
    tl.store(q_out, q1.to(dtype), mask=q_mask)
    tl.store(q_out + HALF, q2.to(dtype), mask=q_mask)

    slot = tl.load(slots_ptr + row)
    hkv = tl.arange(0, BLOCK_HKV)[:, None]
    kv_mask = (hkv < HKV) & in_half
    k1, k2 = _rotate_half(k_ptr + b * stride_kb + t * stride_kt, hkv * stride_kh + offs, kv_mask, c1, c2, s1, s2, HALF)
    k_dst = k_pool_ptr + (slot // BS) * stride_kpn + (slot % BS) * stride_kps + hkv * stride_kph + offs
    tl.store(k_dst, k1.to(dtype), mask=kv_mask)
    tl.store(k_dst + HALF, k2.to(dtype), mask=kv_mask)
    v_src = v_ptr + b * stride_vb + t * stride_vt + hkv * stride_vh + offs
    v_dst = v_pool_ptr + (slot // BS) * stride_vpn + (slot % BS) * stride_vps + hkv * stride_vph + offs
    tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


@register("rope_and_store", "", "cuda")
def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The reference rope_and_store (kernels/ops.py) in one launch, one program per token; q, k, v any strides."""
    if not q.dtype == k.dtype == v.dtype == k_pool.dtype == v_pool.dtype == torch.bfloat16:
        return reference_rope_and_store(q, k, v, cos, sin, k_pool, v_pool, slots)  # bf16 only, like attention
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise SelfspecError("the KV pools must be contiguous along head_dim")
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin, slots = cos.float().contiguous(), sin.float().contiguous(), slots.contiguous()
    q_out = torch.empty((b, hq, t, d), dtype=q.dtype, device=q.device)
    block = next_power_of_2(d // 2)
    block_hq = next_power_of_2(hq)
    # No mul + add fused into an fma: the reference rounds each product, and the bits must match it.
    _rope_and_store_kernel[(b * t,)](
        q, k, v, cos, sin, slots, q_out, k_pool, v_pool, t, hq, hkv, k_pool.shape[2], *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], *k_pool.stride()[:3], *v_pool.stride()[:3], HALF=d // 2, BLOCK=block,
        BLOCK_HQ=block_hq, BLOCK_HKV=next_power_of_2(hkv), num_warps=row_warps(block_hq * block),
        enable_fp_fusion=False, **launch_options(),
    )
    return q_out


@triton.jit
def _swiglu_values(g_ptr, u_ptr, offs, mask, dtype: tl.constexpr):
    g = tl.load(g_ptr + offs, mask=mask, other=0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0).to(tl.float32)
    silu = (g / (1 + tl.exp(-g))).to(dtype)  # F.silu rounds to the input dtype before the product
    return (silu.to(tl.float32) * u).to(dtype)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, H, stride_g, stride_u, BLOCK: tl.constexpr, QUARTERED: tl.constexpr,
                   PDL: tl.constexpr):
    """A BLOCK of one row's swiglu, its columns stored quartered with QUARTERED (`quartered_columns`: BLOCK holds
    whole tiles)."""
    wait(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    y = _swiglu_values(g_ptr + row * stride_g, u_ptr + row * stride_u, offs, mask, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * H + quartered_columns(offs, QUARTERED), y, mask=mask)


@triton.jit
def _swiglu_codes_kernel(g_ptr, u_ptr, y_ptr, q_ptr, s_ptr, sums_ptr, H, stride_g, stride_u, QMAX: tl.constexpr,
                         BLOCK: tl.constexpr, SUMS: tl.constexpr, PDL: tl.constexpr):
    """swiglu of one whole row (its scale needs every value) and its per-token codes."""
    wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    y = _swiglu_values(g_ptr + row * stride_g, u_ptr + row * stride_u, offs, mask, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * H + offs, y, mask=mask)
    store_row_codes(y, q_ptr, s_ptr, sums_ptr, row, H, offs, mask, QMAX, SUMS)


# The widest row whose codes swiglu writes (one program holds it whole); wider rows leave them to the linear.
CODES_MAX_COLS = 32768


def _swiglu(gate: torch.Tensor, up: torch.Tensor, act_bits: int | None = None,
            quartered: int = 0) -> tuple[torch.Tensor, ops.Handover | None]:
    h = gate.shape[-1]
    g2, u2 = (z.reshape(-1, h) for z in (gate, up))
    g2, u2 = (z if z.stride(-1) == 1 else z.contiguous() for z in (g2, u2))
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if act_bits is not None and h > CODES_MAX_COLS:
        act_bits = None
    out = _handover_buffers(g2.shape[0], h, gate, act_bits, quartered)
    if out.codes is not None:
        block = next_power_of_2(h)
        _swiglu_codes_kernel[(g2.shape[0],)](g2, u2, y, out.codes, out.scale, out.sums, h, g2.stride(0),
                                             u2.stride(0), QMAX=qmax(act_bits), BLOCK=block,
                                             SUMS=out.sums is not None, num_warps=row_warps(block), **launch_options())
    else:
        _swiglu_kernel[(g2.shape[0], cdiv(h, 1024))](g2, u2, y, h, g2.stride(0), u2.stride(0), BLOCK=1024,
                                                     QUARTERED=out.quartered, num_warps=4, **launch_options())
    return y.view(gate.shape), _given(out)


@register("swiglu", "", "cuda")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., H]: rows may be strided (the two halves of one fused gate/up output), not copied."""
    return _swiglu(gate, up)[0]


@register("swiglu_handover", "", "cuda")
def swiglu_handover(gate: torch.Tensor, up: torch.Tensor, act_bits: int | None = None,
                    quartered: int = 0) -> tuple[torch.Tensor, ops.Handover | None]:
    """swiglu, and what it hands its linear (as `rms_norm_handover`)."""
    return _swiglu(gate, up, act_bits, quartered)


@triton.jit
def _sum_chunks_kernel(part_ptr, xs_ptr, scale_ptr, bias_ptr, res_ptr, y_ptr, M, N, stride_rm, SPLIT: tl.constexpr,
                       LIVE: tl.constexpr, SCALES: tl.constexpr, CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = (0 + part[0] + part[1] + ...) (+ bias) rounded to bf16 (+ res): the warp-specialized nibble GEMM's chunk
    sum and store (kernels/gluon_linear.py), the split's chunks past K (past LIVE) adding their zeros as its
    consumers' do. With SCALES, the int8 GEMM's: int32 pieces added exactly, converted, times the row scale and
    the channel scale, as its epilogue does; with CHANNEL, INT8 codes' fp32 sums times the channel scale."""
    wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros([BLOCK], dtype=tl.int32 if SCALES else tl.float32)
    for s in tl.static_range(SPLIT):  # in chunk order, as the consumers add them
        if s < LIVE:
            total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0)
        else:
            total += 0
    total = total.to(tl.float32)
    if SCALES:
        total = total * tl.load(xs_ptr + offs // N, mask=mask, other=0)
        total = total * tl.load(scale_ptr + offs % N, mask=mask, other=0)
    elif CHANNEL:
        total = total * tl.load(scale_ptr + offs % N, mask=mask, other=0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0).to(tl.float32)
    y = total.to(tl.bfloat16)
    if HAS_RES:
        r = tl.load(res_ptr + (offs // N) * stride_rm + offs % N, mask=mask, other=0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
    tl.store(y_ptr + offs, y, mask=mask)


def sum_chunks(part: torch.Tensor, split: int, bias: torch.Tensor | None, r2: torch.Tensor | None,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None,
               channel: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 sums part [live, M, N] of the first `live` of a split's chunks (the rest hold no columns), added in
    order, (times `channel`, INT8 codes' channel scales [N],) + bias, rounded, + r2 -> y [M, N] bf16. With scales
    (row scales [M], channel scales [N]): int32 sums, scaled after they are added (the int8 GEMM)."""
    live, m, n = part.shape
    y = torch.empty((m, n), dtype=torch.bfloat16, device=part.device)
    xs, scale = scales if scales is not None else (None, channel)
    block = 1024
    _sum_chunks_kernel[(cdiv(m * n, block),)](part, xs, scale, bias, r2, y, m, n,
                                             0 if r2 is None else r2.stride(0), SPLIT=split, LIVE=live,
                                             SCALES=scales is not None, CHANNEL=channel is not None,
                                             HAS_BIAS=bias is not None,
                                             HAS_RES=r2 is not None, BLOCK=block, num_warps=4,
                                             **launch_options())
    return y
