"""Triton kernels against the torch references, on CPU through Triton's interpreter.

The interpreter runs each program with numpy on the kernel's own block shapes, so these tests check the
kernels' logic (formats, offsets, masks, causal offsets) and that a row's result does not depend on how many
rows there are; tests/gpu/test_gpu_kernels.py checks the compiled kernels at real shapes.
"""
import os
from dataclasses import replace

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a CUDA device is here: tests/gpu tests the compiled kernels (TRITON_INTERPRET=1 runs this file)",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: @triton.jit then interprets them

pytest.importorskip("triton", reason="triton is not installed: no Triton kernels to test")

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from selfspec.errors import SelfspecError  # noqa: E402
from selfspec.kernels import Handover, reference, reference_op, semaphores, triton_attention  # noqa: E402
from selfspec.kernels import linear_tiles, triton_linear, triton_quant_attention, triton_small  # noqa: E402
from selfspec.quant.act import quantize_per_token  # noqa: E402
from selfspec.quant.formats import STORAGES, quantize_weight, storage_supports  # noqa: E402
from selfspec.quant.modes import MODES  # noqa: E402
from selfspec.quant.rotation import hadamard  # noqa: E402
from kernel_oracles import (TOL, attention_oracle, linear_oracle, rel_err, rope_angles,  # noqa: E402
                            scatter_to_pool)

if not isinstance(triton_linear._linear_kernel, interpreter.InterpretedFunction):
    pytest.skip("the Triton kernels were defined before TRITON_INTERPRET=1 was set: run this file on its own",
                allow_module_level=True)

# --- What the interpreter of Triton 3.6 gets wrong and the compiled kernels do not, fixed for these tests.
_interpreted: dict = {}
_create_dot = interpreter.InterpreterBuilder.create_dot
_cast_impl = interpreter.InterpreterBuilder.cast_impl
_patch_lang_tensor = interpreter._patch_lang_tensor


def _call_interpreted(self, *args, **kwargs):
    """Triton's own @jit helpers (tl.zeros, tl.sum, ...) are compiled-mode objects when triton was imported before
    TRITON_INTERPRET was set (tests/conftest.py imports transformers, which imports triton): interpret them too."""
    if self.fn not in _interpreted:
        _interpreted[self.fn] = interpreter.InterpretedFunction(self.fn)
    return _interpreted[self.fn](*args, **kwargs)


def _widened(h):
    """bf16 is held as raw uint16 bits, which np.matmul would multiply as integers: widen them to fp32."""
    if h.dtype.scalar != tl.bfloat16:
        return h
    return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def _dot_on_values(self, a, b, d, *args):
    """Float dots summed in float64 and rounded once: numpy's float32 matmul (OpenBLAS, its kernel picked for the
    CPU at run time) may sum a row in an order that depends on the row's place in the tile, which the batch
    invariance tests would take for the kernel's doing."""
    a, b = _widened(a), _widened(b)
    if d.data.dtype != np.float32:
        return _create_dot(self, a, b, d, *args)
    exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
    return interpreter.TensorHandle(exact + d.data, d.dtype.scalar)


def _cast_rounding(self, src, dst_type):
    """fp32 -> bf16 truncates in the interpreter; the GPU (and torch) round to nearest even."""
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = torch.from_numpy(np.array(src.data)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)
    return _cast_impl(self, src, dst_type)


