"""Which kernel and which tiles a GEMM of M rows takes, from its weight's format, the mode and N, K (kernels/
triton_linear.py and kernels/gluon_linear.py run them).

Batch invariance (a row's output never depends on M) fixes what orders a row's adds: BLOCK_K, the number of K
splits and the swap come from (format, mode, N, K) alone (`decode_config`, the tiles of up to BLOCK_M rows). Past
BLOCK_M rows (`many_tokens`) the M and N tiles, warps and stages follow M, and one program may walk all K chunks of
the split in turn, each from zero, where the GPU gives each row the same bits (measured: MANY_TOKENS; tests/gpu
compares every row's bits); `takes_warp_specialized` marks the GEMMs the Hopper kernels take.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import triton.language as tl

from selfspec.kernels.launch import SHARED_MEMORY, cdiv, next_power_of_2
from selfspec.kernels.ops import ROW_SUM_COLS

# How the kernels read W. Formats INT4 to FULL are group-wise affine (w = lo + scale * q).
DENSE = tl.constexpr(0)  # floats as stored
INT8 = tl.constexpr(1)  # signed codes, per-channel scale (applied after the K loop)
INT4 = tl.constexpr(2)  # nibbles
UPPER = tl.constexpr(3)  # the upper nibble plane of the INT8-plane format, alone
FULL = tl.constexpr(4)  # both planes: q8 = 16 * upper + lower
INT4G = tl.constexpr(5)  # nibbles with integer group scales: INT8 codes built in registers, then as INT8's

BLOCK_M = 16  # decode's M tile (M <= 16); the smallest tl.dot tile
MAX_TILES_PER_PROGRAM = 16  # the most K tiles a nibble decode program walks (decode_config, as tuned)
SMS = 132  # streaming multiprocessors of an H100 SXM (and an H200): programs per wave at one per SM


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # W as the dot's left operand (y^T = W x^T)
    block_m: int = BLOCK_M
    in_program: bool = False  # the split_k K chunks walked by one program (no partials in memory)
    warp_specialized: bool = False  # on Hopper (nibbles: given x's row sums): kernels/gluon_linear.py, its tiles


def uses_nibble_kernel(fmt: int, act: bool, group: int, m: int = 1) -> bool:
    """Whether triton_linear._nibble_kernel takes a GEMM of M rows (or a tile of M rows): the nibble formats but both
    planes with int8 activations (w8a8 etc. on planes) and int8 activations in groups under 64: its even/odd halves
    give an int8 dot K = group / 2, and int8 tensor cores need K >= 32; INT4G likewise, with int8 activations in
    decode's tiles alone."""
    if fmt == INT4G.value:  # bf16 weights as the nibble formats' (triton_linear._code_weight); the codes' int32 dots
        # per K tile with an integer affine (triton_linear._nibble_chunk) up to BLOCK_M rows: 0.66-0.89x the time of
        # its INT8 codes built in registers, but 1.17-1.30x at 64 rows (H200, 8B layers,
        # docs/bench-h200/s28-ab-gemm-int4g-affine.log)
        return not act or (group >= 64 and m <= BLOCK_M)
    return INT4.value <= fmt <= FULL.value and not (act and (fmt == FULL.value or group < 64))


@functools.lru_cache(maxsize=4096)  # called per GEMM launch: an eager prompt pass of an 8B model makes ~130
def tile_config(fmt: int, act: bool, n: int, k: int, group: int, m: int = 1) -> TileConfig:
    """The tiles of a GEMM of M rows. What fixes a row's sums (BLOCK_K, the K split, the swap, and so the order
    of every add) comes from the weight and the mode only (`decode_config`); the M and N tiles, the warps and the
    stages follow M (`many_tokens`), which leaves every row's bits unchanged (tests/gpu/test_gpu_kernels.py)."""
    cfg = decode_config(fmt, act, n, k, group, m)
    return cfg if m <= BLOCK_M else many_tokens(cfg, fmt, act, group, m, n, k)


