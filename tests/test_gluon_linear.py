"""The host side of the warp-specialized nibble GEMM (kernels/gluon_linear.py): when `linear` takes it (the operand
orders it reads: tests/test_triton_kernels.py, which interprets their kernel). The kernel itself runs on Hopper only
(Gluon has no interpreter): tests/gpu/test_gpu_kernels.py compares its bits with the decode tiles',
tests/test_kernel_resources.py compiles it for sm_90.

The kernels are imported inside the tests: imported while this file is collected, they would be defined compiled,
and tests/test_triton_kernels.py (which needs them interpreted) would skip itself."""
import pytest
import torch

pytest.importorskip("triton")


def test_many_tokens_of_nibble_formats_with_bf16_activations_take_it():
    from selfspec.kernels import linear_tiles
    fmt = {name: getattr(linear_tiles, name).value for name in ("DENSE", "INT8", "INT4", "UPPER", "FULL")}
    rows = linear_tiles.WARP_SPECIALIZED_ROWS["nibble"]
    for f in ("INT4", "UPPER", "FULL"):
        assert linear_tiles.tile_config(fmt[f], False, 4096, 4096, 128, rows).warp_specialized
        assert not linear_tiles.tile_config(fmt[f], False, 4096, 4096, 128, rows - 1).warp_specialized
    act = linear_tiles.WARP_SPECIALIZED_ROWS["nibble-act"]  # w4a8, w4a4: INT4 codes on the int8 tensor cores
    assert linear_tiles.tile_config(fmt["INT4"], True, 4096, 4096, 128, act).warp_specialized
    assert not linear_tiles.tile_config(fmt["INT4"], True, 4096, 4096, 128, act - 1).warp_specialized
    int8 = linear_tiles.WARP_SPECIALIZED_ROWS["int8"]  # w8a16: INT8 codes as 32-bit words, as the decode tiles
    assert linear_tiles.tile_config(fmt["INT8"], False, 4096, 4096, 0, int8).warp_specialized
    assert not linear_tiles.tile_config(fmt["INT8"], False, 4096, 4096, 0, int8 - 1).warp_specialized
    cfg = linear_tiles.tile_config(fmt["INT8"], False, 4096, 4096, 0, 1)
    assert cfg.block_k == 128 and linear_tiles.reads_words(fmt["INT8"], False, 0, cfg)
    assert not linear_tiles.reads_words(fmt["INT8"], True, 0, cfg)  # w8a8: int8 dots, exact
    assert linear_tiles.tile_config(fmt["INT8"], True, 4096, 4096, 0, 1024).warp_specialized  # w8a8
    assert not linear_tiles.tile_config(fmt["INT8"], True, 4096, 4096, 0, 192).warp_specialized
    assert not linear_tiles.tile_config(fmt["FULL"], True, 4096, 4096, 128, 1024).warp_specialized  # planes, int8
    # bf16: past 192 rows where K is walked whole (gate/up: one chunk); up to 512 rows where it is split (o: four)
    dense = linear_tiles.WARP_SPECIALIZED_ROWS["bf16"]
    assert linear_tiles.tile_config(fmt["DENSE"], False, 28672, 4096, 0, 4096).warp_specialized
    assert not linear_tiles.tile_config(fmt["DENSE"], False, 28672, 4096, 0, dense - 1).warp_specialized
    assert linear_tiles.tile_config(fmt["DENSE"], False, 4096, 4096, 0, 512).warp_specialized
    assert not linear_tiles.tile_config(fmt["DENSE"], False, 4096, 4096, 0, 513).warp_specialized


def test_it_needs_hopper_and_group_major_affines():
    from selfspec.kernels import gluon_linear
    from selfspec.quant.formats import quantize_weight

    assert not gluon_linear.runs_on(torch.device("cpu"))
    for storage in ("int4", "planes"):  # the formats store their affine group-major: what its TMA boxes read
        assert gluon_linear.covers(quantize_weight(torch.randn(256, 512) * 0.02, storage, 128).scale, 256)
    assert gluon_linear.covers(torch.randn(4, 256).t(), 256)
    assert not gluon_linear.covers(torch.randn(256, 4), 256)  # row-major [N, groups]
    assert not gluon_linear.covers(torch.randn(4, 254).t(), 254)  # rows of 254 floats: not 16-byte multiples
    assert not gluon_linear.covers(torch.randn(4, 256).t().half(), 256)