def _patch_index(tensor, scope):
    """numpy >= 2.4 refuses int() of a 1-element array, which loop bounds use (triton-lang/triton#9171)."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


@pytest.fixture(autouse=True, scope="module")
def _interpreter_fixes():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(JITFunction, "__call__", _call_interpreted)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", _dot_on_values)
        mp.setattr(interpreter.InterpreterBuilder, "cast_impl", _cast_rounding)
        mp.setattr(interpreter, "_patch_lang_tensor", _patch_index)
        yield


# --- linear

PAIRS = [(s, m) for s in STORAGES for m in MODES if storage_supports(s, MODES[m]) and m != "fp32"]
SHAPES = [(72, 192, 64, True), (64, 256, 128, False)]  # N, K, group, bias: partial N tile; K not a multiple of 128


@pytest.mark.parametrize("storage,mode_name", PAIRS)
@pytest.mark.parametrize("n,k,group,with_bias", SHAPES)
def test_linear_matches_reference_and_is_batch_invariant(storage, mode_name, n, k, group, with_bias):
    torch.manual_seed(0)
    mode = MODES[mode_name]
    w = torch.randn(n, k)
    weight = quantize_weight(w.bfloat16() if storage == "dense" else w, storage, group)
    assert triton_linear.kernel_format(weight, mode) is not None
    bias = torch.randn(n).bfloat16() if with_bias else None
    x = torch.randn(1, 9, k).bfloat16()
    y = triton_linear.linear(x, weight, mode, bias)
    assert y.shape == (1, 9, n) and y.dtype == torch.bfloat16
    oracle = linear_oracle(x[0], weight, mode, bias)
    assert rel_err(reference_op("linear", storage)(x, weight, mode, bias)[0], oracle) < TOL
    # Interpreted launches are slow: M = 1 (row 0 alone) and M = 9 (y) are not launched a second time.
    alone = [triton_linear.linear(x[:, i:i + 1], weight, mode, bias)[0] for i in range(9)]
    for m, ym in ((1, alone[0]), (3, triton_linear.linear(x[:, :3], weight, mode, bias)[0]), (9, y[0])):
        assert rel_err(ym, oracle[:m]) < TOL
    for i in range(9):  # a row alone gives the same bits as among 9
        assert torch.equal(alone[i][0], y[0, i])


@pytest.mark.parametrize("bits", [8, 4])
def test_act_quant_matches_quantize_per_token(bits):
    torch.manual_seed(1)
    x = torch.randn(5, 1100).bfloat16()  # K not a power of two: the row masked past K
    x[2, 7] = 40.0  # an outlier row
    q, s = triton_linear.act_quant(x, bits)
    q_ref, s_ref = quantize_per_token(x, bits)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


def test_linear_falls_back_to_reference_where_not_covered():
    torch.manual_seed(2)
    x = torch.randn(3, 64).bfloat16()
    dense = quantize_weight(torch.randn(32, 64), "dense")
    int4_g16 = quantize_weight(torch.randn(32, 64), "int4", 16)  # groups of 16: smaller than any int8 dot
    cases = [(x, dense, "fp32"), (x.float(), dense, "bf16"), (x, int4_g16, "w4a16")]
    assert triton_linear.kernel_format(dense, MODES["fp32"]) is None
    assert triton_linear.kernel_format(int4_g16, MODES["w4a16"]) is None
    for xi, weight, mode_name in cases:
        ref = reference_op("linear", weight.storage)(xi, weight, MODES[mode_name], None)
        assert torch.equal(triton_linear.linear(xi, weight, MODES[mode_name], None), ref)


# --- attention


def kv_cache(b: int, h: int, slots: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, h, slots, d).bfloat16(), torch.randn(b, h, slots, d).bfloat16()


def rows_table(b: int) -> torch.Tensor:
    """The block table of a contiguous cache: one block per row."""
    return torch.arange(b)[:, None]


def test_attention_decode_matches_reference_and_is_invariant_in_queries():
    torch.manual_seed(3)
    k_all, v_all = kv_cache(2, 2, 768, 32)
    q = torch.randn(2, 4, 5, 32).bfloat16()  # GQA: 4 query heads on 2 kv heads
    # Each row at its own positions; row 0's 5 queries straddle a key chunk's end (512, a multiple of CHUNK).
    pos = torch.stack((torch.arange(509, 514), torch.arange(30, 35)))
    table = rows_table(2)
    out = triton_attention.attention(q, k_all, v_all, table, pos)  # the whole buffer, stale slots past pos included
    assert rel_err(out, attention_oracle(q, k_all, v_all, pos)) < TOL
    assert rel_err(reference_op("attention")(q, k_all, v_all, table, pos), attention_oracle(q, k_all, v_all, pos)) < TOL
    for b in range(2):
        for t in range(5):  # each query alone, in a batch of one
            alone = triton_attention.attention(q[b:b + 1, :, t:t + 1], k_all[b:b + 1], v_all[b:b + 1],
                                               rows_table(1), pos[b:b + 1, t:t + 1])
            assert torch.equal(alone[0, :, 0], out[b, :, t]), f"row {b} query {t}"


def test_attention_prefill_is_causal():
    torch.manual_seed(4)
    k, v = kv_cache(1, 1, 64, 32)
    q = torch.randn(1, 3, 20, 32).bfloat16()  # 20 queries: two query tiles; 3 query heads on one kv head
    pos = torch.arange(20)[None]
    out = triton_attention.attention(q, k, v, rows_table(1), pos)
    assert rel_err(out, attention_oracle(q, k, v, pos)) < TOL
    alone = triton_attention.attention(q[:, :, 17:18], k, v, rows_table(1), pos[:, 17:18])
    assert torch.equal(alone, out[:, :, 17:18])


@pytest.mark.parametrize("bs", [4, 16, 64, 128])
@pytest.mark.parametrize("t", [1, 4])  # a decode step; a verify pass of k + 1 = 4 queries
def test_paged_attention_matches_reference_and_contiguous_and_is_row_invariant(bs, t):
    torch.manual_seed(10)
    gen = torch.Generator().manual_seed(bs)
    k, v = kv_cache(3, 2, 640, 32)
    k_pool, v_pool, table = scatter_to_pool(k, v, bs, gen)
    q = torch.randn(3, 4, t, 32).bfloat16()  # GQA: 4 query heads on 2 kv heads
    lengths = torch.tensor([530, 37, 200])  # rows of different lengths; row 0 straddles a chunk end (512)
    pos = lengths[:, None] + torch.arange(t)  # each row's queries after its own history (causal offsets)
    out = triton_attention.attention(q, k_pool, v_pool, table, pos)
    assert rel_err(out, attention_oracle(q, k, v, pos)) < TOL
    assert rel_err(reference_op("attention")(q, k_pool, v_pool, table, pos), attention_oracle(q, k, v, pos)) < TOL
    assert torch.equal(triton_attention.attention(q, k, v, rows_table(3), pos), out)  # paged == contiguous, bitwise
    for b in range(3):  # a row alone, its table cut to the blocks it uses, gives the bits it gets among others
        used = -(-(int(pos[b, -1]) + 1) // bs)
        alone = triton_attention.attention(q[b:b + 1], k_pool, v_pool, table[b:b + 1, :used], pos[b:b + 1])
        assert torch.equal(alone, out[b:b + 1]), f"row {b}"


def test_paged_attention_padding_rows_and_bad_block_size():
    """A padding row (all trash blocks, position 0) leaves the real rows' bits alone; a block size that neither
    divides the 128-key tile nor is a multiple of it is refused."""
    torch.manual_seed(11)
    k, v = kv_cache(2, 2, 64, 32)
    k_pool, v_pool, table = scatter_to_pool(k, v, 16, torch.Generator().manual_seed(0))
    q = torch.randn(3, 4, 1, 32).bfloat16()
    pos = torch.tensor([[40], [9], [0]])
    padded = torch.cat((table, torch.zeros(1, table.shape[1], dtype=torch.long)))  # trash block 0 pads
    out = triton_attention.attention(q, k_pool, v_pool, padded, pos)
    assert torch.equal(out[:2], triton_attention.attention(q[:2], k_pool, v_pool, table, pos[:2]))
    assert out[2].isfinite().all()
    odd = torch.randn(4, 2, 24, 32).bfloat16()  # blocks of 24 slots
    with pytest.raises(SelfspecError, match="divide 128"):
        triton_attention.attention(q, odd, odd, padded, pos)


SPLIT, IN_PROGRAM = triton_attention.Tiles(), triton_attention.Tiles(in_program=True)


def paged_prompt(t: int, start: int, bs: int, seed: int):
    """q [2, 4, t, 32] (GQA: 4 query heads on 2 kv heads) at positions start..start + t - 1 (row 1: 3 later),
    over 640 keys in a paged cache of shuffled blocks: (q, k, v, k_pool, v_pool, table, pos)."""
    torch.manual_seed(seed)
    k, v = kv_cache(2, 2, 640, 32)
    k_pool, v_pool, table = scatter_to_pool(k, v, bs, torch.Generator().manual_seed(seed))
    q = torch.randn(2, 4, t, 32).bfloat16()
    pos = torch.stack((torch.arange(start, start + t), torch.arange(start + 3, start + 3 + t)))
    return q, k, v, k_pool, v_pool, table, pos


@pytest.mark.parametrize("t,start,bs", [(1, 300, 16), (9, 250, 128), (40, 0, 16), (24, 500, 64)])
def test_in_program_attention_is_the_split_path_bitwise(t, start, bs):
    """One program walking all its chunks gives each query the bits of chunks split over programs and merged by
    the merge kernel: decode, a verify pass straddling a chunk end (256), a prompt from 0, one crossing 512."""
    q, k, v, k_pool, v_pool, table, pos = paged_prompt(t, start, bs, seed=t)
    out = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=IN_PROGRAM)
    assert rel_err(out, attention_oracle(q, k, v, pos)) < TOL
    assert torch.equal(out, triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=SPLIT))
    assert torch.equal(out, triton_attention.attention(q, k, v, rows_table(2), pos, tiles=IN_PROGRAM))  # == contiguous


@pytest.mark.parametrize("bs,start,t", [(None, 250, 5), (16, 500, 12), (64, 120, 5)])
def test_attention_reads_a_rows_own_keys_from_its_tails_bitwise(bs, start, t):
    """With `tails`, a row's keys from its first query on are read where tails say (a tree's branch row over its
    sequence's row: model.TreeLayout): the bits of a row holding the same keys in order, split and in-program,
    contiguous and paged; the positions in order hold other keys, which must not be read. Row 1 repeats its last
    query (a branch shorter than the pass, padded; at 12 queries a whole tile of it)."""
    torch.manual_seed(start)
    k, v = kv_cache(2, 2, 640, 32)
    q = torch.randn(2, 4, t, 32).bfloat16()
    pos = torch.stack((torch.arange(start, start + t), torch.tensor([0, 1] + [2] * (t - 2)) + start + 7))
    tails = torch.stack([p0 + t + 20 + torch.randperm(30)[:t] for p0 in pos[:, 0].tolist()])
    tails[1, 3:] = tails[1, 2]
    moved_k, moved_v = torch.randn_like(k), torch.randn_like(v)  # in order: other keys
    for b, keys in enumerate((t, 3)):  # row 1 has 3 keys of its own
        n = int(pos[b, 0])
        moved_k[b, :, :n], moved_v[b, :, :n] = k[b, :, :n], v[b, :, :n]
        at = tails[b, :keys]
        moved_k[b, :, at], moved_v[b, :, at] = k[b, :, n:n + keys], v[b, :, n:n + keys]
    assert torch.equal(reference.attention(q, moved_k, moved_v, rows_table(2), pos, tails=tails),
                       reference.attention(q, k, v, rows_table(2), pos))
    if bs is None:
        pools, in_order = (moved_k, moved_v, rows_table(2)), (k, v, rows_table(2))
    else:
        pools = scatter_to_pool(moved_k, moved_v, bs, torch.Generator().manual_seed(start))
        in_order = scatter_to_pool(k, v, bs, torch.Generator().manual_seed(start + 1))
    live = torch.ones_like(pos, dtype=torch.bool)
    live[1, 3:] = False  # row 1's padding: its output is left undefined
    for tiles in (SPLIT, IN_PROGRAM):
        out = triton_attention.attention(q, *pools, pos, tiles=tiles, tails=tails).transpose(1, 2)[live]
        assert torch.equal(out, triton_attention.attention(q, *in_order, pos, tiles=tiles).transpose(1, 2)[live])
    assert rel_err(out, attention_oracle(q, k, v, pos).transpose(1, 2)[live]) < TOL


def test_attention_prefill_equals_the_prompt_cut_into_pieces_bitwise():
    """A prompt of 300 queries in one in-program call gives each query the bits it gets when the prompt is
    prefilled in pieces of fewer queries by either path, the cache holding the earlier keys, each piece's table cut
    to the blocks it reaches."""
    q, k, v, k_pool, v_pool, table, pos = paged_prompt(300, 0, 16, seed=5)
    q, k, v, table, pos = q[1:], k[1:], v[1:], table[1:], pos[1:]  # row 1: the prompt follows 3 cached keys
    whole = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=IN_PROGRAM)
    assert rel_err(whole, attention_oracle(q, k, v, pos)) < TOL
    for lo, hi in [(0, 100), (100, 257), (257, 300)]:
        used = -(-(int(pos[0, hi - 1]) + 1) // 16)
        for tiles in (SPLIT, IN_PROGRAM):
            piece = triton_attention.attention(q[:, :, lo:hi], k_pool, v_pool, table[:, :used], pos[:, lo:hi],
                                               tiles=tiles)
            assert torch.equal(piece, whole[:, :, lo:hi]), f"queries {lo}..{hi - 1}, {tiles}"


def test_prompt_attention_equals_the_prompt_cut_into_pieces():
    """Prompt queries take their own tiles (PROMPT_TILES) at any count: a 300-query prompt in one call == its
    pieces, each a prompt call too."""
    q, k, v, k_pool, v_pool, table, pos = paged_prompt(300, 0, 16, seed=6)
    whole = triton_attention.attention(q, k_pool, v_pool, table, pos, prompt=True)
    assert rel_err(whole, attention_oracle(q, k, v, pos)) < TOL
    for lo, hi in [(0, 1), (1, 130), (130, 300)]:
        used = -(-(int(pos[:, hi - 1].max()) + 1) // 16)
        piece = triton_attention.attention(q[:, :, lo:hi], k_pool, v_pool, table[:, :used], pos[:, lo:hi], prompt=True)
        assert torch.equal(piece, whole[:, :, lo:hi]), f"queries {lo}..{hi - 1}"


def test_attention_dispatcher_takes_verify_tiles_for_batched_verify_passes():
    """Speed only (every tiling gives the same bits, tests/gpu): 32-row 4-warp tiles where a batch's verify pass
    has more rows per kv head than a 16-row tile holds (from batch 32 not split over the keys, but a tree's); 16-row
    tiles for decode steps and for small batches."""
    tiles = triton_attention._tiles
    assert tiles(32, 8, 5, 4, prompt=False) == triton_attention.WIDE_VERIFY_TILES  # no split: fills the GPU
    assert tiles(16, 8, 5, 4, prompt=False) == triton_attention.VERIFY_TILES
    assert tiles(8, 8, 9, 4, prompt=False) == triton_attention.VERIFY_TILES
    assert tiles(32, 8, 1, 4, prompt=False) == triton_attention.DECODE_TILES  # 4 rows: one 16-row tile
    assert tiles(1, 8, 5, 4, prompt=False) == triton_attention.DECODE_TILES  # 8 kv heads: too few programs
    assert tiles(1, 8, 300, 4, prompt=False) == triton_attention.PREFILL_TILES
    assert tiles(32, 8, 5, 4, prompt=True) == triton_attention.PROMPT_TILES
    # A tree's branch rows (tails): split 32-row tiles at any batch, never in-program.
    assert tiles(1, 8, 9, 4, prompt=False, tails=True) == triton_attention.VERIFY_TILES
    assert tiles(32, 8, 9, 4, prompt=False, tails=True) == triton_attention.VERIFY_TILES


@pytest.mark.parametrize("in_program", [False, True])
def test_attention_tile_heights_run_and_agree(in_program):
    """Taller tiles compute the same attention. The interpreter cannot show tensor-core rounding: tests/gpu compares
    their bits."""
    q, k, v, k_pool, v_pool, table, pos = paged_prompt(20, 260, 16, seed=7)
    base = triton_attention.attention(q, k_pool, v_pool, table, pos,
                                      tiles=triton_attention.Tiles(in_program=in_program))
    for block_t, warps in ((16, 8), (32, 4), (32, 8), (64, 8)):
        tiles = triton_attention.Tiles(block_t, in_program, warps)
        out = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=tiles)
        assert rel_err(out, attention_oracle(q, k, v, pos)) < TOL, tiles
        torch.testing.assert_close(out, base)
    with pytest.raises(SelfspecError, match="power of two >= 16"):
        triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=triton_attention.Tiles(block_t=8))


# --- small ops


def test_rms_norm():
    torch.manual_seed(5)
    x, w = torch.randn(2, 3, 96).bfloat16(), torch.randn(96).bfloat16()  # 96: a masked tail in the block
    y = triton_small.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, reference_op("rms_norm")(x, w, 1e-6))
    assert torch.equal(triton_small.rms_norm(x[1:2, 2:], w, 1e-6), y[1:2, 2:])


def row_sums_oracle(y: torch.Tensor) -> torch.Tensor:
    """y's rows summed per ROW_SUM_COLS columns in float64: [rows, D / ROW_SUM_COLS]."""
    cols = triton_small.ROW_SUM_COLS.value
    return y.double().reshape(-1, y.shape[-1] // cols, cols).sum(-1)


def test_producers_hand_bf16_activations_nothing():
    """The GEMMs take nothing of bf16 activations from the op that wrote them (the nibble kernels dequantize their
    weights): the norm and swiglu hand over None, and write the same outputs as without a handover."""
    torch.manual_seed(5)
    x, w = torch.randn(2, 3, 192).bfloat16(), torch.randn(192).bfloat16()
    y, given = triton_small.rms_norm_handover(x, w, 1e-6)
    assert given is None and torch.equal(y, triton_small.rms_norm(x, w, 1e-6))
    gate, up = (torch.randn(3, 2, 1088).bfloat16() * 3 for _ in range(2))
    y, given = triton_small.swiglu_handover(gate, up)
    assert given is None and torch.equal(y, triton_small.swiglu(gate, up))


def quartered_rows(y: torch.Tensor, block_k: int) -> torch.Tensor:
    """y [..., K] as the linear would quarter it (gluon_linear.quartered, its order checked column by column by
    test_quartered_puts_each_k_tiles_columns_in_the_dots_order)."""
    from selfspec.kernels import gluon_linear
    return gluon_linear.quartered(y.reshape(-1, y.shape[-1]).contiguous(), block_k).view(y.shape)


@pytest.mark.parametrize("block_k", [64, 128])
def test_producers_write_bf16_activations_quartered_when_asked(block_k):
    """Asked for a linear that quarters its input (`quarters_input`), the norm and swiglu write their outputs with
    each K tile's columns quartered, the values bit for bit their plain outputs', and say so (Handover.quartered);
    a row length that is not whole tiles is written plainly, with nothing handed over."""
    torch.manual_seed(7)
    x, w = torch.randn(2, 3, 384).bfloat16(), torch.randn(384).bfloat16()
    y, given = triton_small.rms_norm_handover(x, w, 1e-6, quartered=block_k)
    assert given.quartered == block_k and given.codes is None
    assert torch.equal(y, quartered_rows(triton_small.rms_norm(x, w, 1e-6), block_k))
    gate, up = (torch.randn(3, 2, 2176).bfloat16() * 3 for _ in range(2))  # 17 tiles of 128: a partial BLOCK
    y, given = triton_small.swiglu_handover(gate, up, quartered=block_k)
    assert given.quartered == block_k
    assert torch.equal(y, quartered_rows(triton_small.swiglu(gate, up), block_k))
    y, given = triton_small.rms_norm_handover(x[..., :96], w[:96], 1e-6, quartered=block_k)
    assert given is None and torch.equal(y, triton_small.rms_norm(x[..., :96], w[:96], 1e-6))


def test_a_linear_refuses_x_quartered_for_another_path():
    """x handed over quartered to a linear that would not quarter it (here: the interpreter's, which quarters
    nothing) is refused, not read in the wrong order."""
    x = torch.randn(4, 256).bfloat16()
    weight = quantize_weight(torch.randn(128, 256) * 0.02, "int4", 128)
    prompt = replace(MODES["w4a16"], prompt=True)
    with pytest.raises(ValueError, match="quartered"):
        triton_linear.linear(x, weight, prompt, None, handover=Handover(quartered=128))


def assert_act_quant_codes(y: torch.Tensor, given, bits: int) -> None:
    """A producer's handed-over codes of its output y [..., K] are act_quant's and the reference's, bit for bit,
    with the codes' exact sums where K is a multiple of ROW_SUM_COLS."""
    y2 = y.reshape(-1, y.shape[-1])
    q, scale = triton_linear.act_quant(y2, bits)
    ref_q, ref_scale = quantize_per_token(y2, bits)
    assert given.bits == bits and torch.equal(given.codes, q) and torch.equal(given.codes, ref_q)
    assert torch.equal(given.scale, scale) and torch.equal(given.scale, ref_scale)
    if y.shape[-1] % triton_small.ROW_SUM_COLS.value:
        assert given.sums is None
    else:
        assert torch.equal(given.sums.double(), row_sums_oracle(q))


@pytest.mark.parametrize("d,bits", [(192, 8), (640, 4), (96, 8)])  # 96: codes without sums
def test_rms_norm_hands_over_its_codes(d, bits):
    """With a linear's act_bits the norm hands over its output quantized per token, exactly as act_quant would
    quantize it (the output itself unchanged), each row the same alone."""
    torch.manual_seed(6)
    x, w = torch.randn(2, 3, d).bfloat16() * 3, torch.randn(d).bfloat16()
    y, given = triton_small.rms_norm_handover(x, w, 1e-6, act_bits=bits)
    assert torch.equal(y, triton_small.rms_norm(x, w, 1e-6))
    assert_act_quant_codes(y, given, bits)
    alone = triton_small.rms_norm_handover(x[1:2, 2:], w, 1e-6, act_bits=bits)[1]
    assert torch.equal(alone.codes, given.codes[5:6]) and torch.equal(alone.scale, given.scale[5:6])


def fused_qkv(b: int, t: int, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k, v [B, Hkv, T, D] as the model has them: strided views of one fused projection output."""
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d).bfloat16()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return tuple(x.view(b, t, -1, d).transpose(1, 2) for x in (q, k, v))


def paged_slots(pos: torch.Tensor, table: torch.Tensor, bs: int) -> torch.Tensor:
    return table.gather(1, pos // bs) * bs + pos % bs


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_rope_and_store_matches_reference_bitwise(layout):
    torch.manual_seed(13)
    b, t, hq, hkv, d = 3, 4, 6, 2, 32  # GQA; 6 query heads: a masked tail in the block of heads
    q, k, v = fused_qkv(b, t, hq, hkv, d)
    pos = torch.stack((torch.arange(21, 25), torch.arange(5, 9), torch.arange(0, 4)))  # each row its own
    cos, sin = rope_angles(pos, d // 2)
    if layout == "contiguous":  # one block of 32 slots per row
        n, bs = b, 32
        slots = torch.arange(b)[:, None] * bs + pos
    else:  # blocks of 4 at shuffled ids; row 2 is padding: its table is all trash block 0
        n, bs = 16, 4
        table = torch.randperm(n - 1)[:14].view(2, 7) + 1
        slots = paged_slots(pos, torch.cat((table, torch.zeros(1, 7, dtype=torch.long))), bs)
    k_pool, v_pool = torch.randn(n, hkv, bs, d).bfloat16(), torch.randn(n, hkv, bs, d).bfloat16()
    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    before_k, before_v = k_pool.clone(), v_pool.clone()

    q_out = triton_small.rope_and_store(q, k, v, cos, sin, k_pool, v_pool, slots)
    ref_q = reference_op("rope_and_store")(q, k, v, cos, sin, ref_k_pool, ref_v_pool, slots)
    assert torch.equal(q_out, ref_q) and torch.equal(ref_q, reference.rope(q, cos, sin))
    assert torch.equal(k_pool, ref_k_pool) and torch.equal(v_pool, ref_v_pool)
    k_rot = reference.rope(k, cos, sin)
    for row in range(b):
        for i in range(t):  # token (row, i) sits at its slot
            block, offset = divmod(int(slots[row, i]), bs)
            assert torch.equal(k_pool[block, :, offset], k_rot[row, :, i])
            assert torch.equal(v_pool[block, :, offset], v[row, :, i])
    written = torch.zeros(n * bs, dtype=torch.bool)
    written[slots.flatten()] = True
    untouched = ~written.view(n, bs)  # [N, bs]: index of the [N, bs, Hkv, D] views
    assert torch.equal(k_pool.transpose(1, 2)[untouched], before_k.transpose(1, 2)[untouched])
    assert torch.equal(v_pool.transpose(1, 2)[untouched], before_v.transpose(1, 2)[untouched])
    alone = triton_small.rope_and_store(q[1:2], k[1:2], v[1:2], cos[1:2], sin[1:2], k_pool, v_pool, slots[1:2])
    assert torch.equal(alone, q_out[1:2])  # a row alone gives the bits it gets among others


def test_rope_and_store_falls_back_to_reference_outside_bf16():
    """float32 q/k/v (the CPU tests' models) into a bf16 cache take the reference: k, v rounded to the pools' dtype."""
    torch.manual_seed(14)
    q, k, v = (x.float() for x in fused_qkv(2, 3, 4, 2, 16))
    pos = torch.stack((torch.arange(3), torch.arange(10, 13)))
    cos, sin = rope_angles(pos, 8)
    slots = torch.arange(2)[:, None] * 16 + pos
    k_pool, v_pool = torch.randn(2, 2, 16, 16).bfloat16(), torch.randn(2, 2, 16, 16).bfloat16()
    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    q_out = triton_small.rope_and_store(q, k, v, cos, sin, k_pool, v_pool, slots)
    ref_q = reference_op("rope_and_store")(q, k, v, cos, sin, ref_k_pool, ref_v_pool, slots)
    assert q_out.dtype == torch.float32 and torch.equal(q_out, ref_q)
    assert torch.equal(k_pool, ref_k_pool) and torch.equal(v_pool, ref_v_pool)
    assert torch.equal(v_pool[1, :, 10:13], v[1].bfloat16())


def test_swiglu():
    torch.manual_seed(7)
    gate, up = torch.randn(3, 5, 96).bfloat16() * 4, torch.randn(3, 5, 96).bfloat16()
    y = triton_small.swiglu(gate, up)
    torch.testing.assert_close(y, reference_op("swiglu")(gate, up))
    assert torch.equal(triton_small.swiglu(gate[1:2], up[1:2]), y[1:2])


@pytest.mark.parametrize("h,bits", [(1088, 8), (1088, 4), (200, 8)])  # 200: codes without sums
def test_swiglu_hands_over_its_codes(h, bits):
    """swiglu's whole-row program (its scale needs the row) writes swiglu's bits and act_quant's codes, reading
    the strided halves of a fused gate/up output, each row the same alone."""
    torch.manual_seed(7)
    gate, up = (torch.randn(3, 2, 2 * h).bfloat16() * 3).chunk(2, dim=-1)
    y, given = triton_small.swiglu_handover(gate, up, act_bits=bits)
    assert torch.equal(y, triton_small.swiglu(gate, up))
    assert_act_quant_codes(y, given, bits)
    alone = triton_small.swiglu_handover(gate[2:, 1:], up[2:, 1:], act_bits=bits)[1]
    assert torch.equal(alone.codes, given.codes[5:]) and torch.equal(alone.scale, given.scale[5:])


def test_swiglu_leaves_the_codes_of_rows_too_wide_to_the_linear(monkeypatch):
    torch.manual_seed(7)
    gate, up = torch.randn(2, 256).bfloat16(), torch.randn(2, 256).bfloat16()
    monkeypatch.setattr(triton_small, "CODES_MAX_COLS", 128)
    y, given = triton_small.swiglu_handover(gate, up, act_bits=8)
    assert torch.equal(y, triton_small.swiglu(gate, up)) and given is None


@pytest.mark.parametrize("m", [5, 8])
def test_quartered_puts_each_k_tiles_columns_in_the_dots_order(m):
    """The warp-specialized nibble GEMM's x (kernels/gluon_linear.py), in one launch: column t * BLOCK_K / 4 + j of a
    K tile holds x's column 4j + t (the quarters the decode tiles dot in turn)."""
    from selfspec.kernels import gluon_linear
    torch.manual_seed(m)
    x = torch.randn(m, 1024).bfloat16()
    q = gluon_linear.quartered(x, 128)
    for tile in range(8):
        for t in range(4):
            for j in (0, 7, 31):
                assert torch.equal(q[:, tile * 128 + t * 32 + j], x[:, tile * 128 + 4 * j + t])
    assert q.is_contiguous() and torch.equal(q.sort(dim=1).values, x.sort(dim=1).values)
    assert torch.equal(gluon_linear.quartered(x, 256)[:, 256 + 64 + 5], x[:, 256 + 4 * 5 + 1])


@pytest.mark.parametrize("live,split", [(3, 3), (9, 16)])  # every chunk; a split running past K (SmolLM2's o)
def test_sum_chunks_adds_the_chunks_in_order_as_the_consumers_do(live, split):
    """The chunks' fp32 sums added in order from zero (the split's chunks past K as zeros), then bias, the bf16
    rounding and the residual: the consumers' own epilogue."""
    torch.manual_seed(0)
    part = torch.randn(live, 5, 40) * 100
    bias, r = torch.randn(40).bfloat16(), torch.randn(5, 40).bfloat16()
    total = torch.zeros(5, 40)
    for s in range(split):
        total = total + (part[s] if s < live else 0.0)
    want = ((total + bias.float()).bfloat16().float() + r.float()).bfloat16()
    assert torch.equal(triton_small.sum_chunks(part, split, bias, r), want)
    assert torch.equal(triton_small.sum_chunks(part, split, None, None), total.bfloat16())


def test_sum_chunks_adds_int32_pieces_then_scales_as_the_int8_epilogue_does():
    """The int8 GEMM's pieces of K (kernels/gluon_linear.int8_gemm): int32 sums added exactly, converted once, times
    the row scale, then the channel scale, + bias, rounded, + residual: _linear_kernel's epilogue."""
    torch.manual_seed(1)
    part = torch.randint(-2**28, 2**28, (3, 5, 40), dtype=torch.int32)
    xs, scale = torch.rand(5) * 1e-6, torch.rand(40) * 1e-2
    bias, r = torch.randn(40).bfloat16(), torch.randn(5, 40).bfloat16()
    y = part.sum(0).float() * xs[:, None] * scale[None, :]
    want = ((y + bias.float()).bfloat16().float() + r.float()).bfloat16()
    assert torch.equal(triton_small.sum_chunks(part, 3, bias, r, scales=(xs, scale)), want)


def test_swiglu_reads_the_halves_of_a_fused_output():
    torch.manual_seed(8)
    gate_up = torch.randn(2, 3, 2 * 1100).bfloat16() * 3  # > one 1024-wide block per row
    gate, up = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    torch.testing.assert_close(triton_small.swiglu(gate, up), reference_op("swiglu")(gate, up))


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a8"), ("planes", "w4a4")])
def test_int8_activations_in_groups_of_32(storage, mode_name):
    """Groups under 64 take _linear_kernel's interleaved path (an int8 dot over half a group would be too short)."""
    torch.manual_seed(12)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 96), storage, 32)
    assert not linear_tiles.uses_nibble_kernel(triton_linear.kernel_format(weight, mode), True, 32)
    x = torch.randn(5, 96).bfloat16()
    y = triton_linear.linear(x, weight, mode, None)
    assert rel_err(y, linear_oracle(x, weight, mode, None)) < TOL
    assert torch.equal(triton_linear.linear(x[2:3], weight, mode, None), y[2:3])


def launch(x: torch.Tensor, weight, mode, cfg: linear_tiles.TileConfig) -> torch.Tensor:
    """The kernel under one tile config, with the activation quantization `linear` does first."""
    fmt, act = triton_linear.kernel_format(weight, mode), mode.act_bits is not None
    xq, xs = triton_linear.act_quant(x, mode.act_bits) if act else (x, None)
    return triton_linear._launch(xq, xs, weight, fmt, act, None, cfg)


@pytest.mark.parametrize("storage,mode_name", [("planes", "full"), ("planes", "upper"), ("int4", "w4a16"),
                                               ("int4", "w4a4"), ("int8", "w8a16")])
def test_tile_configs_compute_the_same_linear(storage, mode_name):
    """Each tile config (one K pass or K split with partials added in order; x W^T or (W x^T)^T) computes the
    same linear."""
    torch.manual_seed(8)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256), storage, 64)
    x = torch.randn(3, 256).bfloat16()
    oracle = linear_oracle(x, weight, mode, None)
    for split, swap in ((1, False), (3, True), (8, False), (1, True)):  # 3 leaves the last split a shorter K range
        y = launch(x, weight, mode, linear_tiles.TileConfig(block_n=16, block_k=64, split_k=split, swap=swap))
        assert rel_err(y, oracle) < TOL, f"split {split} swap {swap}"
    assert not semaphores._COUNTS[x.device].any()  # every split launch left its tile counts at zero


