"""Inline PTX of the kernels that read integer codes (kernels/triton_linear.py, kernels/triton_quant_attention.py):
each block turns packed bytes or 16-bit words of stored codes into the values the tensor cores read, several codes
a 32-bit register. Plain strings, built from a
few shared pieces; tests/test_kernel_asm.py runs them on an emulator of their instructions.

Operands: $0.. are the outputs, then the inputs (Triton's inline_asm_elementwise). An input register holds four
bytes (`pack=4` over uint8) or two 16-bit words (`pack=2` over int16), element 0 in the low bits; an output
register holds two bf16 (element 0 in the low half) or four int8.

Why 16-bit words: Triton lays out a dot operand built from 8-bit values with four consecutive k a thread (kWidth
4), a permutation of k inside each mma.sync step, which rounds a dot's sums otherwise than wgmma (natural order)
does; built from 16-bit words in asm, the operands get mma.sync's natural order (kWidth 2), as the bf16 GEMM's.
"""
from __future__ import annotations


def block(registers: str, body: str) -> str:
    return "{\n.reg .b32 " + registers + ";\n" + body + "}\n"


def split_nibbles(src: str) -> str:
    """Registers lo, hi: the low and the high nibbles of the four bytes of src."""
    return f"and.b32 lo, {src}, 0x0F0F0F0F;\nshr.b32 hi, {src}, 4;\nand.b32 hi, hi, 0x0F0F0F0F;\n"


def join_planes(upper: str, lower: str, even: str = "a", odd: str = "b") -> str:
    """Registers even, odd: the 8-bit codes 16 upper + lower at the low and at the high nibbles of the two planes'
    bytes, the upper nibble shifted over the lower one (t: scratch)."""
    return (f"and.b32 {even}, {upper}, 0x0F0F0F0F;\nshl.b32 {even}, {even}, 4;\nand.b32 t, {lower}, 0x0F0F0F0F;\n"
            f"or.b32 {even}, {even}, t;\nand.b32 {odd}, {upper}, 0xF0F0F0F0;\nshr.b32 t, {lower}, 4;\n"
            f"and.b32 t, t, 0x0F0F0F0F;\nor.b32 {odd}, {odd}, t;\n")


def plane_bytes(upper: str, lower: str) -> str:
    """Registers a, b: the signed 8-bit codes q8 - 128 (q8 = 16 upper + lower) at the low and at the high nibbles of
    the two planes' bytes: the joined codes, the sign bit flipped."""
    return join_planes(upper, lower) + "xor.b32 a, a, 0x80808080;\nxor.b32 b, b, 0x80808080;\n"


def f16_words(first: str, second: str) -> str:
    """The four bytes of register `first` as exact float16 into $0 and $1, those of `second` into $2 and $3 (0x64
    above each byte reads as 1024 + byte; register k holds 1024 twice)."""
    words = [(first, "0x4140"), (first, "0x4342"), (second, "0x4140"), (second, "0x4342")]
    return "".join(f"prmt.b32 ${i}, {r}, 0x64, {sel};\nsub.f16x2 ${i}, ${i}, k;\n" for i, (r, sel) in enumerate(words))


def signed_bytes_to_bf16(out: str, src: str, selector: str) -> str:
    """bf16 of two signed bytes of src (selector 0x4240: bytes 0 and 2, 0x4341: bytes 1 and 3) into out. 0x43 put
    above a signed byte makes bf16 128 + (its low 7 bits), or 256 + twice that where its top bit is set; subtracting
    128 or 256 (that byte's 0x43 and top bit alone) leaves its value, exactly (the conversion Triton emits itself)."""
    return (f"prmt.b32 l0, {src}, 0x43, {selector};\nand.b32 l1, l0, 0xff7fff7f;\nand.b32 l2, l0, 0xff80ff80;\n"
            f"sub.bf16x2 {out}, l1, l2;\n")


def gather_bytes(out: str, first: str, second: str, t: int) -> str:
    """Register out: byte t of register `first` in bytes 0 and 1, byte t of `second` in bytes 2 and 3."""
    return f"prmt.b32 {out}, {first}, {second}, 0x{4 + t}{4 + t}{t}{t};\n"


