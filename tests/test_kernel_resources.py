"""The sm_90 compile report (`selfspec bench resources`): real ptxas output for the linear kernel's tiles.

It runs in its own process: this one may interpret the kernels (TRITON_INTERPRET=1, tests/test_triton_kernels.py),
and interpreted kernels do not compile."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def compiling_env() -> dict[str, str]:
    """This process's environment less TRITON_INTERPRET: a child process compiles the kernels."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def report(*args: str) -> list[list[str]]:
    env = compiling_env()
    out = subprocess.run([sys.executable, "-m", "selfspec.bench.kernel_resources", *args], env=env,
                         capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]


def run_code(code: str) -> str:
    """What `code` prints, run in a process of its own that compiles (not interprets) the kernels."""
    return subprocess.run([sys.executable, "-c", code], env=compiling_env(), capture_output=True, text=True,
                          check=True).stdout


def test_decode_and_many_token_nibble_tiles_fit_registers():
    """Decode's 16-row nibble tile issues mma.sync and a 64-row tile wgmma, neither spilling: with x's tiles by TMA
    (X_DESC) the 64-row tile no longer keeps x's per-thread addresses, which spilled 944 bytes a thread."""
    decode, many = report("--mode", "full", "--split", "4", "--tiles", "16x128x4", "64x128x4")
    assert decode[0] == "16 x 128 x 4" and 0 < int(decode[1]) <= 255 and decode[2] == "0" and decode[4] == "mma.sync"
    assert many[0] == "64 x 128 x 4" and many[2] == "0" and many[4] == "wgmma"


def test_int4g_tiles_compile_for_sm_90():
    """INT4G compiles in every tile its GEMMs take: int8 activations in the nibble kernel's decode tiles (the codes'
    int32 dots and an integer affine, split and whole) and as INT8 codes built in registers past them, bf16
    activations in the nibble kernel's tiles and its warp-specialized kernel (no spills, wgmma not serialized)."""
    code = ("from dataclasses import replace\n"
            "from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import linear_tiles\n"
            "fmt = linear_tiles.INT4G.value\n"
            "for mode, m, n in (('w4a8', 1, 6144), ('w4a8', 1, 28672), ('w4a4', 64, 4096), ('w4a16', 1, 6144),\n"
            "                   ('w4a16', 300, 4096)):\n"
            "    act = mode != 'w4a16'\n"
            "    cfg = linear_tiles.tile_config(fmt, act, n, 4096, 128, m)\n"
            "    r = kr.resources(kr.compile_linear(mode, cfg, fmt=fmt))\n"
            "    print(mode, m, cfg.split_k, r.stack_bytes, r.mma)\n")
    rows = [line.split() for line in run_code(code).splitlines()]
    assert len(rows) == 5 and all(r[3] == "0" for r in rows[:4])  # no spills but in the nibble kernel's 64-row
    # tile at many rows, which spills as int4's own (912 bytes a thread; past 128 rows int4 runs warp-specialized)
    assert [r[4] for r in rows] == ["mma.sync", "mma.sync", "wgmma", "mma.sync", "wgmma"]
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import linear_tiles\n"
            "for ip, partial in ((True, False), (False, True)):\n"
            "    k = kr.compile_warp_specialized('w4a16', in_program=ip, partial=partial,\n"
            "                                    fmt=linear_tiles.INT4G.value)\n"
            "    print(kr.resources(k).stack_bytes, kr.wgmma_serialized(k))\n")
    assert run_code(code).split() == ["0", "False", "0", "False"]  # the warp-specialized nibble kernel's INT4G


def test_prompt_kernel_tiles_compile_without_spills():
    """The nibble kernel with K as one chain (w4a16 / `upper` prompt tokens) in each of its CTA heights, 256 rows
    included (one accumulator a consumer): no spills, wgmma not serialized."""
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "for mode in ('w4a16', 'upper'):\n"
            "    for block_m in (64, 128, 256):\n"
            "        k = kr.compile_warp_specialized(mode, in_program=False, block_m=block_m)\n"
            "        print(kr.resources(k).stack_bytes, kr.wgmma_serialized(k))\n")
    assert run_code(code).split() == ["0", "False"] * 6


