"""The linear kernels' inline PTX (kernels/ptx.py), run here by a small emulator of the instructions it uses (the
interpreter in CI runs the kernels' integer-op twins instead; the GPU tests run the PTX itself): each block turns
packed bytes or words of the stored codes into the values the tensor cores read, exactly."""
import re

import numpy as np
import torch

from selfspec.kernels import ptx

MASK = 0xFFFFFFFF


def bf16_bits(values) -> np.ndarray:
    return torch.tensor(np.asarray(values, dtype=np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def f16_values(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits).astype(np.uint16).view(np.float16).astype(np.float32)


def bf16_of_float64(v: np.ndarray) -> np.ndarray:
    """bf16 bits of float64 values, rounded once to nearest even: through float32 rounded to odd (truncated, its
    last bit set where inexact), whose extra bits keep the second rounding from changing the result."""
    f = v.astype(np.float32)
    bits = f.view(np.uint32).copy()
    inexact = f.astype(np.float64) != v
    bits[inexact & (np.abs(f.astype(np.float64)) > np.abs(v))] -= 1  # rounded away from zero: truncate
    bits[inexact] |= 1
    return bf16_bits(bits.view(np.float32))


def run_ptx(text: str, inputs: list[np.ndarray], outputs: int) -> list[np.ndarray]:
    """Run an asm block of and/or/xor/shl/shr/mov/prmt/lop3 .b32, sub.bf16x2 / sub.f16x2 and fma.rn.bf16x2 on uint32
    arrays; operands $0.. are the outputs, then the inputs."""
    regs = {f"${outputs + i}": v.astype(np.uint64) for i, v in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        if tok.startswith("0x"):
            return np.uint64(int(tok, 16))
        return np.uint64(int(tok)) if tok.isdigit() else regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *args = [a.strip() for a in rest.split(",")]
        a = [val(x) for x in args]
        if op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "shl.b32":
            r = (a[0] << a[1]) & MASK
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "mov.b32":
            r = a[0]
        elif op == "not.b32":
            r = ~a[0] & MASK
        elif op == "mul.lo.u32":
            r = (a[0] * a[1]) & MASK
        elif op == "sub.u32":
            r = (a[0] - a[1]) & MASK
        elif op == "lop3.b32":  # bit by bit, the lookup table's bit at index 4a + 2b + c
            lut = int(args[3], 16)
            r = sum(((lut >> (4 * ((a[0] >> np.uint64(i)) & 1) + 2 * ((a[1] >> np.uint64(i)) & 1)
                              + ((a[2] >> np.uint64(i)) & 1)).astype(np.int64)) & 1).astype(np.uint64) << np.uint64(i)
                    for i in range(32))
        elif op == "prmt.b32":  # bytes of {b, a} picked by the selector's nibbles
            pool = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            sel = int(args[2], 16)
            r = sum(pool[(sel >> (4 * i)) & 7] << np.uint64(8 * i) for i in range(4))
        elif op in ("sub.bf16x2", "sub.f16x2"):
            to_bits, values = (bf16_bits, bf16_values) if op == "sub.bf16x2" else (f16_bits, f16_values)
            r = np.zeros_like(np.broadcast_to(a[0], np.broadcast(a[0], a[1]).shape))
            for s in (np.uint64(0), np.uint64(16)):
                diff = values((a[0] >> s) & np.uint64(0xFFFF)) - values((a[1] >> s) & np.uint64(0xFFFF))
                r = r | (to_bits(diff).astype(np.uint64) << s)
        elif op == "fma.rn.bf16x2":  # a * b + c exactly (float64), then rounded once to bf16
            r = np.zeros_like(np.broadcast_to(a[0], np.broadcast(a[0], a[1], a[2]).shape))
            for s in (np.uint64(0), np.uint64(16)):
                x, y, z = (bf16_values((v >> s) & np.uint64(0xFFFF)).astype(np.float64) for v in a)
                r = r | (bf16_of_float64(x * y + z).astype(np.uint64) << s)
        else:
            raise AssertionError(f"instruction {op} not emulated")
        regs[d] = np.asarray(r, dtype=np.uint64) & MASK
    return [regs[f"${i}"].astype(np.uint32) for i in range(outputs)]


def halves(reg: np.ndarray) -> np.ndarray:
    """A register of two bf16 (element 0 in the low half) -> their values [n, 2]."""
    return np.stack([bf16_values((reg & 0xFFFF).astype(np.uint16)), bf16_values((reg >> 16).astype(np.uint16))], 1)


def words(rng, n):
    """n registers of two random 16-bit words (element 0 in the low half) and the words themselves [n, 2]."""
    w = rng.integers(0, 1 << 16, size=(n, 2), dtype=np.uint64)
    return (w[:, 0] | (w[:, 1] << np.uint64(16))).astype(np.uint32), w


def test_emulator_knows_the_instructions_it_runs():
    for name in ("WORD_NIBBLES", "PLANE_WORDS", "NIBBLES", "NIBBLES_I8", "PLANES", "BYTES_F16",
                 "NIBBLES_F16", "PLANES_F16", "AFFINE", "WORD_INT8", "WORD_INT8_SCALED", "NIBBLES_I8_SCALED"):
        text = getattr(ptx, name)
        ops = set(re.findall(r"^\s*([a-z]+\.[a-z0-9.]+)", text, re.M)) - {".reg"}
        assert ops <= {"and.b32", "or.b32", "xor.b32", "shl.b32", "shr.b32", "mov.b32", "prmt.b32", "lop3.b32",
                       "sub.bf16x2", "sub.f16x2", "fma.rn.bf16x2", "not.b32", "mul.lo.u32", "sub.u32"}, name


def test_word_nibbles_give_the_codes_at_k_4j_to_4j_plus_3():
    rng = np.random.default_rng(0)
    reg, w = words(rng, 4096)
    outs = run_ptx(ptx.WORD_NIBBLES, [reg], 4)
    for t, out in enumerate(outs):  # word j holds k = 4j .. 4j + 3, nibble t at bits 4t .. 4t + 3
        codes = ((w >> np.uint64(4 * t)) & np.uint64(15)).astype(np.float32)
        assert np.array_equal(halves(out), 1 + codes / 16), t


def test_scaled_word_codes_give_int4g_int8_codes():
    """WORD_INT8_SCALED: the codes at k = 4j + t of four words (two registers), each made s2 q - z s2 (the row's
    group integers, a register of two copies of s2 | z s2 << 8), as int8 bytes, for every q, s2 and z."""
    rng = np.random.default_rng(5)
    n = 8192
    (lo, w_lo), (hi, w_hi) = words(rng, n), words(rng, n)
    s2 = rng.integers(1, 17, size=n, dtype=np.uint64)
    z = rng.integers(0, 16, size=n, dtype=np.uint64)
    g = s2 | ((z * s2) << np.uint64(8))
    outs = run_ptx(ptx.WORD_INT8_SCALED, [lo, hi, (g | (g << np.uint64(16))).astype(np.uint32), g], 4)
    w = np.concatenate([w_lo, w_hi], 1)  # words 0-3 of each register pair
    for t, out in enumerate(outs):
        got = out.view(np.uint8).reshape(n, 4).view(np.int8).astype(np.int64)
        codes = ((w >> np.uint64(4 * t)) & np.uint64(15)).astype(np.int64)
        want = codes * s2[:, None].astype(np.int64) - (z * s2)[:, None].astype(np.int64)
        assert np.array_equal(got, (want + 128) % 256 - 128), t  # as int8 bytes (the format keeps them in range)


def test_scaled_nibbles_give_int4g_int8_codes():
    """NIBBLES_I8_SCALED: the low ($0) and the high ($1) nibbles of four bytes made s2 q - z s2 as int8 bytes, s2 and
    z s2 in every byte of their registers (a row's group integers), for every q, s2 and z."""
    rng = np.random.default_rng(6)
    n = 8192
    b = rng.integers(0, 1 << 32, size=n, dtype=np.uint64)
    s2 = rng.integers(1, 17, size=n, dtype=np.uint64)
    zs = rng.integers(0, 16, size=n, dtype=np.uint64) * s2
    every_byte = np.uint64(0x01010101)
    outs = run_ptx(ptx.NIBBLES_I8_SCALED, [b, s2 * every_byte, zs * every_byte], 2)
    for half, out in enumerate(outs):
        got = out.view(np.uint8).reshape(n, 4).view(np.int8).astype(np.int64)
        codes = np.stack([(b >> np.uint64(8 * j + 4 * half)) & np.uint64(15) for j in range(4)], 1).astype(np.int64)
        want = codes * s2[:, None].astype(np.int64) - zs[:, None].astype(np.int64)
        assert np.array_equal(got, (want + 128) % 256 - 128), half


def test_plane_words_give_the_signed_int8_codes():
    rng = np.random.default_rng(1)
    upper, u = words(rng, 4096)
    lower, low = words(rng, 4096)
    outs = run_ptx(ptx.PLANE_WORDS, [upper, lower], 4)
    for t, out in enumerate(outs):
        q8 = ((u >> np.uint64(4 * t)) & np.uint64(15)) * 16 + ((low >> np.uint64(4 * t)) & np.uint64(15))
        assert np.array_equal(halves(out), q8.astype(np.float32) - 128), t
    assert {-128.0, 127.0} <= set(np.concatenate([halves(o).ravel() for o in outs]))  # the ends of the range


def test_int8_words_give_the_signed_codes_at_k_4j_plus_t():
    rng = np.random.default_rng(2)
    first, a = byte_regs(rng, 4096)
    second, b = byte_regs(rng, 4096)
    outs = run_ptx(ptx.INT8_WORDS, [first, second], 4)
    signed = np.where(np.stack([a, b], 2) >= 128, np.stack([a, b], 2).astype(np.float32) - 256,
                      np.stack([a, b], 2).astype(np.float32))  # [n, 4 bytes, 2 words]
    for t, out in enumerate(outs):  # word j holds k = 4j .. 4j + 3, byte t the code at 4j + t
        assert np.array_equal(halves(out), signed[:, t]), t
    assert {-128.0, 127.0, 0.0} <= set(np.concatenate([halves(o).ravel() for o in outs]))


def byte_regs(rng, n):
    b = rng.integers(0, 256, size=(n, 4), dtype=np.uint64)
    return sum(b[:, i] << np.uint64(8 * i) for i in range(4)).astype(np.uint32), b


def test_byte_blocks_the_gpu_tests_proved_run_here_as_there():
    """The emulator on the byte blocks: nibbles of bytes as bf16 1 + c / 16 and as int8, and the two planes' signed
    codes."""
    rng = np.random.default_rng(2)
    reg, b = byte_regs(rng, 1024)
    lo01, lo23, hi01, hi23 = run_ptx(ptx.NIBBLES, [reg], 4)
    for out, first, shift in ((lo01, 0, 0), (lo23, 2, 0), (hi01, 0, 4), (hi23, 2, 4)):
        expect = 1 + ((b[:, first:first + 2] >> np.uint64(shift)) & np.uint64(15)).astype(np.float32) / 16
        assert np.array_equal(halves(out), expect)
    for out, shift in zip(run_ptx(ptx.NIBBLES_I8, [reg], 2), (0, 4)):  # int8 codes 0..15, four a register
        got = np.stack([(out.astype(np.uint64) >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)], 1)
        assert np.array_equal(got, (b >> np.uint64(shift)) & np.uint64(15))
    upper, u = byte_regs(rng, 1024)
    lower, low = byte_regs(rng, 1024)
    even, odd = run_ptx(ptx.PLANES, [upper, lower], 2)
    for out, codes in ((even, ((u & np.uint64(15)) << np.uint64(4)) | (low & np.uint64(15))),
                       (odd, (u & np.uint64(0xF0)) | (low >> np.uint64(4)))):
        got = np.stack([(out.astype(np.uint64) >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)], 1)
        assert np.array_equal(got, codes ^ np.uint64(0x80))


def f16_halves(reg: np.ndarray) -> np.ndarray:
    return np.stack([f16_values(reg & 0xFFFF), f16_values(reg >> 16)], 1)


def test_attention_blocks_give_the_kv_codes_as_exact_float16():
    """The quantized KV cache's bytes, upper-plane nibbles and joined planes (16 upper + lower) as float16."""
    rng = np.random.default_rng(4)
    reg, b = byte_regs(rng, 1024)
    low01, low23 = run_ptx(ptx.BYTES_F16, [reg], 2)
    assert np.array_equal(f16_halves(low01), b[:, :2].astype(np.float32))
    assert np.array_equal(f16_halves(low23), b[:, 2:].astype(np.float32))
    outs = run_ptx(ptx.NIBBLES_F16, [reg], 4)
    for out, first, shift in zip(outs, (0, 2, 0, 2), (0, 0, 4, 4)):
        assert np.array_equal(f16_halves(out), ((b[:, first:first + 2] >> np.uint64(shift)) & np.uint64(15)))
    lower, low = byte_regs(rng, 1024)
    outs = run_ptx(ptx.PLANES_F16, [reg, lower], 4)
    even = ((b & np.uint64(15)) << np.uint64(4)) | (low & np.uint64(15))
    odd = (b & np.uint64(0xF0)) | (low >> np.uint64(4))
    for out, codes, first in zip(outs, (even, even, odd, odd), (0, 2, 0, 2)):
        assert np.array_equal(f16_halves(out), codes[:, first:first + 2].astype(np.float32))


def test_affine_gives_the_reference_dequantized_weight():
    """The codes as the builds give them (1 + c / 16 of a nibble, q8 - 128 of both planes) times their scale (16 s,
    s) plus their offset (lo - 16 s; the weight of code 128, lo + 128 s) in one fused multiply-add, on
    quant/formats.fma_grid's scales and offsets (and the upper view's): the bf16 weight the reference
    rounds (float32 lo + s * q, then bf16), bit for bit."""
    from selfspec.quant.formats import minmax_quant, upper_affine
    torch.manual_seed(3)
    w = torch.randn(64, 256) * torch.logspace(-4, 1, 64)[:, None]  # scales over five decades
    w[:4, :128] = w[:4, :128] * 1e-4 + torch.tensor([1.0, -3.0, 1e3, 1e-6])[:, None]  # narrow groups far from 0
    q8, s, lo = minmax_quant(w, 8, 128)
    q4, s4, lo4 = minmax_quant(w, 4, 128)
    us, ulo = upper_affine(s, lo)
    # (codes, scale, lo, the code values the builds give, the FMA's scale and addend)
    views = [(q8, s, lo, q8.float() - 128, s, lo + 128 * s),
             (q4, s4, lo4, 1 + q4.float() / 16, 16 * s4, lo4 - 16 * s4),
             (q8 >> 4, us, ulo, 1 + (q8 >> 4).float() / 16, 16 * us, ulo - 16 * us)]
    for q, scale, low, codes, fma_scale, addend in views:
        scale, low, fma_scale, addend = (t.repeat_interleave(128, 1).reshape(-1)
                                         for t in (scale, low, fma_scale, addend))
        expect = (q.reshape(-1).float() * scale + low).bfloat16().view(torch.int16).numpy().view(np.uint16)
        assert torch.equal(addend, addend.bfloat16().float()) and torch.equal(fma_scale, fma_scale.bfloat16().float())
        regs = [(b[0::2].astype(np.uint32) | (b[1::2].astype(np.uint32) << 16))
                for b in map(bf16_bits, (codes.reshape(-1).numpy(), fma_scale.numpy(), addend.numpy()))]
        (out,) = run_ptx(ptx.AFFINE, regs, 1)
        got = np.stack([out & 0xFFFF, out >> 16], 1).reshape(-1).astype(np.uint16)
        assert np.array_equal(got, expect)