def nibbles_under_one(src: str) -> str:
    """Registers lo, hi: the low and the high nibbles of the four bytes of src, each moved to bits 3-6 of its byte
    under bit 7 (0x80 | c << 3): a byte that, with 0x3F put above it, reads as bf16 1 + c / 16 (1.0 is 0x3F80, and
    the nibble fills the top four of its seven mantissa bits)."""
    return (f"mov.b32 m, 0x78787878;\nmov.b32 k, 0x80808080;\nshl.b32 lo, {src}, 3;\nlop3.b32 lo, lo, m, k, 0xEA;\n"
            f"shr.b32 hi, {src}, 1;\nlop3.b32 hi, hi, m, k, 0xEA;\n")  # 0xEA: a & b | c


# Four bytes -> their eight nibbles as bf16 1 + c / 16 (exact), 0x3F put above each. $0, $1: the low nibbles of
# bytes 0-1 and 2-3; $2, $3: the high ones.
NIBBLES = block("lo, hi, m, k", nibbles_under_one("$4") + "prmt.b32 $0, lo, 0x3F, 0x4140;\n"
                "prmt.b32 $1, lo, 0x3F, 0x4342;\nprmt.b32 $2, hi, 0x3F, 0x4140;\nprmt.b32 $3, hi, 0x3F, 0x4342;\n")

# Four bytes -> their low ($0) and their high ($1) nibbles as int8 codes 0..15 (for the int8 tensor cores).
NIBBLES_I8 = "{\nand.b32 $0, $2, 0x0F0F0F0F;\nshr.b32 $1, $2, 4;\nand.b32 $1, $1, 0x0F0F0F0F;\n}\n"

# INT4G's bytes: as NIBBLES_I8, each code q then made s2 q - z s2 (quant/formats.Int4IntScaleWeight): $3 holds s2 and
# $4 z s2 in each of its bytes (the row's group integers); the bytes' subtraction as WORD_INT8_SCALED's.
NIBBLES_I8_SCALED = block("s, zl, zn, a, h, l", (
    "and.b32 s, $3, 0xFF;\nnot.b32 zn, $4;\nand.b32 zn, zn, 0x80808080;\nand.b32 zl, $4, 0x7F7F7F7F;\n") + "".join(
    ("shr.b32 a, $2, 4;\nand.b32 a, a, 0x0F0F0F0F;\n" if t else "and.b32 a, $2, 0x0F0F0F0F;\n")
    + f"mul.lo.u32 a, a, s;\nor.b32 h, a, 0x80808080;\nsub.u32 h, h, zl;\nand.b32 l, a, 0x80808080;\n"
      f"xor.b32 l, l, zn;\nxor.b32 ${t}, h, l;\n" for t in range(2)))

# The two planes' bytes (4 + 4) -> the signed 8-bit codes q8 - 128 at the even ($0) and the odd ($1) k.
PLANES = block("a, b, t", plane_bytes("$2", "$3") + "mov.b32 $0, a;\nmov.b32 $1, b;\n")

# Two 16-bit words of a nibble plane (byte j holds k = 2j in its low nibble and 2j + 1 in its high one) -> the codes
# at k = 4w + t, t = 0..3, as bf16 1 + c / 16: output t holds word 0's code and word 1's.
WORD_NIBBLES = block("lo, hi, m, k", nibbles_under_one("$4") + "prmt.b32 $0, lo, 0x3F, 0x4240;\n"
                     "prmt.b32 $1, hi, 0x3F, 0x4240;\nprmt.b32 $2, lo, 0x3F, 0x4341;\nprmt.b32 $3, hi, 0x3F, 0x4341;\n")

# The two planes' 16-bit words (2 + 2) -> bf16 q8 - 128 at k = 4w + t, t = 0..3: the codes at the bytes' low nibbles
# (t = 0, 2) and at their high ones (t = 1, 3), each turned into bf16.
PLANE_WORDS = block("a, b, t, l0, l1, l2", plane_bytes("$4", "$5")
                    + signed_bytes_to_bf16("$0", "a", "0x4240") + signed_bytes_to_bf16("$1", "b", "0x4240")
                    + signed_bytes_to_bf16("$2", "a", "0x4341") + signed_bytes_to_bf16("$3", "b", "0x4341"))

# Two 32-bit words of INT8 codes (word j holds k = 4j .. 4j + 3, one signed byte each) -> bf16 of the codes at
# k = 4j + t, t = 0..3: output t holds word 0's code and word 1's (byte t of each gathered into bytes 0 and 2).
INT8_WORDS = block("g, l0, l1, l2", "".join(gather_bytes("g", "$4", "$5", t)
                                            + signed_bytes_to_bf16(f"${t}", "g", "0x4240") for t in range(4)))