def test_bad_tiles_say_what_to_write():
    env = compiling_env()
    run = subprocess.run([sys.executable, "-m", "selfspec.bench.kernel_resources", "--tiles", "64x128"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "BLOCK_MxBLOCK_NxWARPS" in run.stderr


def test_quantized_attention_tile_issues_mma_sync():
    """The quantized attention's one tile (16 query rows on NUM_WARPS) runs its dots on mma.sync for every KV read,
    within the launch's register cap (4 programs an SM); another cap reaches ptxas (96: more spills)."""
    from selfspec.kernels import triton_quant_attention as tqa  # here: collection must not define its kernels

    rows = report("--attention", "--warps", "4", "8")
    tile = [r for r in rows if r[0] == f"{tqa.TILE_ROWS} x {tqa.NUM_WARPS}"]
    assert len(tile) == 3 and all(r[2] == str(tqa.MAX_REGISTERS) and 0 < int(r[3]) <= tqa.MAX_REGISTERS
                                  and r[6] == "mma.sync" for r in tile)
    assert {r[0] for r in rows} == {"16 x 4", "16 x 8", "32 x 4", "32 x 8"}
    capped = report("--attention", "--warps", "4", "--max-registers", "96")
    assert len(capped) == 6 and all(r[2] == "96" and int(r[3]) <= 96 and int(r[4]) > 0 for r in capped)


def test_shape_report_compiles_the_tiles_linear_picks():
    """--shape: one row per layer GEMM and M, with the tiles `linear` picks (w8a16 at 32 rows: 32 x 128 x 4 warps)."""
    env = compiling_env()
    out = subprocess.run([sys.executable, "-m", "selfspec.bench.kernel_resources", "--shape", "llama-3-8b", "--modes",
                          "w8a16", "--m", "32"], env=env, capture_output=True, text=True, check=True).stdout
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    rows = [r for r in rows if r[1] == "w8a16"]
    assert [r[0].split()[0] for r in rows] == ["qkv", "o", "gate/up", "down"]
    assert all(r[3].startswith("32 x 128 x 4, 128") and r[6] == "mma.sync" for r in rows)


def test_warp_specialized_gemms_compile_on_wgmma_without_spills():
    """The warp-specialized GEMMs (kernels/gluon_linear.py) compile for sm_90 in every nibble format and for w8a16's
    words (and with their K chunks in CTAs of their own, and in 64-row CTAs), for bf16 (K whole and split; on
    w8a16's scratch of codes with their channel scale), for w8a8 (K whole and a piece of it, K tiles of 256 and 128)
    and for INT4 codes with int8 activations (INT4G's in 128- and 256-row CTAs, K whole and a piece of it): wgmma
    that ptxas does not serialize (it does when registers run short: the kernel then ran at the Triton tiles' time),
    no register spilled at the registers setmaxnreg moves to the consumers, within an H100's shared memory."""
    env = compiling_env()
    out = subprocess.run([sys.executable, "-m", "selfspec.bench.kernel_resources", "--warp-specialized"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
                                          if line.startswith("| ") and not line.startswith("| mode"))}
    assert set(rows) == {"w4a16", "upper", "full", "w8a16", "full chunks apart", "w8a16 chunks apart",
                         "w4a16 64 rows", "full 64 rows", "w8a16 64 rows", "bf16 split 1", "bf16 split 4",
                         "bf16 split 4, 64 columns", "w8a16 scratch, split 4", "w8a8", "w8a8 piece of K",
                         "w8a8, K tiles of 128", "w4a8 / w4a4, 64 rows", "w4a8 / w4a4, 128 rows",
                         "w4a8 / w4a4 on int4g, 128 rows", "w4a8 / w4a4 on int4g, 128 rows, piece of K",
                         "w4a8 / w4a4 on int4g, 256 rows", "w4a8 / w4a4 on int4g, 256 rows, piece of K"}
    for mode, (_, stages, _, stack, shared, mma, serialized) in rows.items():
        assert (stages == "-" or int(stages) >= 2) and stack == "0" and int(shared) <= 232448 and mma == "wgmma", mode
        assert serialized == "no", mode


def test_attention_kernels_compile_with_tails():
    """The bf16 attention's split and in-program kernels compile for sm_90 with tails (a tree's branch rows over one
    row; the interpreter does not type-check a branch that redefines a value), on mma.sync, at the decode tiles and
    the verify tiles (32 rows on 4 warps: a padding test per row, not per tile, failed Triton's layout pass there)."""
    code = ("from selfspec.bench.kernel_resources import compile_attention, resources\n"
            "for p in (False, True):\n"
            "    for rows, warps in ((16, 8), (32, 4)):\n"
            "        print(p, resources(compile_attention(p, True, rows, warps)).mma)\n")
    out = run_code(code)
    assert out.split() == ["False", "mma.sync"] * 2 + ["True", "mma.sync"] * 2


def test_tree_attention_kernel_compiles_on_mma_sync():
    """The tree attention's kernel (each node's query once, kernels/triton_attention.py) compiles for sm_90 at its
    tiles (TREE_TILES, WIDE_TREE_TILES), on mma.sync, within a thread's registers."""
    code = ("from selfspec.bench.kernel_resources import compile_tree_attention, resources\n"
            "for rows, warps in ((16, 4), (32, 4)):\n"
            "    r = resources(compile_tree_attention(rows, warps))\n"
            "    print(r.mma, 0 < r.registers <= 255)\n")
    out = run_code(code)
    assert out.split() == ["mma.sync", "True"] * 2


def test_the_k_loop_of_a_decode_tile_issues_its_mma_instructions():
    """mma_loop finds a decode tile's K loop in its SASS: each warp issues its share of the tile's m16n8k16 MMAs per
    K tile (BLOCK_M 16 x BLOCK_N x BLOCK_K over 16 x 8 x 16), among the instructions that build the weights; the
    --shape report gives the count."""
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import linear_tiles\n"
            "for mode, n in (('full', 28672), ('upper', 6144), ('w4a16', 28672)):\n"
            "    cfg = linear_tiles.decode_config(kr.FORMATS[mode], False, n, 4096, 128)\n"
            "    loop = kr.mma_loop(kr.compile_linear(mode, cfg))\n"
            "    share = (cfg.block_n // 8) * (cfg.block_k // 16) // cfg.num_warps\n"
            "    print(loop.ops['HMMA'], share, loop.instructions, loop.ops.get('HFMA2', 0))\n")
    out = run_code(code)
    for line in out.splitlines():
        mma, share, instructions, fmas = map(int, line.split())
        assert mma == share and instructions > 4 * mma and fmas > 0  # the bf16 FMAs that dequantize
    out = subprocess.run([sys.executable, "-m", "selfspec.bench.kernel_resources", "--shape", "llama-3-8b", "--modes",
                          "upper", "--m", "1"], env=compiling_env(), capture_output=True, text=True, check=True).stdout
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    rows = [r for r in rows if r[1] == "upper"]
    assert len(rows) == 4 and all(int(r[7].split()[0]) > 0 for r in rows)


def test_nibble_tiles_keep_their_shared_tiles_swizzled():
    """The nibble kernel's tiles, decode's and the 64-row ones, stage x and the weights in swizzled shared memory: a
    buffer with no swizzle (x loaded whole and permuted in registers, as session 33's quarter-order patch first did)
    made the decode tiles 1.3-2.3x slower on an H100 with as many instructions."""
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import linear_tiles\n"
            "for mode in ('w4a16', 'upper', 'full', 'w4a8'):\n"
            "    for m in (1, 96):\n"
            "        cfg = linear_tiles.tile_config(kr.FORMATS[mode], mode == 'w4a8', 6144, 4096, 128, m)\n"
            "        print(mode, m, cfg.block_m, kr.unswizzled_tiles(kr.compile_linear(mode, cfg)))\n")
    rows = run_code(code).splitlines()
    assert len(rows) == 8 and {r.split()[2] for r in rows} == {"16", "64"}, rows
    assert all(r.endswith(" []") for r in rows), rows


