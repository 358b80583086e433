"""The compiled Triton kernels on a CUDA device at model shapes: float64 oracles, the torch references, and
bitwise batch invariance (a row alone gives the same bits as among up to 8192 rows)."""
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # before anything imports triton: the CPU tests may still interpret it
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from selfspec.errors import SelfspecError  # noqa: E402
from selfspec.kernels import Handover, lookup, reference_op, semaphores, triton_attention  # noqa: E402
from selfspec.kernels import triton_linear, triton_small  # noqa: E402
from selfspec.kernels import linear_tiles  # noqa: E402
from selfspec.quant.act import quantize_per_token  # noqa: E402
from selfspec.quant.formats import STORAGES, DenseWeight, quantize_weight, storage_supports  # noqa: E402
from selfspec.quant.modes import MODES  # noqa: E402
from selfspec.quant.rotation import hadamard  # noqa: E402
from kernel_oracles import (TOL, attention_oracle, linear_oracle, rel_err, rope_angles,  # noqa: E402
                            scatter_to_pool)

if isinstance(triton_linear._linear_kernel, InterpretedFunction):
    pytest.skip("TRITON_INTERPRET=1 was set before the kernels were imported: run tests/gpu on its own",
                allow_module_level=True)

DEV = "cuda"
PAIRS = [(s, m) for s in STORAGES for m in MODES if storage_supports(s, MODES[m]) and m != "fp32"]
SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336), (1536, 576)]  # N, K: 7B/8B layers; SmolLM2 (groups of 64)
M_SPLITS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)


def test_the_op_table_dispatches_cuda_to_triton():
    for op, variant, fn in [("attention", "", triton_attention.attention), ("rms_norm", "", triton_small.rms_norm),
                            ("rms_norm_handover", "", triton_small.rms_norm_handover),
                            ("rope_and_store", "", triton_small.rope_and_store),
                            ("swiglu", "", triton_small.swiglu),
                            ("swiglu_handover", "", triton_small.swiglu_handover)]:
        assert lookup(op, variant, DEV) is fn
    for storage in STORAGES:
        assert lookup("linear", storage, DEV) is triton_linear.linear


@pytest.mark.parametrize("storage,mode_name", PAIRS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear(storage, mode_name, n, k):
    torch.manual_seed(0)
    mode = MODES[mode_name]
    w = torch.randn(n, k, device=DEV)
    weight = quantize_weight(w.bfloat16() if storage == "dense" else w, storage, 128)
    assert triton_linear.kernel_format(weight, mode) is not None
    bias = torch.randn(n, device=DEV).bfloat16() if k == 576 else None  # a bias on one shape (Qwen2 q/k/v have one)
    x_big = torch.randn(300, k, device=DEV).bfloat16()
    x = x_big[:64]
    y = triton_linear.linear(x, weight, mode, bias)
    oracle = linear_oracle(x, weight, mode, bias)
    assert rel_err(y, oracle) < TOL
    assert rel_err(reference_op("linear", storage)(x, weight, mode, bias), oracle) < TOL
    for m in M_SPLITS:  # M = 1 vs M = k + 1: the shared rows, bit for bit
        assert torch.equal(triton_linear.linear(x[:m], weight, mode, bias), y[:m]), f"M={m}"
    for i in (5, 63):
        assert torch.equal(triton_linear.linear(x[i:i + 1], weight, mode, bias), y[i:i + 1]), f"row {i} alone"
    assert torch.equal(triton_linear.linear(x_big, weight, mode, bias)[:64], y)  # prefill: many M tiles
    r = torch.randn(64, n, device=DEV).bfloat16()
    assert torch.equal(triton_linear.linear(x, weight, mode, bias, r), y + r)  # the residual add in the epilogue


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a16"), ("planes", "upper"), ("planes", "full")])
@pytest.mark.parametrize("m", [1, 16, 64, 300])  # decode tiles, many-token tiles, the warp-specialized kernel
def test_nibble_kernels_multiply_by_the_reference_weight(storage, mode_name, m):
    """The nibble kernels' bf16 multiply-add (ptx.AFFINE_*) gives exactly the weight the reference dequantizes: x's
    rows picking one column each (a power of two there, zeros elsewhere), every output is that weight times it, bit
    for bit, over columns in every quarter of every K tile and chunk."""
    torch.manual_seed(9)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(4096, 4096, device=DEV) * 0.02, storage, 128)
    cols = torch.randperm(4096, device=DEV)[:m]
    scale = torch.exp2(torch.randint(-3, 4, (m,), device=DEV).float())
    x = torch.zeros(m, 4096, device=DEV)
    x[torch.arange(m, device=DEV), cols] = scale
    y = triton_linear.linear(x.bfloat16(), weight, mode, None)
    w = weight.dequantize(mode).bfloat16()
    assert torch.equal(y, (w[:, cols].t().float() * scale[:, None]).bfloat16())


# The many-token buckets' edges, up to 8192 rows; 257 and 300: a last M tile of 1 and 44 rows (narrow wgmma for
# the N = 14336 weight, whose CTAs pass one wave)
MANY_ROWS = (17, 64, 65, 256, 257, 300, 1024, 8192)