def test_the_int8_gemm_splits_k_under_half_a_wave_and_persists_past_512_rows(monkeypatch):
    """w8a8's exact int32 sums let int8_gemm choose its CTAs freely: K in pieces (a power of two, at least 4 K tiles
    each) where its tiles fill no more than half the SMs (o and down at up to 256 rows on an 8B model), one CTA per
    SM walking the tiles from 512 rows, else a CTA a tile."""
    from selfspec.kernels import gluon_linear

    monkeypatch.setattr(gluon_linear, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert gluon_linear.int8_pieces((2, 32), 4096, 256, cpu) == 2  # o at 256 rows: 64 CTAs -> 128
    assert gluon_linear.int8_pieces((2, 32), 14336, 256, cpu) == 2  # down
    assert gluon_linear.int8_pieces((1, 32), 4096, 256, cpu) == 4  # 128 rows: 32 CTAs -> 128
    assert gluon_linear.int8_pieces((1, 32), 1024, 256, cpu) == 1  # 4 K tiles: too few to split
    assert gluon_linear.int8_pieces((2, 48), 4096, 256, cpu) == 1  # qkv at 256 rows: 96 CTAs, past half a wave
    assert gluon_linear.int8_ctas(8 * 224, 1024, cpu) == 132  # gate/up at 1024 rows: persistent
    assert gluon_linear.int8_ctas(2 * 224, 256, cpu) == 448  # at 256 rows: a CTA a tile
    assert gluon_linear.int8_ctas(4 * 32, 512, cpu) == 128  # fewer tiles than SMs


def test_nibble_gemms_of_few_tiles_take_64_row_ctas_where_k_is_short(monkeypatch):
    """Where 128-row tiles would fill half the SMs or fewer, 64-row CTAs that fill more than half of them within one
    wave walk all of K (up to 32 K tiles), instead of the split's chunks in CTAs of their own."""
    from selfspec.kernels import gluon_linear

    monkeypatch.setattr(gluon_linear, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    for m in (130, 160, 256):  # an 8B model's o (K 4096): 96-128 CTAs of 64 rows
        assert gluon_linear.nibble_block_m(m, 4096, 4096, 128, 8, cpu) == 64
    assert gluon_linear.nibble_block_m(288, 4096, 4096, 128, 8, cpu) == 128  # 64-row CTAs: 160, past one wave
    assert gluon_linear.nibble_block_m(256, 4096, 14336, 128, 8, cpu) == 128  # down: 112 K tiles
    assert gluon_linear.nibble_block_m(256, 6144, 4096, 128, 8, cpu) == 128  # qkv: 96 CTAs of 128 rows
    assert gluon_linear.nibble_block_m(256, 4096, 4096, 128, 1, cpu) == 64  # K one chain: 128 CTAs, not 64
    assert gluon_linear.nibble_block_m(256, 4096, 14336, 128, 1, cpu) == 64  # whatever K
    assert gluon_linear.nibble_block_m(256, 6144, 4096, 128, 1, cpu) == 128  # qkv: 96 CTAs of 128 rows
    assert gluon_linear.nibble_block_m(256, 576, 576, 64, 16, cpu) == 128  # SmolLM2's o: 20 CTAs of 64 rows
    assert gluon_linear.nibble_block_m(1024, 576, 576, 64, 16, cpu) == 64  # 80 of them


def test_int4_nibbles_with_k_in_one_chain_take_256_row_ctas_where_their_waves_cost_less(monkeypatch):
    """w4a16 and `upper` with no K split (prompt tokens) take 256 rows a CTA where the grid's waves of them cost
    less than those of 128-row CTAs, a wide tile counted as 0.8 of two; with a split, or in `full` / w8a16, never."""
    from selfspec.kernels import gluon_linear

    monkeypatch.setattr(gluon_linear, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    int4, upper = gluon_linear.INT4.value, gluon_linear.UPPER.value
    assert gluon_linear.wide_tiles(4096, 6144, int4, 1, cpu)  # qkv: 6 waves of wide tiles against 12
    assert not gluon_linear.wide_tiles(1024, 6144, int4, 1, cpu)  # 2 waves (192 CTAs) against 3
    assert gluon_linear.wide_tiles(1024, 4096, upper, 1, cpu)  # o, down: 1 wave against 2
    assert gluon_linear.wide_tiles(256, 28672, int4, 1, cpu)  # gate/up: 2 waves against 4
    assert not gluon_linear.wide_tiles(128, 28672, int4, 1, cpu)  # one M tile: 2 waves either way
    assert not gluon_linear.wide_tiles(4096, 6144, int4, 8, cpu)  # a split: the total takes a second accumulator
    assert not gluon_linear.wide_tiles(4096, 6144, gluon_linear.FULL.value, 1, cpu)
    assert not gluon_linear.wide_tiles(4096, 6144, gluon_linear.INT8.value, 1, cpu)


def test_int4g_takes_256_row_ctas_where_its_pieces_of_k_stay_long(monkeypatch):
    """INT4G's in-register kernel builds each weight tile once for 256 rows of x from INTS_TALL_ROWS rows, unless
    its pieces of K would then hold fewer than INTS_TALL_TILES K tiles each (an 8B model's o); 128 rows below."""
    from selfspec.kernels import gluon_linear

    monkeypatch.setattr(gluon_linear, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert gluon_linear.ints_block_m(192, 6144, 4096, 128, cpu) == 128
    assert gluon_linear.ints_block_m(256, 6144, 4096, 128, cpu) == 256  # qkv: 2 pieces of 16 K tiles
    assert gluon_linear.ints_block_m(256, 28672, 4096, 128, cpu) == 256  # gate/up: K whole
    assert gluon_linear.ints_block_m(256, 4096, 14336, 128, cpu) == 256  # down: 4 pieces of 28
    assert gluon_linear.ints_block_m(256, 4096, 4096, 128, cpu) == 128  # o: 4 pieces of 8
    assert gluon_linear.fills_sms(28672, cpu) and not gluon_linear.fills_sms(6144, cpu)


def test_the_int8_gemm_takes_short_k_tiles_where_each_sm_has_few_tiles(monkeypatch):
    """K tiles of 128 (twice the ring slots) up to 4 tiles a SM, of 256 beyond (the sums are exact either way)."""
    from selfspec.kernels import gluon_linear

    monkeypatch.setattr(gluon_linear, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert gluon_linear.int8_block_k(2 * 224, cpu) == 128  # gate/up at 256 rows: 3.4 a SM
    assert gluon_linear.int8_block_k(8 * 48, cpu) == 128  # qkv at 1024 rows: 2.9 a SM
    assert gluon_linear.int8_block_k(8 * 224, cpu) == 256  # gate/up at 1024 rows: 13.6 a SM
    assert gluon_linear.int8_block_k(32 * 32, cpu) == 256  # o at 4096 rows: 7.8 a SM
    assert gluon_linear.int8_stages(128) == 2 * gluon_linear.int8_stages(256)


def test_the_int8_activation_kernel_reads_each_k_tiles_sum_of_x():
    """w4a8 / w4a4's warp-specialized kernel reads x's sum over each K tile from one row a tile (TMA's box [1, 64]):
    the integer sum of the tile's 64-column pieces, as float32, rows padded to 16-byte multiples with zeros."""
    from selfspec.kernels import gluon_linear

    g = torch.Generator().manual_seed(3)
    sums = torch.randint(-8128, 8128, (37, 64), dtype=torch.int32, generator=g)
    out = gluon_linear.tile_sums(sums, 128)
    assert out.dtype == torch.float32 and out.shape == (32, 40)
    assert torch.equal(out[:, :37], (sums[:, 0::2] + sums[:, 1::2]).t().float())
    assert not out[:, 37:].any()