@pytest.mark.parametrize("storage,mode_name", [("dense", "bf16"), ("int8", "w8a16"), ("int8", "w8a8"),
                                               ("int4", "w4a16"), ("int4", "w4a8"), ("planes", "w8a8"),
                                               ("planes", "full"), ("int4g", "w4a16"), ("int4g", "w4a8")])
def test_many_token_tiles_keep_every_rows_bits(storage, mode_name):
    """The K chunks of a split walked in one program add up as the split's partials do, bit for bit, and larger M
    and N tiles leave each row's bits as they are; linear takes those tiles past BLOCK_M rows."""
    torch.manual_seed(9)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256).bfloat16() if storage == "dense" else torch.randn(40, 256),
                             storage, 64)
    x = torch.randn(20, 256).bfloat16()
    swap = storage == "planes" and mode.act_bits is not None
    split = linear_tiles.TileConfig(block_n=16, block_k=64, split_k=3, swap=swap)
    y = launch(x, weight, mode, split)
    for cfg in (replace(split, in_program=True), replace(split, block_m=32, block_n=32, in_program=True)):
        assert torch.equal(launch(x, weight, mode, cfg), y), cfg
    fmt, act = triton_linear.kernel_format(weight, mode), mode.act_bits is not None
    kind = linear_tiles.kernel_kind(fmt, act, 64, 40)  # the kind past decode's rows
    retiled = kind in linear_tiles.MANY_TOKENS and not swap
    first = linear_tiles.MANY_TOKENS.get(kind, [(64, None, None)])[0]
    for m in (40, first[0] + 16):  # past decode's BLOCK_M: in the first bucket and past it
        x = torch.randn(m, 256).bfloat16()
        grows = retiled and (m > first[0] or first[1] is not None)
        assert (linear_tiles.tile_config(fmt, act, 40, 256, 64, m).block_m > linear_tiles.BLOCK_M) == grows
        y = triton_linear.linear(x, weight, mode, None)
        for i in (0, m - 1):
            assert torch.equal(y[i], triton_linear.linear(x[i:i + 1], weight, mode, None)[0])
    if storage == "dense":  # past 256 rows: the last bucket's wider tiles and K tiles of 64
        x = torch.randn(300, 256).bfloat16()
        assert linear_tiles.tile_config(fmt, act, 40, 256, 64, 300).block_k == 64
        y = triton_linear.linear(x, weight, mode, None)
        for i in (0, 299):
            assert torch.equal(y[i], triton_linear.linear(x[i:i + 1], weight, mode, None)[0])