@pytest.mark.parametrize("storage,mode_name", PAIRS)
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 1024)])  # K split (4 tiles for bf16), K whole
@pytest.mark.parametrize("handover", [False, True])  # what the model's norms and swiglu hand their linears
def test_linear_many_tokens_keeps_each_rows_bits(storage, mode_name, n, k, handover):
    """Every M bucket's tiles give each row the bits it gets alone (M = 1) and among 16 (the decode tiles)."""
    torch.manual_seed(3)
    mode = MODES[mode_name]
    w = torch.randn(n, k, device=DEV) * 0.02
    weight = quantize_weight(w.bfloat16() if storage == "dense" else w, storage, 128)
    if handover and mode.act_bits is None:
        pytest.skip("bf16 activations take no handover (codes are for int8 activations)")
    x = torch.randn(MANY_ROWS[-1], k, device=DEV).bfloat16()
    given = None
    if handover:  # normed rows and their sums or codes, as a block's norm hands them to its linear
        x, given = triton_small.rms_norm_handover(x, torch.ones(k, device=DEV).bfloat16(), 1e-6, mode.act_bits)

    def linear(rows: slice) -> torch.Tensor:
        return triton_linear.linear(x[rows], weight, mode, None, handover=given_rows(given, rows))

    y16 = linear(slice(0, 16))
    rows = [0, 15, 16, 63, 64, 255, 256, 1023, 8191]
    alone = {i: linear(slice(i, i + 1)) for i in rows}
    assert torch.equal(alone[15], y16[15:16])
    for m in MANY_ROWS:
        y = linear(slice(0, m))
        assert torch.equal(y[:16], y16), f"M={m}"
        for i in rows:
            if i < m:
                assert torch.equal(y[i:i + 1], alone[i]), f"M={m} row {i}"


@pytest.mark.parametrize("storage,mode_name", [("int8", "w8a16"), ("int4", "w4a16"), ("planes", "upper"),
                                               ("planes", "full"), ("int4g", "w4a16")])
def test_prompt_tokens_keep_each_rows_bits_at_any_m(storage, mode_name, monkeypatch):
    """Mode.prompt on the GPU: the weight dequantized exactly as the reference rounds it (no FMA), then the bf16
    GEMM (on Hopper: the nibble kernel over all of K, the same products and adds as the bf16 GEMM over the
    quartered columns of x and of that weight, K as one chain; INT8 and INT4G: of their codes, the channel scale
    after the sum; from PROMPT_SCRATCH_ROWS that GEMM itself): a row alone, among 16 and among up to 8192 rows gets
    the same bits, and those of the bf16 GEMM on the reference's dequantized weight."""
    from selfspec.kernels import gluon_linear, ops

    torch.manual_seed(5)
    mode = MODES[mode_name]
    prompt = replace(mode, prompt=True)
    weight = quantize_weight(torch.randn(4096, 4096, device=DEV) * 0.02, storage, 128)
    fmt = triton_linear.kernel_format(weight, mode)
    dense = weight.dequantize(mode).bfloat16()
    assert torch.equal(triton_linear.dequantize(weight, fmt), dense)
    x = torch.randn(MANY_ROWS[-1], 4096, device=DEV).bfloat16()
    y = triton_linear.linear(x, weight, prompt, None)
    if triton_linear.takes_prompt_kernel(weight, fmt, x.device):
        block_k = triton_linear.dequantize_block_k(fmt, 128)
        channel = storage in ("int8", "int4g")  # their channel scale after the sum
        quartered = triton_linear.dequantize(weight, fmt, quartered=True, codes=channel)
        assert torch.equal(y, gluon_linear.dense_gemm(gluon_linear.quartered(x, block_k), quartered, 64, 4096, 1,
                                                      None, None, weight.scale if channel else None))
        # x written quartered by its producer (Handover.quartered) reads as x quartered here
        assert ops.quarters_input(weight, prompt, len(x), x.device) == block_k
        handed = Handover(quartered=block_k)
        assert torch.equal(triton_linear.linear(gluon_linear.quartered(x, block_k), weight, prompt, None,
                                                handover=handed), y)
        monkeypatch.setitem(triton_linear.PROMPT_SCRATCH_ROWS, fmt, 0)  # every row count from the scratch
        assert torch.equal(triton_linear.linear(x, weight, prompt, None), y)
        assert torch.equal(triton_linear.linear(x[:16], weight, prompt, None), y[:16])
        assert torch.equal(triton_linear.linear(gluon_linear.quartered(x[:16], block_k), weight, prompt, None,
                                                handover=handed), y[:16])
        monkeypatch.undo()
    else:
        assert torch.equal(y, triton_linear.linear(x, DenseWeight(dense), MODES["bf16"], None))
    for m in (1, 16) + tuple(MANY_ROWS[:-1]):
        assert torch.equal(triton_linear.linear(x[:m], weight, prompt, None), y[:m]), f"M={m}"
    for i in (0, 100, 8191):
        assert torch.equal(triton_linear.linear(x[i:i + 1], weight, prompt, None), y[i:i + 1]), f"row {i}"


@pytest.mark.parametrize("values", ["signs", "integers"])
def test_linear_many_tokens_keeps_each_rows_bits_for_integer_valued_bf16_weights(values):
    """bf16 weights take wgmma tiles past 64 rows: integer-valued ones (the rotation's +-1, codes up to 127), where
    integer-coded formats showed wgmma's other bits, keep each row's bits too."""
    torch.manual_seed(4)
    w = torch.randn(4096, 4096, device=DEV)
    w = torch.sign(w) if values == "signs" else torch.round(w * 40).clamp(-127, 127)
    weight = DenseWeight(w.bfloat16())
    x = torch.randn(MANY_ROWS[-1], 4096, device=DEV).bfloat16()
    y = triton_linear.linear(x, weight, MODES["bf16"], None)
    for m in MANY_ROWS[:-1]:
        assert torch.equal(triton_linear.linear(x[:m], weight, MODES["bf16"], None), y[:m]), f"M={m}"
    for i in (0, 100, 8191):
        assert torch.equal(triton_linear.linear(x[i:i + 1], weight, MODES["bf16"], None), y[i:i + 1]), f"row {i}"