def test_int8_activation_tiles_the_gate_admits_are_the_ones_that_compile():
    """w4a8 / w4a4 reach the warp-specialized kernel only in K tiles it compiles for: tiles of 64 (quant groups of
    64, SmolLM2's 576 columns) failed in Triton's compile pipeline on the GPU, and take the Triton tiles instead."""
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import gluon_linear as gll\n"
            "for block_k in (64, 128):\n"
            "    try:\n"
            "        kr.compile_act_warp_specialized(block_k=block_k, group=block_k)\n"
            "        compiled = True\n"
            "    except RuntimeError:\n"
            "        compiled = False\n"
            "    print(block_k, compiled, gll.takes_act_tiles(block_k))\n")
    rows = [line.split() for line in run_code(code).splitlines()]
    assert rows == [["64", "False", "False"], ["128", "True", "True"]]


# The int8 decode tile's weight tile [64 rows, 64 bytes] under the 64-byte swizzle, read 8 bytes a thread in two
# lane layouts Triton gave session 34's quarter-order patch: lanes 4-31 on rows 1, 2, 4, then on rows 1, 4, 2 (its
# rows in bank order). Nsight Compute saw the first one's conflicts on an H100; the second's ran without them.
LINEAR = ("#ttg.linear<{register = [[0, 1], [0, 2], [0, 4], [0, 32], [32, 0]], lane = [[0, 8], [0, 16], %s], "
          "warp = [[8, 0], [16, 0]], block = []}>")