@pytest.mark.parametrize("storage,mode_name,group", [("int4", "w4a16", 64), ("planes", "full", 128),
                                                     ("planes", "upper", 64), ("int4", "w4a16", 32)])
def test_nibble_linear_dequantizes_the_reference_weight(storage, mode_name, group):
    """With bf16 activations the nibble kernel multiplies x by exactly the bf16 weight the reference dequantizes
    (one rounding of lo + s * q), in decode and many-token tiles (and in K tiles of bytes, group 32): against that
    product in float32, rounded to bf16, no output is off by more than its last bit (the order of the adds), and a
    row's bits do not depend on the rows beside it."""
    torch.manual_seed(12)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256), storage, group)
    fmt = triton_linear.kernel_format(weight, mode)
    assert not linear_tiles.takes_row_sums(fmt, False, group, linear_tiles.decode_config(fmt, False, 40, 256, group))
    w = weight.dequantize(mode).bfloat16().float()
    x = torch.randn(200, 256).bfloat16()
    y = triton_linear.linear(x, weight, mode, None)
    assert linear_tiles.tile_config(fmt, False, 40, 256, group, 200).block_m > linear_tiles.BLOCK_M
    product = (x.float() @ w.t()).bfloat16().float()
    last_bit = torch.exp2(torch.floor(torch.log2(product.abs().clamp_min(1e-30))) - 7)
    assert ((y.float() - product).abs() <= last_bit).all()
    assert (y.float() == product).float().mean() > 0.9
    for i in (0, 199):
        assert torch.equal(triton_linear.linear(x[i:i + 1], weight, mode, None)[0], y[i])
    assert torch.equal(triton_linear.linear(x[:9], weight, mode, None), y[:9])