def test_split_k_counters_are_made_before_a_graph_capture():
    """The split-K arrival counters are allocated eagerly: a GEMM first seen inside a capture is refused with a
    clear error; run once eagerly, the same GEMM captures and replays to the eager bits."""
    torch.manual_seed(14)
    weight = quantize_weight(torch.randn(4096, 4096, device=DEV), "int4", 128)
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    mode = MODES["w4a16"]
    semaphores._COUNTS.clear()
    with pytest.raises(SelfspecError, match="eagerly"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            triton_linear.linear(x, weight, mode, None)
    y = triton_linear.linear(x, weight, mode, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = triton_linear.linear(x, weight, mode, None)
    graph.replay()
    assert torch.equal(y_graph, y)


def test_linear_head():
    """The dense head (bf16): a vocabulary-sized N, the widest N tiles."""
    torch.manual_seed(1)
    weight = quantize_weight(torch.randn(49152, 576, device=DEV).bfloat16(), "dense")
    x = torch.randn(9, 576, device=DEV).bfloat16()
    y = triton_linear.linear(x, weight, MODES["bf16"], None)
    assert rel_err(y, linear_oracle(x, weight, MODES["bf16"], None)) < TOL
    assert torch.equal(triton_linear.linear(x[:1], weight, MODES["bf16"], None), y[:1])


def given_rows(given: Handover | None, rows: slice) -> Handover | None:
    """The part of a producer's handover that belongs to x[rows]."""
    if given is None:
        return None
    return Handover(*(None if t is None else t[rows] for t in (given.sums, given.codes, given.scale)), given.bits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 300])
def test_producers_hand_over_act_quants_codes(bits, m):
    """The norm (4096) and swiglu (14336, the halves of a fused gate/up output) hand over act_quant's codes, scales
    and the codes' sums bit for bit, their own outputs unchanged."""
    torch.manual_seed(5)
    x, w = torch.randn(m, 4096, device=DEV).bfloat16() * 3, torch.randn(4096, device=DEV).bfloat16()
    gate, up = (torch.randn(m, 2 * 14336, device=DEV).bfloat16() * 3).chunk(2, dim=-1)
    for y, given in (triton_small.rms_norm_handover(x, w, 1e-6, bits), triton_small.swiglu_handover(gate, up, bits)):
        q, s, sums = triton_linear._act_quant(y, bits, sums=True)
        assert given.bits == bits and torch.equal(given.codes, q) and torch.equal(given.scale, s)
        assert torch.equal(given.sums, sums)
    assert torch.equal(triton_small.rms_norm_handover(x, w, 1e-6, bits)[0], triton_small.rms_norm(x, w, 1e-6))
    assert torch.equal(triton_small.swiglu_handover(gate, up, bits)[0], triton_small.swiglu(gate, up))


@pytest.mark.parametrize("bits", [8, 4])
def test_act_quant(bits):
    torch.manual_seed(2)
    x = torch.randn(64, 14336, device=DEV).bfloat16()
    q, s = triton_linear.act_quant(x, bits)
    q_ref, s_ref = quantize_per_token(x, bits)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    q2, s2, sums = triton_linear._act_quant(x, bits, sums=True)  # and the codes' row sums, exact
    assert torch.equal(q2, q) and torch.equal(s2, s)
    assert torch.equal(sums.double(), q.double().view(64, -1, 64).sum(-1))


@pytest.mark.parametrize("mode_name", ["w4a8", "w4a4"])
@pytest.mark.parametrize("m", [1, 16, 32, 160, 1024])
def test_int8_activations_row_sums_give_the_dot_with_ones_bits(mode_name, m):
    """The codes' row sums from act_quant in place of the nibble kernel's dot with ones: the same bits (exact
    integers either way), at decode and many-token tiles."""
    torch.manual_seed(4)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(4096, 4096, device=DEV) * 0.02, "int4", 128)
    fmt = triton_linear.kernel_format(weight, mode)
    xq, xs, sums = triton_linear._act_quant(torch.randn(m, 4096, device=DEV).bfloat16(), mode.act_bits, sums=True)
    cfg = linear_tiles.tile_config(fmt, True, 4096, 4096, 128, m)
    assert torch.equal(triton_linear._launch(xq, xs, weight, fmt, True, None, cfg, sums=sums),
                       triton_linear._launch(xq, xs, weight, fmt, True, None, cfg))


@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64)])
def test_attention_decode_and_verify(hq, hkv, d):
    torch.manual_seed(3)
    k_all = torch.randn(2, hkv, 4096, d, device=DEV).bfloat16()
    v_all = torch.randn(2, hkv, 4096, d, device=DEV).bfloat16()
    q = torch.randn(2, hq, 9, d, device=DEV).bfloat16()
    # Verify 9 drafted tokens at the end of a 1.5k context (row 0) and of a 0.3k one (row 1).
    pos = torch.stack((torch.arange(1492, 1501, device=DEV), torch.arange(300, 309, device=DEV)))
    rows = torch.arange(2, device=DEV)[:, None]  # a contiguous cache: one block per row
    out = triton_attention.attention(q, k_all, v_all, rows, pos)  # whole buffers, as KVCache.pools returns
    oracle = attention_oracle(q, k_all, v_all, pos)
    assert rel_err(out, oracle) < TOL
    assert rel_err(reference_op("attention")(q, k_all, v_all, rows, pos), oracle) < TOL
    for b in range(2):
        for t in range(9):  # decode: each query alone, in a batch of one
            alone = triton_attention.attention(q[b:b + 1, :, t:t + 1], k_all[b:b + 1], v_all[b:b + 1], rows[:1],
                                               pos[b:b + 1, t:t + 1])
            assert torch.equal(alone[0, :, 0], out[b, :, t]), f"row {b} query {t}"