def decode_config(fmt: int, act: bool, n: int, k: int, group: int, m: int = 1) -> TileConfig:
    """The tiles of a GEMM of up to BLOCK_M rows: from the weight and the mode only (and for INT4G with int8
    activations, exact whatever its tiles, from the kernel M rows take: `uses_nibble_kernel`).

    Chosen by `python -m selfspec.bench.tune_linear` on an H100 (Llama-3-8B layers, M = 1 and 9, under CUDA
    graphs, weights streamed from HBM): INT8 codes stream best in K tiles of 256, both planes with int8
    activations in tiles of one group (<= 128) as the dot's left operand (swapped). Nibbles (_nibble_kernel) with
    bf16 activations, never more than MAX_TILES_PER_PROGRAM K tiles per program: one nibble plane in N tiles of 256
    and K in as few pieces as that allows where this gives more than a wave of programs (gate/up of 8B models;
    docs/bench-h100/tune-group-major-scales.json); else K split into chunks of about 8 K tiles, or into more pieces
    (up to 16) while that leaves under 256 programs of 128 columns, over N tiles of 128, or of 64 for both planes
    (an 8B model's down 0.87x the time of 256-wide tiles for one plane, `full`'s gate/up and down 0.93-0.95x that
    of 128-wide ones: docs/bench-h100/tune-decode-2026-11-26.json); with int8 activations:
    N tiles of 64 and as many K pieces (a power of two) as keep the programs within 512."""
    if uses_nibble_kernel(fmt, act, group, m):
        block_k = min(group, 128)
        k_tiles = cdiv(k, block_k)
        if act:
            split_k = 1 << max(0, (512 // cdiv(n, 64)).bit_length() - 1)  # the power of two <= 512 / N tiles
            return TileConfig(64, block_k, max(1, min(k_tiles, 16, split_k)))
        fewest = fewest_pieces(k_tiles)
        if fmt != FULL.value and wide_fills(1, n, fewest):
            return TileConfig(256, block_k, fewest)  # long programs over wide tiles fill more than a wave
        n_tiles = cdiv(n, 128)  # the split counts programs of 128 columns whatever the N tile
        split_k = 1 << max(0, (k_tiles // 8).bit_length() - 1)  # the power of two <= k_tiles / 8
        while split_k < k_tiles and (k_tiles > split_k * MAX_TILES_PER_PROGRAM
                                     or (n_tiles * split_k < 256 and split_k < 16)):
            split_k *= 2
        return TileConfig(64 if fmt == FULL.value else 128, block_k, split_k)
    if fmt == INT8.value and not act:  # INT8 codes as 32-bit words (`reads_words`)
        return int8_words_config(n, k)
    int4_act = act and INT4.value <= fmt <= FULL.value
    block_n = 64 if int4_act or n > 32768 else 32
    if fmt >= INT4.value:  # a K tile in one quant group
        block_k = min(group, 128)
    else:
        block_k = max(min(next_power_of_2(k), 256 if fmt == INT8.value else 128), 32 if act else 16)
    # Enough programs to stream W at memory speed at M = 1 (about 4 per SM), splitting K where N is narrow.
    n_tiles, k_tiles = cdiv(n, block_n), cdiv(k, block_k)
    if int4_act:
        split_k = max(4, 512 // n_tiles)
    else:
        split_k = max(2 if fmt >= INT4.value else 1, 528 // n_tiles)
    split_k = max(1, min(k_tiles, 16 if int4_act else 8, split_k))
    return TileConfig(block_n, block_k, split_k, swap=int4_act)


def int8_words_config(n: int, k: int) -> TileConfig:
    """w8a16's decode tiles: INT8 codes as 32-bit words in K tiles of 128 (a tile's words one 128-byte TMA box, as
    the warp-specialized kernel reads them), N tiles of 128, K split into the power of two (at most 8) that keeps
    about 1024 / N tiles programs of 128 columns. Measured (H200, docs/bench-h200/w8a16-decode-probe-2.json; 8B
    layers, M = 1 and 16) against the bytes' K tiles of 256 before: qkv 1.005x, o 1.055x, gate/up 1.014x, down 1.016x
    their time; the bytes' own tiles (N 32, K 256) read as words took 1.19-1.35x. A-B'd alone
    (docs/bench-h200/ab-gemm-w8a16-words.json): 0.95-1.06x at M = 1, 1.04-1.10x at M = 16."""
    block_k = 128 if k > 64 else 64
    split_k = 1 << max(0, (1024 // cdiv(n, 128)).bit_length() - 1)
    return TileConfig(128, block_k, max(1, min(cdiv(k, block_k), 8, split_k)))


# Tiles for many tokens, per kernel kind and M bucket: (largest M of the bucket, tiles of a GEMM whose K is split,
# tiles of one whose K is not), each tiles (block_m, block_n, warps, stages, the split's K chunks walked in one
# program[, block_k]), or None for the decode tiles. Measured on an H100 (`python -m selfspec.bench.tune_linear --many`,
# Llama-3-8B layers, M = 64 to 4096), each candidate against the decode tiles' bits over all rows:
# - int8 activations (int8-act, nibble-act): any M and N tile, warps, stages, mma or wgmma keep the bits (exact
#   int32 dots per K tile, then the same fp32 affine per element; INT8 codes: exact int32 sums over all of K);
# - INT4G with int8 activations past decode's rows (int4g-act): its INT8 codes built in registers, any tile (exact
#   int32 sums), 64 x 128 on 8 warps (4 warps spilled 184-328 bytes a thread, compiled for sm_90); in decode's
#   tiles (groups of 64 and more), and with bf16 activations, the nibble kernel's (its integer affine, `_code_weight`);
# - bf16 activations (bf16, int8 and nibble weights): warps, stages, N tiles and M tiles up to 32 keep the bits,
#   but M tiles of 64 or more (where Triton issues Hopper's wgmma instead of mma.sync) changed 4e-5 to 1.5e-3 of
#   the outputs of integer-coded weights (int8 codes, nibbles, planes) built from bytes, whose mma.sync operands
#   Triton lays out with kWidth 4 (`reads_words` says why). The nibble kernel builds its codes from 16-bit words
#   and w8a16 from 32-bit ones (kWidth 2, as for bf16 weights), and every wgmma tile tried kept the bits of its
#   decode tiles: 64 and 128 rows, N tiles 128/256, `full`, upper and w4a16, M = 160 to 1024 (H200 and H100,
#   docs/bench-h200/tune-many-words.json; the GPU tests, up to 8192 rows, w8a16 too).
# - w8a16 (INT8 codes as words): 32 x 128 mma.sync tiles up to 32 rows, 64 x 64 wgmma tiles up to 64, the
#   warp-specialized kernel past that (H200, docs/bench-h200/w8a16-rows-probe.json: at 96-128 rows it took
#   0.36-0.73x the best Triton tile's time; at 32 rows 1.4-1.7x, at 64 rows 0.87-1.2x).
#   bf16 weights kept every bit on wgmma tiles (64 to 128 rows, N tiles 128/256, K tiles 64/128, at M = 256 to
#   4096 on the 8B layers: random, integer-valued and +-1 weights such as the rotation's,
#   docs/bench-h100/gemm-many-tokens.md): they take them past 64 rows, 64 x 128 up to 256 rows (1.3-1.6x cuBLAS),
#   then 128 x 256 with K tiles of 64 (1.14-1.46x at M = 1024, 1.21-1.27x at 4096; 32-row tiles: 2.0-2.8x);
#   a list offers tiles to choose from by how full their last wave is (`fullest_wave`): qkv at M = 1024 has 192
#   tiles of 128 x 256 (1.5 waves, 1.50x cuBLAS) but 384 of 128 x 128 (2.9 waves, 1.31x);
#   docs/bench-h100/gemm-bf16-tiles-probe.json;
# - speed: each bucket's tiles beat the decode tiles at M = 64 to 4096 (gemm bench), but for the nibble kernel with
#   bf16 activations at M <= 64. Both planes (`planes`, the `full` mode) differ: their 32-row tiles took 0.80-0.86x
#   the decode tiles' time at M = 32 and 64 on every 8B layer (docs/bench-h100/gemm-rows-32.md): a batch-32
#   verify-mode step reads each weight tile's two planes once, not twice. Past 64 rows both planes take wgmma tiles
#   of 64 x 128: 0.48-0.67x the decode tiles' time at M = 256 and 1024, the sum of a layer's GEMMs 0.87x the 32-row
#   tiles' at M = 160; one plane (w4a16, upper) past 192 rows (0.52-0.65x the old 32-row tiles at 1024 rows, H100;
#   at 160 rows its decode tiles were the faster on 3 of 4 layers, 256-wide down 1.15x quicker than 32 x 128).
# - shared memory: a tile whose pipelined operands would not fit (`fits_shared`: a bf16 list tile given K tiles of
#   128 where the split's chunks do not start at multiples of 64) is passed over.
MANY_TOKENS: dict[str, list[tuple[int, tuple | None, tuple | None]]] = {
    "int8-act": [(64, (64, 128, 4, 3, False), (64, 128, 4, 3, False)),
                 (256, (64, 128, 4, 3, True), (128, 128, 8, 3, False)),
                 (1 << 62, (128, 128, 8, 3, True), (128, 128, 8, 3, False))],
    "nibble-act": [(64, None, None), (1 << 62, (64, 128, 4, 3, True), (64, 128, 4, 3, False))],
    "nibble": [(192, None, None), (1 << 62, (64, 128, 4, 3, True), (64, 128, 4, 3, False))],
    "planes": [(64, (32, 128, 4, 3, False), (32, 128, 4, 3, False)),
               (1 << 62, (64, 128, 4, 3, True), (64, 128, 4, 3, False))],
    "bf16": [(64, (32, 128, 4, 3, False), (32, 128, 4, 3, False)),
             (256, (64, 128, 4, 4, True, 64), (128, 128, 8, 3, False, 64)),
             (1 << 62, [(128, 256, 8, 3, True, 64), (128, 128, 8, 3, True, 128)],
              [(128, 256, 8, 3, False, 64), (128, 128, 8, 3, False, 64)])],
    "int4g-act": [(64, (64, 128, 8, 3, False), (64, 128, 8, 3, False)),
                  (1 << 62, (64, 128, 8, 3, True), (64, 128, 8, 3, False))],
    "int8": [(32, (32, 128, 4, 3, False), (32, 128, 4, 3, False)),
             (64, (64, 64, 4, 3, False), (64, 64, 4, 3, False)),
             (1 << 62, (32, 128, 4, 3, True), (32, 128, 4, 3, False))],
}


def fewest_pieces(k_tiles: int) -> int:
    """The fewest K pieces (a power of two) of at most MAX_TILES_PER_PROGRAM K tiles each."""
    return 1 << (cdiv(k_tiles, MAX_TILES_PER_PROGRAM) - 1).bit_length()


def wide_fills(m: int, n: int, split_k: int) -> bool:
    """Whether 256-wide N tiles of one nibble plane, over M rows in 16-row tiles and split_k K pieces, make more
    than a wave of programs: then they beat 128-wide ones (an 8B model's down: 0.87x at 1 row in 128-wide tiles,
    whose 128 programs were one wave; at 32 rows the 256-wide ones, 256 programs, are the faster)."""
    return cdiv(m, BLOCK_M) * cdiv(n, 256) * split_k > SMS


def kernel_kind(fmt: int, act: bool, group: int, m: int) -> str:
    """Which row of MANY_TOKENS a GEMM of M rows takes."""
    if uses_nibble_kernel(fmt, act, group, m):
        return "nibble-act" if act else "planes" if fmt == FULL.value else "nibble"
    if fmt == INT4G.value:
        return "int4g-act"
    if act:
        return "int8-act"
    return "bf16" if fmt == DENSE.value else "int8"


def many_tokens(cfg: TileConfig, fmt: int, act: bool, group: int, m: int, n: int, k: int) -> TileConfig:
    """cfg with the M and N tiles, warps and stages of M's bucket (and, for bf16 weights, its K tile); the split,
    the swap and so each row's order of adds stay. GEMMs `takes_warp_specialized` picks are marked for the
    warp-specialized kernels, which `triton_linear._run` takes where it can (else these tiles)."""
    if cfg.swap:  # not measured at many tokens
        return cfg
    for max_m, split_tiles, whole_tiles in MANY_TOKENS[kernel_kind(fmt, act, group, m)]:
        if m <= max_m:
            tiles = split_tiles if cfg.split_k > 1 else whole_tiles
            many = cfg
            if tiles is None and kernel_kind(fmt, act, group, m) == "nibble" and cfg.split_k == fewest_pieces(
                    cdiv(k, cfg.block_k)) and wide_fills(m, n, cfg.split_k):
                many = replace(cfg, block_n=256)  # the decode tiles, as wide as this M fills (same bits)
            if tiles is not None:
                fitting = [c for c in (retile(cfg, t, k) for t in (tiles if isinstance(tiles, list) else [tiles]))
                           if fits_shared(c, fmt, act)]
                many = fullest_wave(fitting, m, n) if fitting else cfg
            if takes_warp_specialized(fmt, act, group, cfg.split_k, m):
                many = replace(many, warp_specialized=True)
            return many
    raise AssertionError("the last bucket takes every M")


# Rows from which a kind of GEMM runs warp-specialized (kernels/gluon_linear.py) where it can, measured on the 8B
# layers against the Triton tiles (H100, docs/bench-h100/ws-*.json):
# - nibbles with bf16 activations: at 160 rows 0.67-0.86x their time but for w4a16's down (1.08x), at 256 and more
#   0.59-0.84x (`ws-gemm-pipelined.json`, column "prev"); below 129 rows its 128-row tiles would be mostly padding;
# - bf16 weights (and prompt tokens' dequantized ones): where K is walked whole (256-wide tiles: gate/up 1.12-1.17x
#   cuBLAS at 256-4096 rows against 1.12-1.29x), and up to 512 rows where the split's chunks are summed (128-wide
#   tiles: qkv, o, down 1.18-1.30x at 256 rows against 1.32-1.40x, but 1.31-1.44x at 1024-4096 against
#   1.14-1.41x; `ws-dense.json`);
# - int8 codes with int8 activations (w8a8 on INT8 storage): 0.65-0.95x cuBLAS BF16 at 256-4096 rows against
#   0.71-1.20x; at 160 rows slower on gate/up and down (`ws-int8.json`);
# - INT8 codes with bf16 activations (w8a16, the nibble kernel's skeleton on 32-bit words): from 65 rows (above);
# - INT4 codes with int8 activations (w4a8, w4a4): from 129 rows, 0.69-0.88x the Triton tiles' time on qkv,
#   gate/up and down at 1,024 and 4,096 rows, 0.72-0.85x on gate/up and down at 256 (1.17x on qkv there: a
#   layer's four still 0.87x); o takes it too, at the Triton tiles' time (1.00-1.02x; `s25-ab-gemm-nibble-act.json`).
WARP_SPECIALIZED_ROWS = {"nibble": 129, "planes": 129, "bf16": 193, "int8-act": 193, "int8": 65, "nibble-act": 129}
SPLIT_BF16_MOST_ROWS = 512


def takes_warp_specialized(fmt: int, act: bool, group: int, split_k: int, m: int) -> bool:
    """Whether a GEMM of M rows is marked for kernels/gluon_linear.py (which `triton_linear._run` takes on Hopper)."""
    kind = kernel_kind(fmt, act, group, m)
    if kind not in WARP_SPECIALIZED_ROWS or m < WARP_SPECIALIZED_ROWS[kind]:
        return False
    if kind == "bf16":
        return split_k == 1 or m <= SPLIT_BF16_MOST_ROWS
    if kind == "nibble-act":  # the planes with int8 activations: not there
        return fmt == INT4.value
    return kind != "int8-act" or fmt == INT8.value


def retile(cfg: TileConfig, tiles: tuple, k: int) -> TileConfig:
    """cfg with one MANY_TOKENS entry's tiles."""
    block_m, block_n, warps, stages, in_program, *block_k = tiles
    # A bf16 dot adds its K tiles into one accumulator, 16 columns at a time in order, whatever BLOCK_K is; the
    # split's chunks must still start at the same columns.
    block_k = block_k[0] if block_k and k_chunk(k, cfg.split_k, block_k[0]) == k_chunk(
        k, cfg.split_k, cfg.block_k) else cfg.block_k
    return replace(cfg, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                   in_program=in_program and cfg.split_k > 1)


def fits_shared(cfg: TileConfig, fmt: int, act: bool) -> bool:
    """Whether a tile's pipelined operands fit in shared memory: a stage holds an x tile (int8 or bf16) and a W
    tile (bf16, or codes of a byte at most). Triton's own count stayed at or below this for every config
    MANY_TOKENS offers, compiled for sm_90."""
    x_bytes, w_bytes = 1 if act else 2, 2 if fmt == DENSE.value else 1
    return cfg.num_stages * (cfg.block_m * x_bytes + cfg.block_n * w_bytes) * cfg.block_k <= SHARED_MEMORY


def fullest_wave(configs: list[TileConfig], m: int, n: int) -> TileConfig:
    """Of several tile configs, the one whose last wave of programs is fullest (the first, the largest, on a tie):
    a half-empty last wave leaves SMs idle for a whole tile's time."""
    def fill(c: TileConfig) -> float:
        programs = cdiv(m, c.block_m) * cdiv(n, c.block_n)
        return programs / (cdiv(programs, SMS) * SMS)
    return max(configs, key=fill)  # max keeps the first of equals


def k_chunk(k: int, split_k: int, block_k: int) -> int:
    """Columns of each of the split's K chunks (whole K tiles; the last one may be shorter)."""
    return cdiv(cdiv(k, split_k), block_k) * block_k


def x_by_tma(fmt: int, act: bool, cfg: TileConfig) -> bool:
    """Whether the nibble kernel loads x's tiles by TMA (X_DESC) in this config: the 64-row tiles of `full` and of
    the int8-activation formats. H200, Llama-3-8B GEMMs at 96 rows (docs/bench-h200/ab-gemm-x-by-tma.log): `full`
    0.93-0.97x the per-thread loads' time, w4a8 0.92-0.95x (the 64-row `full` tile had spilled x's addresses); at
    1-64 rows every format 0.95-1.12x, w4a16 and `upper` at 96 up to 1.09x: they keep per-thread loads."""
    return cfg.block_m >= 64 and (fmt == FULL.value or act)


def reads_words(fmt: int, act: bool, group: int, cfg: TileConfig) -> bool:
    """Whether a GEMM reads its codes as words and builds their bf16 values in asm, so that they enter mma.sync in
    its natural k order (Triton's order for operands built from 8-bit values rounds otherwise than wgmma, so wgmma
    tiles would change the bits): with bf16 activations, in K tiles of 64 and more (each quarter of a tile a dot of
    K >= 16), the nibble kernel's planes as 16-bit words and INT8 codes as 32-bit ones, four codes a word."""
    return not act and cfg.block_k >= 64 and (uses_nibble_kernel(fmt, act, group) or fmt == INT8.value)


def takes_row_sums(fmt: int, act: bool, group: int, cfg: TileConfig) -> bool:
    """Whether a GEMM reads its int8 codes' row sums (which its group offsets multiply) instead of summing each K
    tile of them in every program: the nibble kernel with int8 activations, in K tiles made of whole
    ROW_SUM_COLS-column pieces, in many-token tiles only: in decode's 16-row tiles the dot with ones on the int8
    tensor cores was the faster (w4a8 and w4a4 at 16 and 32 rows took 1.04-1.19x the time reading sums, 0.77-0.89x
    at 160 and 256; H200, `selfspec bench ab gemm`). Both give the same exact integers, so the same bits. (With
    bf16 activations the nibble kernels dequantize the weight and take no sums.)"""
    if not act or not uses_nibble_kernel(fmt, act, group, cfg.block_m) or min(group, 128) % ROW_SUM_COLS:
        return False
    return cfg.block_m > BLOCK_M