@pytest.mark.parametrize("mode_name,group", [("w4a8", 128), ("w4a4", 64)])
def test_int8_activations_take_their_codes_row_sums_from_act_quant(mode_name, group):
    """With int8 activations the nibble kernel reads the codes' row sums that act_quant writes (exact integers)
    instead of a dot with ones: the same bits as that dot."""
    torch.manual_seed(14)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256), "int4", group)
    fmt = triton_linear.kernel_format(weight, mode)
    x = torch.randn(20, 256).bfloat16()
    xq, xs, sums = triton_linear._act_quant(x, mode.act_bits, sums=True)
    assert torch.equal(sums.double(), row_sums_oracle(xq))
    assert torch.equal(xq, triton_linear.act_quant(x, mode.act_bits)[0])
    cfg = linear_tiles.tile_config(fmt, True, 40, 256, group, 20)
    with_dot = triton_linear._launch(xq, xs, weight, fmt, True, None, cfg)
    assert torch.equal(triton_linear._launch(xq, xs, weight, fmt, True, None, cfg, sums=sums), with_dot)
    assert torch.equal(triton_linear.linear(x, weight, mode, None), with_dot)


@pytest.mark.parametrize("storage,mode_name,m", [("int8", "w8a8", 5), ("int8", "w8a8", 40), ("int4", "w4a8", 40),
                                                 ("planes", "w4a4", 5)])
def test_int8_activations_take_the_producers_codes(storage, mode_name, m):
    """Handed x's codes by the norm or swiglu that wrote x, an activation-quantized linear skips its act_quant: the
    same bits, at decode and many-token tiles; codes of other bits are not taken, codes of other rows refused."""
    torch.manual_seed(16)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256), storage, 64)
    x = torch.randn(m, 256).bfloat16()
    codes, scale, sums = triton_linear._act_quant(x, mode.act_bits, sums=True)
    given = Handover(sums=sums, codes=codes, scale=scale, bits=mode.act_bits)
    y = triton_linear.linear(x, weight, mode, None)
    assert rel_err(y, linear_oracle(x, weight, mode, None)) < TOL
    noise = torch.randn_like(x)  # what the linear reads is the codes: x itself no longer matters
    assert torch.equal(triton_linear.linear(noise, weight, mode, None, handover=given), y)
    other_bits = Handover(codes=codes, scale=scale, bits=12 - mode.act_bits)
    assert torch.equal(triton_linear.linear(x, weight, mode, None, handover=other_bits), y)
    with pytest.raises(ValueError, match="codes of shape"):
        triton_linear.linear(x[1:], weight, mode, None, handover=given)


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a16"), ("planes", "full"), ("planes", "upper")])
def test_nibble_codes_by_bytes_in_groups_of_32(storage, mode_name):
    """Groups of 32 (K tiles of 32, too narrow for the 16-bit words' four dots of K / 4) read the planes by bytes."""
    torch.manual_seed(15)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 192), storage, 32)
    fmt = triton_linear.kernel_format(weight, mode)
    cfg = linear_tiles.tile_config(fmt, False, 40, 192, 32, 5)
    assert cfg.block_k == 32 and not linear_tiles.reads_words(fmt, False, 32, cfg)
    x = torch.randn(5, 192).bfloat16()
    y = triton_linear.linear(x, weight, mode, None)
    assert rel_err(y, linear_oracle(x, weight, mode, None)) < TOL
    assert torch.equal(triton_linear.linear(x[3:4], weight, mode, None)[0], y[3])


def test_linear_ignores_row_sums_where_its_kernel_sums_itself():
    """Activation-quantized and dense GEMMs take no row sums from the caller: the same bits with or without."""
    torch.manual_seed(13)
    x = torch.randn(5, 256).bfloat16()
    sums = row_sums_oracle(x).float()
    for storage, mode_name in (("int4", "w4a8"), ("dense", "bf16"), ("int8", "w8a16")):
        w = torch.randn(40, 256)
        weight = quantize_weight(w.bfloat16() if storage == "dense" else w, storage, 128)
        mode = MODES[mode_name]
        assert torch.equal(triton_linear.linear(x, weight, mode, None, handover=Handover(sums=sums)),
                           triton_linear.linear(x, weight, mode, None)), mode_name


@pytest.mark.parametrize("storage,mode_name", [("planes", "full"), ("int4", "w4a8")])
def test_x_by_tma_in_64_row_tiles_reads_rows_past_m_as_zeros(storage, mode_name):
    """`full` and the int8-activation formats load x's 64-row tiles by TMA (x_by_tma): 70 rows over two M tiles,
    the second mostly past M, give the reference's linear, and a row alone (63 rows of zeros) its bits among 70."""
    torch.manual_seed(13)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(32, 256), storage, 128)
    cfg = linear_tiles.TileConfig(block_n=16, block_k=64, split_k=2, block_m=64)
    assert linear_tiles.x_by_tma(triton_linear.kernel_format(weight, mode), mode.act_bits is not None, cfg)
    x = torch.randn(70, 256).bfloat16()
    y = launch(x, weight, mode, cfg)
    assert rel_err(y, linear_oracle(x, weight, mode, None)) < TOL
    for i in (0, 66):
        assert torch.equal(launch(x[i:i + 1], weight, mode, cfg), y[i:i + 1])


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a16"), ("planes", "full"), ("planes", "w4a8")])
def test_group_affine_in_any_layout_and_groups_over_several_tiles(storage, mode_name):
    """The formats store scale and lo group-major; the kernels read any layout (row-major copies give the same
    bits). A program walks 8 K tiles, four per group of 256, each tile's affine loaded one tile ahead."""
    torch.manual_seed(11)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(48, 512), storage, 256)
    assert weight.scale.stride() == weight.lo.stride() == (1, 48)
    x = torch.randn(5, 512).bfloat16()
    cfg = linear_tiles.TileConfig(block_n=16, block_k=64, split_k=1)
    y = launch(x, weight, mode, cfg)
    assert rel_err(y, linear_oracle(x, weight, mode, None)) < TOL
    weight.scale, weight.lo = weight.scale.contiguous(), weight.lo.contiguous()
    assert torch.equal(launch(x, weight, mode, cfg), y)