@pytest.mark.parametrize("bs", [16, 64, 256])
@pytest.mark.parametrize("t", [1, 9])  # a decode step; a verify pass of 8 drafts
def test_paged_attention(bs, t):
    """Keys read through a block table: == the float64 oracle and the torch reference, bit for bit == the same
    keys in a contiguous cache, a row alone == among others, and padding rows (trash blocks) change no bits."""
    torch.manual_seed(9)
    hq, hkv, d = 32, 8, 128
    k = torch.randn(4, hkv, 4096, d, device=DEV).bfloat16()
    v = torch.randn(4, hkv, 4096, d, device=DEV).bfloat16()
    k_pool, v_pool, table = scatter_to_pool(k, v, bs, torch.Generator().manual_seed(bs))
    q = torch.randn(4, hq, t, d, device=DEV).bfloat16()
    pos = torch.tensor([1500, 37, 800, 4000], device=DEV)[:, None] + torch.arange(t, device=DEV) - t
    out = triton_attention.attention(q, k_pool, v_pool, table, pos)
    oracle = attention_oracle(q, k, v, pos)
    assert rel_err(out, oracle) < TOL
    assert rel_err(reference_op("attention")(q, k_pool, v_pool, table, pos), oracle) < TOL
    assert torch.equal(triton_attention.attention(q, k, v, torch.arange(4, device=DEV)[:, None], pos), out)
    for b in range(4):
        used = -(-(int(pos[b, -1]) + 1) // bs)
        alone = triton_attention.attention(q[b:b + 1], k_pool, v_pool, table[b:b + 1, :used], pos[b:b + 1])
        assert torch.equal(alone, out[b:b + 1]), f"row {b}"
    padded = torch.zeros(32, table.shape[1], dtype=torch.long, device=DEV)  # a batch bucket of 32, trash-padded
    padded[:4] = table
    q_padded = torch.cat((q, torch.randn(28, hq, t, d, device=DEV).bfloat16()))
    pos_padded = torch.cat((pos, torch.zeros(28, t, dtype=torch.long, device=DEV)))
    assert torch.equal(triton_attention.attention(q_padded, k_pool, v_pool, padded, pos_padded)[:4], out)


def test_attention_prefill():
    torch.manual_seed(4)
    k = torch.randn(1, 8, 768, 128, device=DEV).bfloat16()
    v = torch.randn(1, 8, 768, 128, device=DEV).bfloat16()
    q = torch.randn(1, 32, 700, 128, device=DEV).bfloat16()
    pos = torch.arange(700, device=DEV)[None]
    row = torch.zeros(1, 1, dtype=torch.long, device=DEV)
    out = triton_attention.attention(q, k, v, row, pos)
    assert rel_err(out, attention_oracle(q, k, v, pos)) < TOL
    alone = triton_attention.attention(q[:, :, 650:651], k, v, row, pos[:, 650:651])
    assert torch.equal(alone, out[:, :, 650:651])


SPLIT_16 = triton_attention.Tiles()  # the tiles every other tiling must match, bit for bit


def paged_8b_prompt(t: int, start: int, seed: int):
    """8B heads, 2 rows at positions start.. (row 1: 5 later) over 4k keys in 16-key blocks at shuffled ids."""
    torch.manual_seed(seed)
    k = torch.randn(2, 8, 4096, 128, device=DEV).bfloat16()
    v = torch.randn(2, 8, 4096, 128, device=DEV).bfloat16()
    k_pool, v_pool, table = scatter_to_pool(k, v, 16, torch.Generator().manual_seed(seed))
    q = torch.randn(2, 32, t, 128, device=DEV).bfloat16()
    pos = torch.stack((torch.arange(start, start + t), torch.arange(start + 5, start + 5 + t))).to(DEV)
    return q, k, v, k_pool, v_pool, table, pos


@pytest.mark.parametrize("t,start", [(1, 3000), (9, 1492), (700, 0), (2048, 1000)])
def test_in_program_attention_is_the_split_path_bitwise(t, start):
    q, k, v, k_pool, v_pool, table, pos = paged_8b_prompt(t, start, seed=t)
    out = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=triton_attention.Tiles(in_program=True))
    assert rel_err(out, attention_oracle(q, k, v, pos)) < TOL
    assert torch.equal(out, triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=SPLIT_16))


@pytest.mark.parametrize("t,start", [(6, 1020), (16, 1492), (4, 250)])
def test_attention_tails_give_the_rows_in_order_bits(t, start):
    """A row's own keys read from its tails (a tree's branch rows over one sequence's row, model.TreeLayout) give
    the bits of the same keys in order, every tiling the dispatcher may take, paged and contiguous."""
    q, k, v, k_pool, v_pool, table, pos = paged_8b_prompt(t, start, seed=t + 60)
    tails = torch.stack([p0 + t + 40 + torch.randperm(64)[:t] for p0 in pos[:, 0].tolist()]).to(DEV)
    moved_k, moved_v = k.clone(), v.clone()
    for b in range(2):
        n = int(pos[b, 0])
        moved_k[b, :, n:n + t + 200].normal_(), moved_v[b, :, n:n + t + 200].normal_()  # in order: other keys
        moved_k[b, :, tails[b]], moved_v[b, :, tails[b]] = k[b, :, n:n + t], v[b, :, n:n + t]
    moved_pools = scatter_to_pool(moved_k, moved_v, 16, torch.Generator().manual_seed(t))
    rows = torch.arange(2, device=DEV)[:, None]
    for tiles in (SPLIT_16, triton_attention.VERIFY_TILES, triton_attention.WIDE_VERIFY_TILES):
        base = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=tiles)
        assert torch.equal(triton_attention.attention(q, *moved_pools, pos, tiles=tiles, tails=tails), base), tiles
        assert torch.equal(triton_attention.attention(q, moved_k, moved_v, rows, pos, tiles=tiles, tails=tails), base)