# Four 16-bit words of a nibble plane (two a register) -> their codes 0..15 as int8 (for the int8 tensor cores): output
# t holds the code at k = 4w + t of each word (the word's nibble t), words 0-3 in bytes 0-3.
WORD_INT8 = block("a, b", "".join(
    (f"shr.b32 a, $4, {4 * t};\nshr.b32 b, $5, {4 * t};\nand.b32 a, a, 0x000F000F;\nand.b32 b, b, 0x000F000F;\n"
     if t else "and.b32 a, $4, 0x000F000F;\nand.b32 b, $5, 0x000F000F;\n")
    + f"prmt.b32 ${t}, a, b, 0x6420;\n" for t in range(4)))


# INT4G: as WORD_INT8, each code q then made s2 q - z s2 (quant/formats.Int4IntScaleWeight), four bytes a register:
# $6 (and $7, the same) holds the row's group integers s2 | z s2 << 8 twice. s2 q <= 240 stays inside its byte; the
# bytes' subtraction runs without borrows across them (Hacker's Delight 2-18: ((a | H) - (b & ~H)) ^ ((a ^ ~b) & H),
# H the bytes' top bits), giving w8 in [-127, 127] as two's complement bytes.
WORD_INT8_SCALED = block("a, b, s, zl, zn, h, l", (
    "and.b32 s, $6, 0xFF;\nshr.b32 zl, $6, 8;\nand.b32 zl, zl, 0xFF;\nmul.lo.u32 zl, zl, 0x01010101;\n"
    "not.b32 zn, zl;\nand.b32 zn, zn, 0x80808080;\nand.b32 zl, zl, 0x7F7F7F7F;\n") + "".join(
    (f"shr.b32 a, $4, {4 * t};\nshr.b32 b, $5, {4 * t};\nand.b32 a, a, 0x000F000F;\nand.b32 b, b, 0x000F000F;\n"
     if t else "and.b32 a, $4, 0x000F000F;\nand.b32 b, $5, 0x000F000F;\n")
    + f"prmt.b32 a, a, b, 0x6420;\nmul.lo.u32 a, a, s;\nor.b32 h, a, 0x80808080;\nsub.u32 h, h, zl;\n"
      f"and.b32 l, a, 0x80808080;\nxor.b32 l, l, zn;\nxor.b32 ${t}, h, l;\n" for t in range(4)))


# $0: the weight of two codes as the builds give them, one bf16 fused multiply-add c * $2 + $3 (one rounding):
# a nibble code c = 1 + q / 16 times 16 scale plus lo - 16 scale (a bf16 value: quant/formats.fma_grid), both
# planes' codes c = q8 - 128 times scale plus lo + 128 scale (a bf16 value too). On those grids lo +
# scale * q is exact in float32, so this is the reference's dequantized weight, bit for bit.
AFFINE = "{\nfma.rn.bf16x2 $0, $1, $2, $3;\n}\n"

# The quantized KV cache's codes for the attention kernel, as exact float16 (register k: 1024 twice).
# Four bytes -> four float16 1024 + byte (0x64 above each byte), less 1024: the bytes as exact float16 integers.
BYTES_F16 = ("{\n.reg .b32 t, k;\nmov.b32 k, 0x64006400;\nprmt.b32 t, $2, 0x64, 0x4140;\nsub.f16x2 $0, t, k;\n"
             "prmt.b32 t, $2, 0x64, 0x4342;\nsub.f16x2 $1, t, k;\n}\n")
# Four bytes of the upper plane -> their low nibbles ($0, $1) and high nibbles ($2, $3) as exact float16.
NIBBLES_F16 = "{\n.reg .b32 lo, hi, k;\nmov.b32 k, 0x64006400;\n" + split_nibbles("$4") + f16_words("lo", "hi") + "}\n"
# Four bytes of each plane (upper $4, lower $5) -> the joined codes 16 * upper + lower of the even channels (low
# nibbles: $0, $1) and of the odd ones (high nibbles: $2, $3) as exact float16.
PLANES_F16 = ("{\n.reg .b32 ev, od, t, k;\nmov.b32 k, 0x64006400;\n" + join_planes("$4", "$5", "ev", "od")
              + f16_words("ev", "od") + "}\n")