def test_group_affine_loads_stay_inside_their_tensors():
    """Programs past K (4 K tiles split 8 ways leave 4 programs without a tile) and last tiles load a group affine
    ahead of use: every load stays inside scale and lo (here views between two guard rows no load may touch)."""
    torch.manual_seed(12)
    weight = quantize_weight(torch.randn(40, 256), "int4", 64)
    guarded = {}
    for name in ("scale", "lo"):
        t = getattr(weight, name)  # [N, G], group-major
        buf = torch.zeros(t.shape[1] + 2, t.shape[0])
        buf[1:-1] = t.t()
        setattr(weight, name, buf[1:-1].t())
        guarded[name] = [(r.data_ptr(), r.data_ptr() + r.nbytes) for r in (buf[0], buf[-1])]
    touched = []
    masked_load, load = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_load

    def record_masked(self, ptrs, mask, *args, **kwargs):
        touched.extend(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].tolist())
        return masked_load(self, ptrs, mask, *args, **kwargs)

    def record(self, ptr, *args, **kwargs):
        touched.extend(np.atleast_1d(ptr.data).tolist())
        return load(self, ptr, *args, **kwargs)

    x = torch.randn(3, 256).bfloat16()
    oracle = linear_oracle(x, weight, MODES["w4a16"], None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_masked_load", record_masked)
        mp.setattr(interpreter.InterpreterBuilder, "create_load", record)
        y = launch(x, weight, MODES["w4a16"], linear_tiles.TileConfig(block_n=16, block_k=64, split_k=8))
    assert rel_err(y, oracle) < TOL
    scale_start = weight.scale.data_ptr()
    assert any(scale_start <= a < scale_start + weight.scale.nbytes for a in touched)  # the loads were seen
    for name, zones in guarded.items():
        assert not [a for a in touched for lo, hi in zones if lo <= a < hi], f"a load read past {name}"


def test_nibble_tiles_per_program_stay_bounded():
    """The nibble kernel holds a row sum and an offset per K tile of its range: the tile rule never gives a program
    more than MAX_TILES_PER_PROGRAM tiles, at any model's shapes."""
    for n, k, group in [(n, k, g) for n in (64, 896, 4096, 28672, 151936) for k in (192, 896, 4096, 4864, 14336, 18944)
                        for g in (32, 64, 128) if k % g == 0]:
        cfg = linear_tiles.tile_config(linear_tiles.INT4.value, False, n, k, group)
        tiles = -(-k // cfg.block_k)
        assert -(-tiles // cfg.split_k) <= linear_tiles.MAX_TILES_PER_PROGRAM, (n, k, group, cfg)
        assert cfg.split_k & (cfg.split_k - 1) == 0 and cfg.block_k <= group


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a16"), ("planes", "w4a8"), ("int8", "w8a8"),
                                               ("dense", "bf16")])
def test_residual_is_added_as_a_bf16_add_after_the_product(storage, mode_name):
    """linear(..., residual=r) is bitwise linear(...) + r, with K split (partials added by the tile's last program)
    or not, and leaves the tile counters zero for the next launch."""
    torch.manual_seed(13)
    mode = MODES[mode_name]
    w = torch.randn(72, 192)
    weight = quantize_weight(w.bfloat16() if storage == "dense" else w, storage, 64)
    x, r = torch.randn(2, 5, 192).bfloat16(), torch.randn(2, 5, 72).bfloat16()
    assert torch.equal(triton_linear.linear(x, weight, mode, None, r), triton_linear.linear(x, weight, mode, None) + r)
    ref = reference_op("linear", storage)
    assert torch.equal(ref(x, weight, mode, None, r), ref(x, weight, mode, None) + r)
    assert not semaphores._COUNTS[x.device].any()


def test_rotate_matches_reference_and_is_batch_invariant():
    torch.manual_seed(9)
    h = hadamard(64)
    x = torch.randn(9, 128).bfloat16()
    y = triton_linear.rotate(x, h)
    assert rel_err(y, reference_op("rotate")(x.double(), h.double())) < TOL
    for i in (0, 4):  # a row alone gives the same bits as among 9 (cuBLAS would not promise this)
        assert torch.equal(triton_linear.rotate(x[i:i + 1], h), y[i:i + 1])


def test_many_token_tiles_fill_the_last_wave():
    """Of the tiles a bucket offers, the one whose last wave of programs is fullest; the larger on a tie."""
    wide, narrow = (linear_tiles.TileConfig(n, 64, 1, 8, 3, block_m=128) for n in (256, 128))
    assert linear_tiles.fullest_wave([wide, narrow], 1024, 6144) == narrow  # 192 programs (1.45 waves) vs 384
    assert linear_tiles.fullest_wave([wide, narrow], 4096, 6144) == wide  # 768 vs 1536 programs: both 97% full
    assert linear_tiles.tile_config(linear_tiles.DENSE.value, False, 6144, 4096, 0, 1024).block_n == 128


@pytest.mark.parametrize("n,k", [(576, 1536), (960, 576), (3072, 576), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [17, 65, 257, 1024, 4096])
def test_many_token_tiles_fit_in_shared_memory(n, k, m):
    """A bf16 tile offered with K tiles of 64 keeps the decode K tile where the split's chunks do not start at
    multiples of 64 (SmolLM2's down: K = 1536 in 8 chunks of 192): 128 x 256 x 128 over 3 stages would need 288 KB
    of shared memory, so the bucket's other tile is taken."""
    cfg = linear_tiles.tile_config(linear_tiles.DENSE.value, False, n, k, 0, m)
    assert linear_tiles.fits_shared(cfg, linear_tiles.DENSE.value, False)
    assert linear_tiles.k_chunk(k, cfg.split_k, cfg.block_k) == linear_tiles.k_chunk(
        k, cfg.split_k, linear_tiles.decode_config(linear_tiles.DENSE.value, False, n, k, 0).block_k)
    big = linear_tiles.TileConfig(256, 128, 8, 8, 3, block_m=128)
    assert not linear_tiles.fits_shared(big, linear_tiles.DENSE.value, False)
    assert linear_tiles.fits_shared(big, linear_tiles.INT8.value, True)  # int8 x and W: half the bytes


def test_nibble_tiles_past_256_rows_are_wgmma_tiles_even_from_wide_decode_tiles():
    """w4a16's gate/up decodes over N tiles of 256; past 256 rows it takes the 64 x 128 tiles (bits kept on the
    GPU, tests/gpu), with the decode tiles' K split."""
    fmt = linear_tiles.INT4.value
    decode = linear_tiles.decode_config(fmt, False, 28672, 4096, 128)
    assert decode.block_n == 256
    many = linear_tiles.tile_config(fmt, False, 28672, 4096, 128, 1024)
    assert (many.block_m, many.block_n, many.split_k, many.block_k) == (64, 128, decode.split_k, decode.block_k)


def test_one_plane_decode_tiles_widen_where_the_rows_fill_more_than_a_wave():
    """An 8B down of one nibble plane: 128-wide N tiles at up to 16 rows (256-wide ones were one wave of 128
    programs), 256-wide from 17 rows (two M tiles: 256 programs); the same K split at every M, so the same bits."""
    fmt = linear_tiles.UPPER.value
    few = linear_tiles.tile_config(fmt, False, 4096, 14336, 128, 16)
    more = linear_tiles.tile_config(fmt, False, 4096, 14336, 128, 32)
    assert (few.block_n, more.block_n) == (128, 256) and few.split_k == more.split_k == 8
    qkv = linear_tiles.tile_config(fmt, False, 6144, 4096, 128, 32)  # short K pieces: stays 128-wide
    assert qkv.block_n == 128


@pytest.mark.parametrize("storage,mode_name", [("int8", "w8a16"), ("int4", "w4a16"), ("planes", "upper"),
                                               ("planes", "full"), ("int4g", "w4a16")])
def test_prompt_tokens_run_the_bf16_gemm_on_the_dequantized_weight(storage, mode_name):
    """Mode.prompt: the weight dequantized exactly as the reference rounds it, then the bf16 GEMM (whose tiles keep
    every row's bits at any M); the integer kernels' own arithmetic stays for other passes."""
    torch.manual_seed(13)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256), storage, 64)
    fmt = triton_linear.kernel_format(weight, mode)
    assert torch.equal(triton_linear.dequantize(weight, fmt), weight.dequantize(mode).bfloat16())
    prompt = replace(mode, prompt=True)
    x = torch.randn(80, 256).bfloat16()
    r = torch.randn(80, 40).bfloat16()
    y = triton_linear.linear(x, weight, prompt, None, r)
    dense = quantize_weight(weight.dequantize(mode).bfloat16(), "dense")
    assert torch.equal(y, triton_linear.linear(x, dense, MODES["bf16"], None, r))
    assert rel_err(y, linear_oracle(x, weight, mode, None) + r) < TOL
    for i in (0, 79):
        assert torch.equal(y[i], triton_linear.linear(x[i:i + 1], weight, prompt, None, r[i:i + 1])[0])


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a16"), ("planes", "upper"), ("planes", "full")])
def test_generated_tokens_past_scratch_rows_multiply_by_the_quartered_scratch(storage, mode_name, monkeypatch):
    """Past a nibble format's SCRATCH_ROWS a decode or verify pass takes the reference's bf16 weight from the
    dequantize scratch, each K tile's columns quartered as x's are, through the bf16 GEMM in the decode config's K
    tile and chunks. The scratch holds the weight column for column; the product agrees with the nibble kernel's
    and with the oracle (the GPU tests compare its bits: the interpreter's dots sum in their own order), and a row's
    result does not depend on the other rows."""
    torch.manual_seed(14)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(40, 256), storage, 64)
    fmt = triton_linear.kernel_format(weight, mode)
    plain = triton_linear.dequantize(weight, fmt).clone()  # one scratch: the next call overwrites it
    quartered = triton_linear.dequantize(weight, fmt, quartered=True)
    for tile in range(4):  # K tiles of 64 (the group): quarters of 16 columns
        for t in range(4):
            for j in (0, 5, 15):
                assert torch.equal(quartered[:, tile * 64 + t * 16 + j], plain[:, tile * 64 + 4 * j + t])
    x = torch.randn(24, 256).bfloat16()
    r = torch.randn(24, 40).bfloat16()
    kernel = triton_linear.linear(x, weight, mode, None, r)
    monkeypatch.setitem(triton_linear.SCRATCH_ROWS, fmt, 17)
    calls = []
    scratch_linear = triton_linear.scratch_linear
    monkeypatch.setattr(triton_linear, "scratch_linear", lambda *a: calls.append(a[0].shape[0]) or scratch_linear(*a))
    y = triton_linear.linear(x, weight, mode, None, r)
    assert calls == [24]  # 24 rows past 17: the scratch; the 20-row run below too
    assert rel_err(y, kernel) < TOL and rel_err(y, linear_oracle(x, weight, mode, None) + r) < TOL
    assert torch.equal(y[:20], triton_linear.linear(x[:20], weight, mode, None, r[:20])) and calls == [24, 20]