@pytest.mark.parametrize("tiles", [None, triton_attention.VERIFY_TILES, SPLIT_16, triton_attention.TREE_TILES])
def test_tree_attention_gives_each_node_its_branch_rows_bits(tiles):
    """Each node's query once (tree_attention) == the branch rows' `attention` with tails at each node's first
    entry, bit for bit: 8B heads, 4 sequences of trees (up to 15 branches, up to 4 deep) over 600-1500 keys of a
    paged cache, rows padded as a graph pads them."""
    from selfspec.model import TreeLayout

    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    trees = []
    for i, length in enumerate([600, 1023, 1280, 1500]):
        chains = [[int(x) for x in torch.randint(1, 4, (int(torch.randint(1, 5, (1,), generator=gen)),),
                                                 generator=gen)] for _ in range(15)]
        branches = sorted({tuple(c) for c in chains})[:15]
        trees.append((i, length, [list(b) for b in branches]))
    layout, _, node_pos = TreeLayout.of(trees, DEV, shared=True, width=8)
    k = torch.randn(4, 8, 2048, 128, device=DEV).bfloat16()
    v = torch.randn(4, 8, 2048, 128, device=DEV).bfloat16()
    k_pool, v_pool, seq_table = scatter_to_pool(k, v, 16, gen)
    per_seq = [len(branches) for _, _, branches in trees]
    table = seq_table.repeat_interleave(torch.tensor(per_seq, device=DEV), 0)  # each branch row: its sequence's
    q = torch.randn(len(node_pos), 32, 128, device=DEV).bfloat16()[layout.rows].permute(0, 2, 1, 3)
    pos = node_pos[layout.rows]
    rows = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=triton_attention.VERIFY_TILES,
                                      tails=layout.tails)
    b, t = layout.first // layout.rows.shape[1], layout.first % layout.rows.shape[1]
    padded = replace(layout, first=torch.cat([layout.first, torch.zeros(20, dtype=torch.long, device=DEV)]),
                     starts=torch.cat([layout.starts, torch.zeros(4, dtype=torch.long, device=DEV)]))
    for tree in (layout, padded):
        out = triton_attention.tree_attention(q, k_pool, v_pool, table, pos, tree, tiles)
        assert torch.equal(out[b, :, t], rows[b, :, t])


def test_attention_prefill_equals_the_prompt_cut_into_pieces_and_decode_bitwise():
    """A 2048-query prompt in one call == the same queries in pieces (the cache holding the earlier keys), each
    piece through the dispatcher (split below PREFILL_MIN_T queries), and == each query decoded alone."""
    q, k, v, k_pool, v_pool, table, pos = paged_8b_prompt(2048, 0, seed=21)
    whole = triton_attention.attention(q, k_pool, v_pool, table, pos)
    assert rel_err(whole, attention_oracle(q, k, v, pos)) < TOL
    for lo, hi in [(0, 100), (100, 1000), (1000, 1001), (1001, 2048)]:
        used = -(-(int(pos[:, hi - 1].max()) + 1) // 16)
        piece = triton_attention.attention(q[:, :, lo:hi], k_pool, v_pool, table[:, :used], pos[:, lo:hi])
        assert torch.equal(piece, whole[:, :, lo:hi]), f"queries {lo}..{hi - 1}"
    for i in (0, 255, 256, 1500, 2047):
        alone = triton_attention.attention(q[1:, :, i:i + 1], k_pool, v_pool, table[1:], pos[1:, i:i + 1])
        assert torch.equal(alone, whole[1:, :, i:i + 1]), f"query {i} decoded alone"


def test_prompt_attention_equals_the_prompt_cut_into_pieces_bitwise():
    """Prompt queries (their own arithmetic, wgmma tiles): a 2048-query prompt in one call == its queries in pieces
    of 1 to 1000 (the cache holding the earlier keys) and each query alone, all as prompt queries."""
    q, k, v, k_pool, v_pool, table, pos = paged_8b_prompt(2048, 0, seed=22)
    whole = triton_attention.attention(q, k_pool, v_pool, table, pos, prompt=True)
    assert rel_err(whole, attention_oracle(q, k, v, pos)) < TOL
    for lo, hi in [(0, 100), (100, 1000), (1000, 1001), (1001, 2048)]:
        used = -(-(int(pos[:, hi - 1].max()) + 1) // 16)
        piece = triton_attention.attention(q[:, :, lo:hi], k_pool, v_pool, table[:, :used], pos[:, lo:hi], prompt=True)
        assert torch.equal(piece, whole[:, :, lo:hi]), f"queries {lo}..{hi - 1}"
    for i in (0, 255, 1500, 2047):
        alone = triton_attention.attention(q[1:, :, i:i + 1], k_pool, v_pool, table[1:], pos[1:, i:i + 1], prompt=True)
        assert torch.equal(alone, whole[1:, :, i:i + 1]), f"query {i} alone"


@pytest.mark.parametrize("which", ["DECODE_TILES", "VERIFY_TILES", "WIDE_VERIFY_TILES", "PREFILL_TILES"])
@pytest.mark.parametrize("t,start", [(5, 1020), (9, 1492), (1024, 0)])
def test_chosen_attention_tiles_keep_the_16_row_bits(which, t, start):
    """Taller tiles may take other tensor-core instructions (wgmma): the tiles the dispatcher uses must still give
    every query the bits of 16-row split tiles, or decode and prefill would disagree."""
    q, k, v, k_pool, v_pool, table, pos = paged_8b_prompt(t, start, seed=t + 1)
    tiles = getattr(triton_attention, which)
    out = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=tiles)
    assert torch.equal(out, triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=SPLIT_16)), tiles