WEIGHT_READS = "\n".join([
    "#shared = #ttg.nvmma_shared<{swizzlingByteWidth = 64, transposed = false, elementBitWidth = 8}>",
    "#rows124 = " + LINEAR % "[1, 0], [2, 0], [4, 0]",
    "#rows142 = " + LINEAR % "[1, 0], [4, 0], [2, 0]",
    "%a = ttg.local_load %w : !ttg.memdesc<64x64xi8, #shared, #smem, mutable> -> tensor<64x64xi8, #rows124> loc(#l)",
    "%b = ttg.local_load %w : !ttg.memdesc<64x64xi8, #shared, #smem, mutable> -> tensor<64x64xi8, #rows142> loc(#l)",
])


def test_shared_load_model_finds_the_bank_conflicts_seen_on_the_gpu():
    """Rows n and n + 2 of a 64-byte-swizzled tile share banks, so a half-warp reading 32 bytes of rows n .. n + 3
    takes two wavefronts where one would do; rows n, n + 1, n + 4, n + 5 do not conflict."""
    from selfspec.bench.kernel_resources import SharedLoad, shared_loads_of
    assert shared_loads_of(WEIGHT_READS) == [SharedLoad("64x64xi8", 8, 4, 16, 8), SharedLoad("64x64xi8", 8, 4, 8, 8)]


def test_nibble_decode_tiles_read_shared_memory_without_bank_conflicts():
    """Every modelled read of a shared tile in the nibble kernel's decode tiles (16 rows) takes its least
    wavefronts: x's tile and the weight's, for the bf16-activation builds and the int8 ones, and w8a16's words."""
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import linear_tiles\n"
            "for mode in ('w4a16', 'upper', 'full', 'w4a8', 'w8a16'):\n"
            "    cfg = linear_tiles.tile_config(kr.FORMATS[mode], mode == 'w4a8', 6144, 4096, 128, 16)\n"
            "    loads = kr.shared_loads(kr.compile_linear(mode, cfg))\n"
            "    print(mode, len(loads), all(r.wavefronts == r.least for r in loads))\n")
    rows = [line.split() for line in run_code(code).splitlines()]
    assert [r[0] for r in rows] == ["w4a16", "upper", "full", "w4a8", "w8a16"], rows
    assert all(int(r[1]) >= 1 for r in rows), rows
    assert all(r[2] == "True" for r in rows), rows


def test_64_row_nibble_tiles_read_x_without_bank_conflicts():
    """The 64-row tiles of `full` and w4a8 (x by TMA) read x's box at its least wavefronts: its rows in bank order."""
    code = ("from selfspec.bench import kernel_resources as kr\n"
            "from selfspec.kernels import linear_tiles\n"
            "for mode in ('full', 'w4a8'):\n"
            "    cfg = linear_tiles.tile_config(kr.FORMATS[mode], mode == 'w4a8', 6144, 4096, 128, 96)\n"
            "    loads = kr.shared_loads(kr.compile_linear(mode, cfg))\n"
            "    print(mode, cfg.block_m, len(loads), all(r.wavefronts == r.least for r in loads))\n")
    assert [line.split() for line in run_code(code).splitlines()] == [["full", "64", "1", "True"],
                                                                      ["w4a8", "64", "1", "True"]]