def test_int4g_codes_scratch_holds_its_int8_codes():
    """INT4G with int8 activations from INT_SCALE_ROWS rows (on Hopper) where the warp-specialized kernel does not
    take its K tile builds its INT8 codes once into an int8 scratch for w8a8's int8 GEMM: the scratch holds each
    code w8 = s2 q - z s2 exactly (the GPU tests compare the GEMM's bits with the decode tiles'); on a CPU the
    Triton tiles run at any M."""
    torch.manual_seed(16)
    weight = quantize_weight(torch.randn(40, 256), "int4g", 64)
    fmt = linear_tiles.INT4G.value
    codes = triton_linear.dequantize(weight, fmt, codes=True, dtype=torch.int8)
    assert codes.dtype == torch.int8 and torch.equal(codes.float(), weight.int8_codes())
    assert torch.equal(triton_linear.dequantize(weight, fmt, codes=True).float(), weight.int8_codes())  # bf16
    assert not triton_linear.takes_int_scale_kernels(fmt, True, torch.empty(4096, 256))


def test_int8_scratch_holds_the_codes_quartered():
    """w8a16's generated rows past SCRATCH_ROWS (on Hopper) multiply quartered x by the scratch of INT8 codes, the
    channel scale applied after the sum as the INT8 kernels do: the scratch holds each code exactly, each K tile's
    columns quartered, no scale; the GPU tests compare the product's bits with the decode tiles'."""
    torch.manual_seed(15)
    weight = quantize_weight(torch.randn(40, 256), "int8", 64)
    fmt = linear_tiles.INT8.value
    codes = triton_linear.dequantize(weight, fmt, quartered=True, codes=True)
    q = weight.q.float()
    for tile in range(2):  # K tiles of 128: quarters of 32 columns
        for t in range(4):
            for j in (0, 7, 31):
                assert torch.equal(codes[:, tile * 128 + t * 32 + j].float(), q[:, tile * 128 + 4 * j + t])
    assert not triton_linear.takes_scratch(fmt, False, 0, linear_tiles.tile_config(fmt, False, 40, 256, 0, 4096),
                                           (4096, 256), torch.device("cpu"))  # on a CPU: the Triton tiles


# --- attention over a quantized KV cache

D = triton_quant_attention.MIN_DIM  # the smallest head the kernel takes (smaller ones run the reference)
# The dots take float16 operands: the query rows times the keys' scales, the probabilities times the values' scales
# (2^-11 relative rounding each), against the reference's float32 dequantized keys and values.
QUANT_ATTENTION_TOL = 2e-3