@pytest.mark.parametrize("t", [1, 5, 9])
def test_attention_warps_and_tile_heights_keep_the_bits(t):
    """The row sums are tensor-core dots, so 4 or 8 warps on 16- or 32-row tiles give every query the same bits
    (tl.sum's tree followed the layout: 4 warps changed an output at 5 queries)."""
    q, k, v, k_pool, v_pool, table, pos = paged_8b_prompt(t, 1020, seed=t + 40)
    base = triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=SPLIT_16)
    for block_t in (16, 32):
        for warps in (4, 8):
            tiles = triton_attention.Tiles(block_t, warps=warps)
            assert torch.equal(triton_attention.attention(q, k_pool, v_pool, table, pos, tiles=tiles), base), tiles


def test_rms_norm():
    torch.manual_seed(5)
    x, w = torch.randn(1, 64, 4096, device=DEV).bfloat16(), torch.randn(4096, device=DEV).bfloat16()
    y = triton_small.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, reference_op("rms_norm")(x, w, 1e-5))
    assert torch.equal(triton_small.rms_norm(x[:, 7:8], w, 1e-5), y[:, 7:8])
    qn = torch.randn(1, 9, 32, 128, device=DEV).bfloat16()  # qk-norm: per head
    torch.testing.assert_close(triton_small.rms_norm(qn, w[:128], 1e-6), reference_op("rms_norm")(qn, w[:128], 1e-6))