def filled_quant_cache(fmt: str, length: int, g: int = 16, hkv: int = 2, d: int = D):
    """A one-layer QuantKVCache of 2 rows holding `length` committed positions of random k/v."""
    from selfspec.cache.quant_kv import QuantKVCache

    cache = QuantKVCache(1, 2, hkv, 8 * g, d, torch.float32, "cpu", fmt, g)
    gen = torch.Generator().manual_seed(0)
    for first in range(0, length + g, g):  # a group a pass, plus scratch past the committed length
        pos = torch.arange(first, first + g).expand(2, g)
        slots, kv = cache.slots(pos), cache.layer(0)
        for pool in (kv.k, kv.v):  # as rope_and_store writes them
            pool[slots // cache.block_size, :, slots % cache.block_size] = 2 * torch.randn(2, g, hkv, d, generator=gen)
        cache.commit(min(first + g, length))
    return cache


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_quantized_attention_matches_reference_and_is_query_invariant(fmt, upper, monkeypatch):
    monkeypatch.setattr(triton_quant_attention, "CHUNK_KEYS", 32)  # several chunks to merge ...
    # ... in two steps of 4 states: with the buffer's state last, a launch over fewer chunks (max_pos) would merge it
    # beside other states than the full launch does, and the max_pos check below would fail.
    monkeypatch.setattr(triton_quant_attention, "MERGE_STATES", 4)
    monkeypatch.setattr(triton_quant_attention, "MERGE_CHANNELS", 16)  # two programs a query head
    g, length = 16, 87
    cache = filled_quant_cache(fmt, length, g)
    kv = cache.layer(0)
    q = torch.randn(2, 4, 5, D, generator=torch.Generator().manual_seed(1))
    q_pos = torch.tensor([[87, 88, 89, 90, 91], [87, 89, 91, 93, 95]])  # a verify pass; past a group boundary
    ref = reference_op("quantized_attention")(q, kv, q_pos, upper)
    out = triton_quant_attention.quantized_attention(q, kv, q_pos, upper)
    assert rel_err(out, ref) < QUANT_ATTENTION_TOL
    # The largest position given by the caller (no host sync, for CUDA graphs): the same launch, the same bits.
    assert torch.equal(triton_quant_attention.quantized_attention(q, kv, q_pos, upper, max_pos=95), out)
    alone = triton_quant_attention.quantized_attention(q[:1, :, 3:4], kv, q_pos[:1, 3:4], upper)  # row 0's
    assert torch.equal(alone, out[:1, :, 3:4])  # a query's bits do not depend on the others of the call


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_quantized_attention_steps_within_a_group(fmt, upper, monkeypatch):
    """KV groups of 32 keys in steps of 16: the upper plane walks a group an iteration, its key scales put into the
    query rows once for both steps."""
    monkeypatch.setattr(triton_quant_attention, "CHUNK_KEYS", 64)
    monkeypatch.setattr(triton_quant_attention, "BLOCK_N", 16)
    kv = filled_quant_cache(fmt, 150, g=32).layer(0)
    q = torch.randn(2, 4, 3, D, generator=torch.Generator().manual_seed(3))
    q_pos = torch.tensor([[130, 140, 150], [150, 151, 152]])  # quantized below 64, 96, 96 (row 1: 96)
    ref = reference_op("quantized_attention")(q, kv, q_pos, upper)
    out = triton_quant_attention.quantized_attention(q, kv, q_pos, upper)
    assert rel_err(out, ref) < QUANT_ATTENTION_TOL
    alone = triton_quant_attention.quantized_attention(q[:1, :, :1], kv, q_pos[:1, :1], upper)
    assert torch.equal(alone, out[:1, :, :1])


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_quantized_attention_head_of_no_power_of_two(fmt, upper, monkeypatch):
    """48 channels: each half's tile is padded to 32, its loads masked (a power-of-two head loads unmasked)."""
    monkeypatch.setattr(triton_quant_attention, "CHUNK_KEYS", 32)
    kv = filled_quant_cache(fmt, 87, d=48).layer(0)
    q = torch.randn(2, 4, 5, 48, generator=torch.Generator().manual_seed(1))
    q_pos = torch.tensor([[87, 88, 89, 90, 91], [87, 89, 91, 93, 95]])
    ref = reference_op("quantized_attention")(q, kv, q_pos, upper)
    assert rel_err(triton_quant_attention.quantized_attention(q, kv, q_pos, upper), ref) < QUANT_ATTENTION_TOL


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_quantized_attention_verify_rows_share_a_program_bitwise(fmt, upper, monkeypatch):
    """A pass's tokens x the query heads of a kv head are the rows of one program: 1 token of 4 heads, 3 tokens (12
    rows), 9 tokens (36 rows: three programs of 16-row tiles). Each query gives the reference's values and the same
    bits in all three, its quantized range and buffer steps unlike its neighbours' (the passes cross a group
    boundary)."""
    monkeypatch.setattr(triton_quant_attention, "CHUNK_KEYS", 32)
    assert triton_quant_attention.TILE_ROWS == 16
    assert [triton_quant_attention.row_slices(n) for n in (4, 12, 36)] == [1, 1, 3]
    cache = filled_quant_cache(fmt, 87)
    kv = cache.layer(0)
    q = torch.randn(2, 8, 9, D, generator=torch.Generator().manual_seed(2))
    q_pos = torch.stack([torch.arange(94, 103), torch.arange(87, 105, 2)])  # quantized below 64, then 80
    ref = reference_op("quantized_attention")(q, kv, q_pos, upper)
    out = triton_quant_attention.quantized_attention(q, kv, q_pos, upper)
    assert rel_err(out, ref) < QUANT_ATTENTION_TOL
    three = triton_quant_attention.quantized_attention(q[:, :, 5:8], kv, q_pos[:, 5:8], upper)  # rows 20..31 of 9
    assert torch.equal(three, out[:, :, 5:8]) and rel_err(three, ref[:, :, 5:8]) < QUANT_ATTENTION_TOL
    for t in (1, 8):  # a query alone (4 rows) against its place in the first and in the last program
        alone = triton_quant_attention.quantized_attention(q[:1, :, t:t + 1], kv, q_pos[:1, t:t + 1], upper)
        assert torch.equal(alone, out[:1, :, t:t + 1]) and rel_err(alone, ref[:1, :, t:t + 1]) < QUANT_ATTENTION_TOL


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", True)])
def test_quantized_attention_reads_paged_blocks(fmt, upper, monkeypatch):
    """The serving engine's paged cache: two sequences at different lengths, their blocks interleaved in the pool,
    their buffers in rows 2 and 1 (cache/paged_quant.py)."""
    from selfspec.cache.paged_quant import PagedQuantKVCache

    monkeypatch.setattr(triton_quant_attention, "CHUNK_KEYS", 32)
    g = 16
    lengths = [6 * g + 5, 2 * g + 9]
    cache = PagedQuantKVCache(1, 16, 2, 2 * g, D, torch.float32, "cpu", fmt, g, max_seqs=2)
    gen = torch.Generator().manual_seed(0)
    for s in "10":
        cache.allocate(s)
    for first in range(0, max(lengths), g):  # the two take their blocks in turn
        for s, n in zip("01", lengths):
            if first < n:
                cache.extend(s, g)
                view = cache.view([s])
                slots, kv = view.slots(torch.arange(first, first + g)[None]), view.layer(0)
                for pool in (kv.k, kv.v):
                    pool[slots // pool.shape[2], :, slots % pool.shape[2]] = 2 * torch.randn(1, g, 2, D, generator=gen)
                cache.truncate(s, min(first + g, n))
    kv = cache.view(["0", "1"]).layer(0)
    assert kv.quant.table.tolist()[0][:3] != [1, 2, 3] and kv.table.tolist() == [[2], [1]]
    q = torch.randn(2, 4, 3, D, generator=gen)
    q_pos = torch.tensor(lengths)[:, None] + torch.arange(3)
    ref = reference_op("quantized_attention")(q, kv, q_pos, upper)
    out = triton_quant_attention.quantized_attention(q, kv, q_pos, upper)
    assert rel_err(out, ref) < QUANT_ATTENTION_TOL
    alone = triton_quant_attention.quantized_attention(q[1:, :, 2:], cache.view(["1"]).layer(0), q_pos[1:, 2:], upper)
    assert torch.equal(alone, out[1:, :, 2:])


def test_gemm_bench_hands_each_gemm_x_as_the_model_does(monkeypatch):
    """The GEMM bench gives each GEMM x as the model's norm and swiglu write it, through the device's own norm: x
    quartered where the GEMM would quarter it (here a device that quarters by 64), codes with int8 activations, and
    o (written by attention) x as it is."""
    from selfspec import kernels
    from selfspec.bench import gemm
    from selfspec.kernels import gluon_linear
    from selfspec.quant.modes import prompt_mode

    monkeypatch.setattr(kernels, "_TABLE", {**kernels._TABLE, **{
        (op, variant, "cpu"): fn for (op, variant, device), fn in kernels._TABLE.items() if device == "cuda"}})
    monkeypatch.setitem(kernels._TABLE, ("quarters_input", "", "cpu"), lambda weight, mode, rows, device: 64)
    torch.manual_seed(3)
    x = torch.randn(5, 256).bfloat16()
    normed = triton_small.rms_norm(x, torch.ones(256, dtype=x.dtype), 1e-6)
    weight = quantize_weight(torch.randn(32, 256) * 0.02, "int4", 64)
    given_x, given = gemm.handed_over("qkv", x, weight, prompt_mode(MODES["w4a16"]))
    assert given.quartered == 64 and given.codes is None
    assert torch.equal(given_x, gluon_linear.quartered(normed, 64))
    o_x, o_given = gemm.handed_over("o", x, weight, prompt_mode(MODES["w4a16"]))
    assert o_x is x and o_given is None
    act_x, act_given = gemm.handed_over("down", x, weight, MODES["w4a8"])
    assert torch.equal(act_x, normed) and act_given.bits == 8 and not act_given.quartered
    assert act_given.codes.shape == x.shape and act_given.sums is not None


# --- the model on the Triton kernels


@pytest.mark.parametrize("storage,mode_name", [("planes", "full"), ("int8", "w8a8"), ("planes", "w4a8")])
def test_model_hands_its_producers_work_to_the_gemms(monkeypatch, storage, mode_name):
    """A tiny model run on the Triton kernels (interpreted, the op table's "cuda" entries for CPU tensors): in a mode
    that quantizes activations, each block's norms hand q/k/v and gate/up, and swiglu hands down, x's codes
    (kernels.Handover; o gets none: a token's scale needs all its heads); with bf16 activations nothing is handed
    over. The logits are those of the GEMMs quantizing x themselves, bit for bit, and a 3-token verify pass gives
    each position the bits of decoding it alone."""
    from conftest import tiny_model

    from selfspec import kernels
    from selfspec.model import Transformer

    # head_dim 64, hidden 128, intermediate 192: whole 64-column sums everywhere, each linear its own shape
    cfg, sd, _ = tiny_model("llama", seed=4, hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1)
    model = Transformer(cfg, sd).to(torch.bfloat16)
    model.quantize(storage, 64)
    tokens = torch.tensor([[5, 17, 42, 7]])
    mode = MODES[mode_name]

    def logits_per_token(steps: list[int]) -> torch.Tensor:
        cache = model.new_cache(16)
        out, start = [], 0
        for n in steps:
            pos = torch.arange(start, start + n)
            out.append(model(tokens[:, start:start + n], pos, cache, mode)[0])
            start += n
        return torch.cat(out)

    reference_logits = logits_per_token([1, 3])
    took = []
    keep = True

    def spy(x, weight, mode, bias, residual=None, handover=None):
        took.append((weight.shape, handover))
        return triton_linear.linear(x, weight, mode, bias, residual, handover if keep else None)

    monkeypatch.setattr(kernels, "_TABLE", {**kernels._TABLE, **{
        (op, variant, "cpu"): spy if op == "linear" else fn
        for (op, variant, device), fn in kernels._TABLE.items() if device == "cuda"}})
    triton_logits = logits_per_token([1, 3])
    assert torch.equal(triton_logits, logits_per_token([1, 1, 1, 1]))  # verify of 3 tokens: each row as alone
    assert rel_err(triton_logits, reference_logits.double()) < 2e-2
    h = cfg.hidden_dim
    given = {shape for shape, handover in took if handover is not None}
    codes = mode.act_bits is not None
    assert given == ({(cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim, cfg.dim), (2 * h, cfg.dim), (cfg.dim, h)}
                     if codes else set())
    assert all(handover.codes is not None for _, handover in took if handover is not None)
    keep = False
    assert torch.equal(triton_logits, logits_per_token([1, 3]))


@pytest.mark.parametrize("tiles", [triton_attention.VERIFY_TILES, triton_attention.Tiles(16)])
def test_tree_attention_gives_each_node_its_branch_rows_bits(tiles):
    """A shared tree pass with each node's query once (tree_attention): every node gets, bit for bit, what
    `attention` gives it in the first branch row holding it; two sequences of 6 and 8 nodes, the second's own keys
    crossing a chunk end (512), rows padded past their branches; and so again laid out as a captured graph pads it
    (padding nodes, starts padded with zeros)."""
    from selfspec.model import TreeLayout

    torch.manual_seed(21)
    trees = [(11, 300, [[5, 6, 7], [5, 8], [9]]), (12, 509, [[1, 2, 3, 4], [1, 2, 5], [6, 7]])]
    layout, _, node_pos = TreeLayout.of(trees, shared=True, width=6)
    assert layout.starts.tolist() == [0, 6, 14]
    k, v = kv_cache(2, 2, 640, 32)
    table = torch.tensor([[0]] * 3 + [[1]] * 3)  # each sequence's branch rows read its row
    node_q = torch.randn(len(node_pos), 4, 32).bfloat16()
    q = node_q[layout.rows].permute(0, 2, 1, 3)  # [R, H, T, D]: a node's query in every row holding it
    pos = node_pos[layout.rows]
    rows = triton_attention.attention(q, k, v, table, pos, tiles=triton_attention.VERIFY_TILES, tails=layout.tails)
    b, t = layout.first // layout.rows.shape[1], layout.first % layout.rows.shape[1]
    padded = replace(layout, first=torch.cat([layout.first, torch.zeros(10, dtype=torch.long)]),
                     starts=torch.cat([layout.starts, torch.zeros(5, dtype=torch.long)]))
    for tree in (layout, padded):
        out = triton_attention.tree_attention(q, k, v, table, pos, tree, tiles)
        assert torch.equal(out[b, :, t], rows[b, :, t])
    assert rel_err(out[b, :, t].float(), reference.attention(q, k, v, table, pos, tails=layout.tails)[b, :, t]) < TOL


def test_host_grid_helpers_give_tritons_values():
    """launch.cdiv and launch.next_power_of_2 (plain Python for the host's grids: triton's are constexpr functions,
    slow to call from Python) equal triton's."""
    import triton

    from selfspec.kernels.launch import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(1, 5000)] == [triton.next_power_of_2(n) for n in range(1, 5000)]
    pairs = [(a, b) for a in range(0, 700, 7) for b in (1, 3, 16, 64, 100, 128, 256)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