def test_rope_and_store():
    """Bitwise the reference: rotated q, and rotated k and v at their slots of a paged cache (blocks of 64)."""
    torch.manual_seed(13)
    b, t, hq, hkv, d = 2, 9, 32, 8, 128
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device=DEV).bfloat16()  # q, k, v: views of the fused projection
    q, k, v = (x.view(b, t, -1, d).transpose(1, 2) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    pos = torch.stack((torch.arange(1492, 1501, device=DEV), torch.arange(7, 16, device=DEV)))
    cos, sin = rope_angles(pos, d // 2)
    k_pool, v_pool = (torch.randn(64, hkv, 64, d, device=DEV).bfloat16() for _ in range(2))
    table = torch.randperm(63, device=DEV)[:48].view(2, 24) + 1  # 24 blocks per row at shuffled ids, not trash 0
    slots = table.gather(1, pos // 64) * 64 + pos % 64
    ref_k_pool, ref_v_pool = k_pool.clone(), v_pool.clone()
    y = triton_small.rope_and_store(q, k, v, cos, sin, k_pool, v_pool, slots)
    assert torch.equal(y, reference_op("rope_and_store")(q, k, v, cos, sin, ref_k_pool, ref_v_pool, slots))
    assert torch.equal(k_pool, ref_k_pool) and torch.equal(v_pool, ref_v_pool)


def test_swiglu():
    torch.manual_seed(7)
    gate = torch.randn(1, 64, 14336, device=DEV).bfloat16() * 4
    up = torch.randn(1, 64, 14336, device=DEV).bfloat16()
    y = triton_small.swiglu(gate, up)
    torch.testing.assert_close(y, reference_op("swiglu")(gate, up))
    assert torch.equal(triton_small.swiglu(gate[:, 3:4], up[:, 3:4]), y[:, 3:4])


@pytest.mark.parametrize("n", [64, 128])
def test_rotate(n):
    torch.manual_seed(8)
    h = hadamard(n).to(DEV)
    x = torch.randn(300, 14336, device=DEV).bfloat16()
    y = triton_linear.rotate(x, h)
    assert rel_err(y, reference_op("rotate")(x.double(), h.double())) < TOL
    for m in (1, 9, 64):
        assert torch.equal(triton_linear.rotate(x[:m], h), y[:m]), f"M={m}"


def test_rotation_of_gpu_weights_lives_on_the_gpu():
    """A model built on the GPU (synthetic benchmarks) gets its shared Hadamard rotation there too."""
    qw = quantize_weight(torch.randn(64, 256, device=DEV) * 0.02, "int4", 128, rotations={})
    assert qw.rotation.matrix.device.type == "cuda"
    x = torch.randn(3, 256, device=DEV).bfloat16()
    mode = MODES["w4a16"]
    assert rel_err(triton_linear.linear(x, qw, mode, None), linear_oracle(x, qw, mode, None)) < TOL


@pytest.mark.parametrize("storage,mode_name", [("int8", "w8a8"), ("planes", "w4a8"), ("planes", "full")])
def test_model_handovers_keep_the_logits(monkeypatch, storage, mode_name):
    """A tiny model on the GPU: with its norms and swiglu handing q/k/v, gate/up and down their codes (int8
    activations) the logits are those of each linear quantizing x itself, bit for bit (bf16 activations: nothing
    is handed over)."""
    from conftest import tiny_model

    from selfspec import kernels
    from selfspec.model import Transformer

    cfg, sd, _ = tiny_model("llama", seed=4, hidden_size=256, intermediate_size=512)
    model = Transformer(cfg, {k: v.bfloat16() for k, v in sd.items()})
    model.quantize(storage, 64)
    model = model.cuda()
    tokens = torch.randint(3, cfg.vocab_size, (2, 9), device=DEV)
    mode = MODES[mode_name]

    def logits() -> torch.Tensor:
        cache = model.new_cache(32, batch=2)
        return torch.cat([model(tokens[:, :5], torch.arange(5, device=DEV), cache, mode),
                          model(tokens[:, 5:], torch.arange(5, 9, device=DEV), cache, mode)], dim=1)

    given = logits()
    fn = kernels._TABLE[("linear", storage, DEV)]
    monkeypatch.setitem(kernels._TABLE, ("linear", storage, DEV),
                        lambda x, w, mode, bias, residual=None, handover=None: fn(x, w, mode, bias, residual))
    assert torch.equal(given, logits())


@pytest.mark.parametrize("storage,mode_name", [("planes", "full"), ("planes", "upper"), ("int4", "w4a16"),
                                               ("int8", "w8a16")])
@pytest.mark.parametrize("m", [130, 160, 192, 256])  # the last M tile: 2, 32, 64 rows or whole
# 8B o and down; SmolLM2's o: 9 of 16 chunks
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (4096, 14336, 128), (576, 576, 64)])
def test_nibble_gemms_of_few_tiles_keep_each_rows_bits(storage, mode_name, m, n, k, group):
    """Where a nibble GEMM's 128-row tiles fill half the SMs or fewer, 64-row tiles take it where they fill up to a
    wave and K is short (o at up to 256 rows); else (down, SmolLM2's o) its K chunks run in CTAs of their own and
    their sums are added in order afterwards (the split's chunks past K as zeros): each row gets the decode tiles'
    bits, bias and residual included. INT8 codes take the same kernel (as words, no sums) where K is whole K tiles
    (SmolLM2's 576 is not: its Triton tiles)."""
    from selfspec.kernels import gluon_linear

    torch.manual_seed(6)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(n, k, device=DEV) * 0.02, storage, group)
    fmt = triton_linear.kernel_format(weight, mode)
    cfg = linear_tiles.tile_config(fmt, False, n, k, group, m)
    assert cfg.warp_specialized and gluon_linear.chunks_apart(((m + 127) // 128, (n + 127) // 128), cfg.split_k, DEV)
    half_height = (n, k) == (4096, 4096)
    assert gluon_linear.nibble_block_m(m, n, k, cfg.block_k, cfg.split_k, DEV) == (64 if half_height else 128)
    x, given = triton_small.rms_norm_handover(torch.randn(m, k, device=DEV).bfloat16(),
                                              torch.ones(k, device=DEV).bfloat16(), 1e-6)
    bias, r = torch.randn(n, device=DEV).bfloat16(), torch.randn(m, n, device=DEV).bfloat16()
    y = triton_linear.linear(x, weight, mode, bias, r, given)
    y16 = triton_linear.linear(x[:16], weight, mode, bias, r[:16], given_rows(given, slice(0, 16)))
    assert torch.equal(y[:16], y16)
    for i in (0, 17, m - 1):
        rows = slice(i, i + 1)
        assert torch.equal(triton_linear.linear(x[rows], weight, mode, bias, r[rows], given_rows(given, rows)),
                           y[rows]), f"row {i}"


@pytest.mark.parametrize("storage,mode_name", [("int8", "w8a16"), ("planes", "full")])
def test_generated_rows_through_the_scratch_keep_each_rows_bits(storage, mode_name, monkeypatch):
    """Past SCRATCH_ROWS (here from 17 rows) generated rows multiply quartered x by the dequantize scratch (w8a16:
    its codes, the channel scale after the sum) in the decode config's K tile and chunks: each row gets the decode
    tiles' bits, bias and residual included, on 8B down (K split) and qkv."""
    torch.manual_seed(8)
    mode = MODES[mode_name]
    for n, k in ((4096, 14336), (6144, 4096)):
        weight = quantize_weight(torch.randn(n, k, device=DEV) * 0.02, storage, 128)
        fmt = triton_linear.kernel_format(weight, mode)
        x = torch.randn(300, k, device=DEV).bfloat16()
        bias, r = torch.randn(n, device=DEV).bfloat16(), torch.randn(300, n, device=DEV).bfloat16()
        y16 = triton_linear.linear(x[:16], weight, mode, bias, r[:16])
        monkeypatch.setitem(triton_linear.SCRATCH_ROWS, fmt, 17)
        cfg = linear_tiles.tile_config(fmt, False, n, k, 128, 300)
        assert triton_linear.takes_scratch(fmt, False, 128, cfg, x.shape, x.device)
        y = triton_linear.linear(x, weight, mode, bias, r)
        assert torch.equal(y[:16], y16), f"{n} x {k}"
        for i in (0, 17, 299):
            assert torch.equal(triton_linear.linear(x[i:i + 1], weight, mode, bias, r[i:i + 1]), y[i:i + 1]), i
        monkeypatch.undo()


@pytest.mark.parametrize("m", [130, 256, 1024])
@pytest.mark.parametrize("n,k", [(4096, 14336), (6144, 4096)])  # 8B down (K split 4 at decode), qkv (split 2)
def test_int8_sums_are_exact_so_any_split_of_k_keeps_each_rows_bits(m, n, k):
    """w8a8 sums its int8 products in int32 over all of K: the decode tiles' split, the warp-specialized kernel's K
    whole or in pieces of CTAs of their own (int8_pieces: where its tiles fill half the SMs or fewer) give each row
    the same bits, bias and residual included."""
    from selfspec.kernels import gluon_linear

    torch.manual_seed(7)
    mode = MODES["w8a8"]
    weight = quantize_weight(torch.randn(n, k, device=DEV) * 0.02, "int8", 128)
    x = torch.randn(m, k, device=DEV).bfloat16()
    bias, r = torch.randn(n, device=DEV).bfloat16(), torch.randn(m, n, device=DEV).bfloat16()
    y = triton_linear.linear(x, weight, mode, bias, r)
    assert torch.equal(triton_linear.linear(x[:16], weight, mode, bias, r[:16]), y[:16])
    for i in (0, 17, m - 1):
        assert torch.equal(triton_linear.linear(x[i:i + 1], weight, mode, bias, r[i:i + 1]), y[i:i + 1]), f"row {i}"
    xq, xs, _ = triton_linear._act_quant(x, 8, sums=False)
    for pieces, block_k in [(1, 256), (2, 256), (7, 256), (1, 128), (4, 128)]:
        got = gluon_linear.int8_gemm(xq, xs, weight.q, weight.scale, bias, r, pieces, block_k)
        assert torch.equal(got, y), f"{pieces} pieces, K tiles of {block_k}"


@pytest.mark.parametrize("storage,mode_name,prompt,tokens",
                         [("int4", "w4a16", True, 300), ("planes", "full", True, 300), ("int4", "w4a16", False, 80),
                          ("planes", "full", False, 80), ("int8", "w8a16", False, 40)])
def test_passes_with_producers_quartering_x_keep_their_bits(storage, mode_name, prompt, tokens, monkeypatch):
    """A pass of 2 rows whose norms and swiglu write the nibble kernels' x quartered (`quarters_input`) gives the
    logits and the KV cache of the pass whose linears quarter x themselves: prompt tokens, and generated ones at
    row counts the warp-specialized kernels take (160 rows; w8a16's from 65)."""
    from selfspec import kernels
    from selfspec.bench.synthetic import synthetic_model
    from selfspec.kernels import ops

    model = synthetic_model("qwen2.5-1.5b", storage, max_seq_len=1024)
    mode = replace(MODES[mode_name], prompt=prompt)
    ids = torch.randint(0, model.cfg.vocab_size, (2, tokens), device=DEV)
    pos = torch.arange(tokens, device=DEV).expand(2, -1)
    weight = model.layers[0].feed_forward.down.weight
    assert ops.quarters_input(weight, mode, ids.numel(), ids.device) > 0

    def run():
        cache = model.new_cache(1024, batch=2)
        return model.forward(ids, pos, cache, mode), cache.layer(3).k.clone()

    logits, k = run()
    monkeypatch.setitem(kernels._TABLE, ("quarters_input", "", "cuda"), lambda weight, mode, rows, device: 0)
    plain_logits, plain_k = run()
    assert torch.equal(logits, plain_logits) and torch.equal(k, plain_k)


def test_producers_write_x_quartered_on_the_gpu():
    """The compiled norm and swiglu write x quartered as gluon_linear.quartered quarters their plain outputs."""
    from selfspec.kernels import gluon_linear

    torch.manual_seed(8)
    x, w = torch.randn(37, 4096, device=DEV).bfloat16(), torch.randn(4096, device=DEV).bfloat16()
    y, given = triton_small.rms_norm_handover(x, w, 1e-6, quartered=128)
    assert given.quartered == 128 and torch.equal(y, gluon_linear.quartered(triton_small.rms_norm(x, w, 1e-6), 128))
    gate, up = (torch.randn(37, 14336, device=DEV).bfloat16() for _ in range(2))
    y, given = triton_small.swiglu_handover(gate, up, quartered=64)
    assert given.quartered == 64 and torch.equal(y, gluon_linear.quartered(triton_small.swiglu(gate, up), 64))


@pytest.mark.parametrize("storage,mode_name", [("int4", "w4a16"), ("planes", "upper"), ("planes", "full"),
                                               ("int8", "w8a16"), ("int4g", "w4a16")])
def test_generated_rows_read_x_quartered_by_its_writer(storage, mode_name):
    """Generated tokens at the row counts whose GEMM quarters x (`quarters_x`: the warp-specialized nibble kernel,
    past SCRATCH_ROWS the scratch) give the same bits from x quartered by its writer; elsewhere x quartered is
    refused."""
    from selfspec.kernels import gluon_linear

    torch.manual_seed(9)
    mode = MODES[mode_name]
    weight = quantize_weight(torch.randn(4096, 4096, device=DEV) * 0.02, storage, 128)
    x = torch.randn(2048, 4096, device=DEV).bfloat16()
    quartered = 0
    for m in (16, 96, 160, 512, 2048):
        block_k = triton_linear.quarters_x(weight, mode, m, x.device)
        if not block_k:
            with pytest.raises(ValueError, match="quartered"):
                triton_linear.linear(x[:m], weight, mode, None, handover=Handover(quartered=128))
            continue
        quartered += 1
        handed = triton_linear.linear(gluon_linear.quartered(x[:m], block_k), weight, mode, None,
                                      handover=Handover(quartered=block_k))
        assert torch.equal(handed, triton_linear.linear(x[:m], weight, mode, None)), f"M={m}"
    assert quartered >= 2, "no row count quartered x"
