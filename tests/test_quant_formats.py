"""Stored weight formats, activation quantization, and the "one copy of the weights" invariant."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from selfspec.errors import SelfspecError
from selfspec.kernels import linear
from selfspec.model import Transformer
from selfspec.quant.act import fake_quantize_per_token, quantize_per_token
from selfspec.quant.formats import (
    STORAGES,
    Int4IntScaleWeight,
    Int4Weight,
    Int8PlanesWeight,
    Int8Weight,
    fit_group_size,
    minmax_quant,
    pack_nibbles,
    quantize_weight,
    storage_supports,
    unpack_nibbles,
)
from selfspec.quant.modes import MODES

GROUP = 32


def rand_weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0, :5] *= 20  # an outlier row/group: per-group ranges differ
    w[1] = 0.25  # a constant row: scale clamps, must still reconstruct
    return w


def group_view(t: torch.Tensor, g: int) -> torch.Tensor:
    n, k = t.shape
    return t.view(n, k // g, g)


# ---------------------------------------------------------------- INT8 planes


def test_planes_reconstruct_int8_codes_exactly():
    w = rand_weight()
    pw = Int8PlanesWeight(w, GROUP)
    q8, scale, lo = minmax_quant(w, 8, GROUP)
    upper, lower = (unpack_nibbles(p) for p in pw.planes())
    assert upper.max() <= 15 and lower.max() <= 15
    assert torch.equal(upper.to(torch.int16) * 16 + lower.to(torch.int16), q8.to(torch.int16))
    assert torch.equal(pw.scale, scale) and torch.equal(pw.lo, lo)
    # `full` reads exactly the INT8 weight, within half an INT8 step of w.
    full = pw.dequantize(MODES["full"])
    deq8 = lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * q8.float()
    torch.testing.assert_close(full, deq8, atol=1e-6, rtol=0)
    err = group_view((full - w).abs(), GROUP)
    assert (err <= scale[..., None] / 2 * (1 + 1e-4) + 1e-6).all()


def test_planes_grid_has_the_weight_of_code_128_in_bf16_and_is_exact():
    """fma_grid at 8 bits: the scale and lo + 128 scale are bf16 values (the GPU's one-FMA dequantization of q8 - 128),
    every lo + scale * q is exact in float32 (= its float64 value), and no weight is more than half a step from its
    code's, over scales of five decades and narrow groups far from 0."""
    torch.manual_seed(4)
    w = torch.randn(64, 256) * torch.logspace(-4, 1, 64)[:, None]
    w[:4, :128] = w[:4, :128] * 1e-4 + torch.tensor([1.0, -3.0, 1e3, 1e-6])[:, None]
    w[4, :128] = torch.rand(128) * 0.1 + 2.0  # one-sided: the offset's bf16 spacing near the range's width
    q8, scale, lo = minmax_quant(w, 8, 128)
    c = lo + 128 * scale
    assert torch.equal(scale, scale.bfloat16().float()) and torch.equal(c, c.bfloat16().float())
    exact = c.double()[..., None] + scale.double()[..., None] * (group_view(q8, 128).double() - 128)
    deq = lo[..., None] + scale[..., None] * group_view(q8, 128).float()
    assert torch.equal(deq.double(), exact)
    assert ((deq - group_view(w, 128)).abs() <= scale[..., None] / 2 * (1 + 1e-6)).all()


def test_planes_on_the_cpu_hold_the_int8_codes_in_place_of_the_planes():
    """On the CPU one uint8 tensor of the codes (each row: every even k, then every odd k) stands in for the two
    planes, with the scales and offsets doubled once; moved off the CPU the planes come back and the rest goes."""
    w = rand_weight(seed=5)
    pw = Int8PlanesWeight(w, GROUP)
    q8, scale, lo = minmax_quant(w, 8, GROUP)
    assert {name for name, _ in pw.named_buffers()} == {"q8", "scale", "lo", "scale2", "lo2"}
    assert torch.equal(pw.q8, torch.cat((q8[:, 0::2], q8[:, 1::2]), 1))
    assert torch.equal(pw.scale2, torch.cat((scale, scale), 1)) and pw.scale2.is_contiguous()
    assert torch.equal(pw.lo2, torch.cat((lo, lo), 1)) and pw.lo2.is_contiguous()
    upper, lower = pw.planes()
    assert torch.equal(upper, pack_nibbles(q8 >> 4)) and torch.equal(lower, pack_nibbles(q8 & 15))
    assert torch.equal(pw.int8_codes(torch.uint8), q8)
    pw.to("meta")
    assert not pw.cpu_layout
    assert {name: b.shape for name, b in pw.named_buffers()} == {
        "scale": scale.shape, "lo": lo.shape, "upper": upper.shape, "lower": lower.shape}


def test_upper_plane_is_int4_round_to_nearest():
    w = rand_weight(seed=1)
    pw = Int8PlanesWeight(w, GROUP)
    s, lo = pw.scale, pw.lo
    s4, lo4 = pw.upper_affine()
    assert torch.equal(s4, 16 * s)
    midpoint = lo + 7.5 * s  # of the lower nibble's range. lo4 - 16 s4 is a bf16 value (what the kernels' bf16 FMA
    # of the codes 1 + q / 16 takes): the offset is within a sixteenth of an upper step and two roundings of it
    assert torch.equal(lo4 - 16 * s4, (lo4 - 16 * s4).bfloat16().float())
    assert ((lo4 - midpoint).abs() <= s4 / 16 + midpoint.abs() * 2**-7).all()
    upper = pw.dequantize(MODES["upper"])
    # Error <= half an INT4 step (8 * the INT8 scale) and the offset's rounding, element by element.
    err = group_view((upper - w).abs(), GROUP)
    assert (err <= (8 * s + (lo4 - midpoint).abs())[..., None] * (1 + 1e-4) + 1e-6).all()
    assert err.max() > 4 * s.min()  # it really is the 4-bit view, not the 8-bit one
    # The codes are what RTN on that INT4 grid gives (up to exact ties at a half step).
    x = (group_view(w, GROUP) - midpoint[..., None]) / s4[..., None]
    rtn = x.round().clamp(0, 15)
    codes = group_view(unpack_nibbles(pw.planes()[0]).float(), GROUP)
    tie = ((x - x.floor()) - 0.5).abs() < 1e-3
    assert ((rtn == codes) | tie).all()
    assert (rtn == codes).float().mean() > 0.99
    # Modes that read 4 bits of a planes weight all read the upper plane; 8-bit ones read both.
    for m in ("w4a16", "w4a8", "w4a4"):
        assert torch.equal(pw.dequantize(MODES[m]), upper)
    for m in ("w8a16", "w8a8"):
        assert torch.equal(pw.dequantize(MODES[m]), pw.dequantize(MODES["full"]))


# ---------------------------------------------------------------- INT4 / INT8


def test_int4_error_within_half_step():
    w = rand_weight(seed=2)
    qw = Int4Weight(w, GROUP)
    deq = qw.dequantize(MODES["w4a16"])
    err = group_view((deq - w).abs(), GROUP)
    assert (err <= qw.scale[..., None] / 2 * (1 + 1e-4) + 1e-6).all()
    wg = group_view(w, GROUP)
    # quant/formats.fma_grid at 4 bits: the scale and lo - 16 scale bf16 values (the GPU's one-FMA dequantization of the
    # codes 1 + q / 16), the range centred within half a step at both ends, the scale the bf16 nearest to the
    # group's span over 15 steps, and lo + scale * q exact in float32.
    addend = qw.lo - 16 * qw.scale
    assert torch.equal(qw.scale, qw.scale.bfloat16().float()) and torch.equal(addend, addend.bfloat16().float())
    assert (qw.lo <= wg.amin(-1) + qw.scale / 2).all() and (qw.lo + 15 * qw.scale >= wg.amax(-1) - qw.scale / 2).all()
    span = (wg.amax(-1) - wg.amin(-1)) / 15
    assert ((qw.scale[2:] - span[2:]).abs() <= span[2:] * 2**-7).all()
    steps = torch.arange(16, dtype=torch.float64)
    assert torch.equal((qw.lo[..., None] + qw.scale[..., None] * steps.float()).double(),
                       qw.lo.double()[..., None] + qw.scale.double()[..., None] * steps)
    # Group extremes are representable: min maps to code 0, max to code 15.
    codes = group_view(unpack_nibbles(qw.packed), GROUP)
    assert (codes.amin(-1)[2:] == 0).all() and (codes.amax(-1)[2:] == 15).all()
    assert qw.packed.dtype == torch.uint8 and qw.packed.shape == (w.shape[0], w.shape[1] // 2)


def test_int4g_codes_are_int8_of_one_channel_scale_at_least_as_close_as_the_plain_grid():
    """Int4IntScaleWeight: w = scale[n] * w8 with w8 = s2 (q - z) an integer in [-127, 127] (int8, whatever a group's
    range), s2 in 1..16 and z in 0..15 a group; each group's squared error at most that of the plain choice (s2 the
    ceiling of its range over 15 steps, z rounded), itself within half an INT8 step plus half a group step s2 of
    every weight; over the weights within 1.1x int4's squared error."""
    w = rand_weight(seed=4)
    w[5, 17] = 0.5  # an outlier: its channel's grid coarse, its groups' steps few
    qw = Int4IntScaleWeight(w, GROUP)
    s2, zs = (qw.group & 255), (qw.group >> 8)
    assert qw.group.dtype == torch.int32 and qw.group.stride() == (1, w.shape[0])  # group-major
    assert (s2 >= 1).all() and (s2 <= 16).all() and (zs % s2 == 0).all() and (zs // s2 <= 15).all()
    w8 = qw.int8_codes()
    assert torch.equal(w8, w8.round()) and w8.abs().max() <= 127
    codes = group_view(unpack_nibbles(qw.packed).float(), GROUP)
    assert torch.equal(group_view(w8, GROUP), codes * s2[..., None].float() - zs[..., None].float())
    torch.testing.assert_close(qw.scale, w.abs().amax(1) / 119)
    exact = group_view(w / qw.scale[:, None], GROUP)
    grid = exact.round()
    lo, hi = grid.amin(-1).clamp(max=0), grid.amax(-1).clamp(min=0)
    plain_s2 = ((hi - lo) / 15).ceil().clamp(1, 16)
    z = (-lo / plain_s2).round()
    plain = plain_s2[..., None] * (((grid / plain_s2[..., None]).round() + z[..., None]).clamp(0, 15) - z[..., None])
    assert ((plain - exact).abs() <= 0.5 + plain_s2[..., None] / 2 + 1e-4).all()
    chosen = group_view(w8, GROUP)
    assert (((chosen - exact) ** 2).sum(-1) <= ((plain - exact) ** 2).sum(-1) + 1e-4).all()
    int4 = Int4Weight(w, GROUP).dequantize(MODES["w4a16"])
    assert ((qw.dequantize(MODES["w4a8"]) - w) ** 2).sum() <= 1.1 * ((int4 - w) ** 2).sum()


def test_int8_error_within_half_step():
    w = rand_weight(seed=3)
    qw = Int8Weight(w)
    deq = qw.dequantize(MODES["w8a16"])
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (w.shape[0],)
    assert ((deq - w).abs() <= qw.scale[:, None] / 2 * (1 + 1e-4) + 1e-7).all()
    torch.testing.assert_close(qw.scale, w.abs().amax(1) / 127)


def plain_dequant(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The textbook formula with fresh temporaries: what the in-place CPU dequantization must equal bitwise."""
    g = q.shape[1] // scale.shape[1]
    return (group_view(q.float(), g) * scale[..., None] + lo[..., None]).view(q.shape)


@pytest.mark.parametrize("k", [256, 576])
def test_dequantize_is_bitwise_the_plain_formula(k):
    w = rand_weight(40, k, seed=11) * torch.logspace(-3, 1, k)  # scales spread over decades: rounding shows
    q4, s4, lo4 = minmax_quant(w, 4, 64)
    assert torch.equal(Int4Weight(w, 64).dequantize(MODES["w4a16"]), plain_dequant(q4, s4, lo4))
    pw = Int8PlanesWeight(w, 64)
    q8, s8, lo8 = minmax_quant(w, 8, 64)
    assert torch.equal(pw.dequantize(MODES["full"]), plain_dequant(q8, s8, lo8))
    assert torch.equal(pw.dequantize(MODES["upper"]), plain_dequant(q8 >> 4, *pw.upper_affine()))
    assert torch.equal(pw.int8_codes(), q8.float())


def test_pack_unpack_roundtrip_and_layout():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (7, 34), generator=g, dtype=torch.uint8)
    p = pack_nibbles(q)
    assert p.dtype == torch.uint8 and p.shape == (7, 17)
    assert torch.equal(unpack_nibbles(p), q)
    assert torch.equal(unpack_nibbles(p, torch.float32), q.float())
    assert torch.equal(p & 15, q[:, 0::2]) and torch.equal(p >> 4, q[:, 1::2])  # even k in the low nibble
    every = torch.arange(256, dtype=torch.uint8).view(1, 256)
    assert torch.equal(pack_nibbles(unpack_nibbles(every)), every)


def test_fit_group_size():
    assert fit_group_size(576, 128) == 64
    assert fit_group_size(4096, 128) == 128
    assert fit_group_size(96, 128) == 32
    assert fit_group_size(1536, 64) == 64
    assert fit_group_size(7, 128) == 1
    w = rand_weight(16, 576, seed=5)
    assert Int4Weight(w, 128).group_size == 64 and Int4Weight(w, 128).scale.shape == (16, 9)
    assert Int8PlanesWeight(w, 128).group_size == 64


# ---------------------------------------------------------------- modes each format runs

SUPPORTED = {
    "dense": {"fp32", "bf16"},
    "int8": {"w8a16", "w8a8"},
    "int4": {"w4a16", "w4a8", "w4a4"},
    "int4g": {"w4a16", "w4a8", "w4a4"},
    "planes": {"w8a16", "w8a8", "w4a16", "w4a8", "w4a4", "upper", "full"},
}


@pytest.mark.parametrize("storage", STORAGES)
def test_formats_refuse_modes_they_cannot_run(storage):
    w = rand_weight(16, 64, seed=6)
    qw = quantize_weight(w, storage, GROUP)
    assert qw.storage == storage
    x = torch.randn(3, 64)
    for name, mode in MODES.items():
        ok = name in SUPPORTED[storage]
        assert storage_supports(storage, mode) == ok == qw.supports(mode), (storage, name)
        if ok:
            y = linear(x, qw, mode)
            assert y.shape == (3, 16) and torch.isfinite(y).all()
        else:
            with pytest.raises(SelfspecError, match=f"'{storage}' cannot run mode '{name}'"):
                linear(x, qw, mode)


def test_unknown_storage_refused():
    with pytest.raises(SelfspecError, match="unknown storage"):
        quantize_weight(torch.randn(4, 8), "int3")


@pytest.mark.parametrize("mode", ["w8a8", "w4a8", "w4a4", "w8a16", "w4a16"])
def test_linear_reference_semantics(mode):
    """A quantized linear = F.linear(per-token fake-quantized x, the mode's dequantized weight) + bias."""
    m = MODES[mode]
    w, b = rand_weight(16, 64, seed=7), torch.randn(16)
    qw = Int8PlanesWeight(w, GROUP)
    x = torch.randn(2, 5, 64)
    xq = x if m.act_bits is None else fake_quantize_per_token(x, m.act_bits)
    ref = F.linear(xq, qw.dequantize(m), b)
    torch.testing.assert_close(linear(x, qw, m, b), ref, atol=1e-5, rtol=1e-5)
    if m.act_bits is not None:  # the activations really are quantized
        assert not torch.allclose(linear(x, qw, m, b), F.linear(x, qw.dequantize(m), b), atol=1e-4)


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize("bits", [8, 4])
def test_activation_quant_per_token(bits):
    qmax = 2 ** (bits - 1) - 1
    g = torch.Generator().manual_seed(8 + bits)
    x = torch.randn(3, 9, 64, generator=g) * torch.logspace(-2, 2, 9).view(1, 9, 1)
    q, scale = quantize_per_token(x, bits)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (3, 9, 1)
    assert q.abs().max() <= qmax and (q.abs().amax(-1) == qmax).all()  # each token uses its full range
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / qmax)
    err = (q.float() * scale - x).abs()
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    torch.testing.assert_close(fake_quantize_per_token(x, bits), q.float() * scale)
    # Per token: blowing up one token changes no other token's quantization.
    y = x.clone()
    y[0, 0] *= 1000
    qy, _ = quantize_per_token(y, bits)
    assert torch.equal(qy[:, 1:], q[:, 1:]) and torch.equal(qy[1:], q[1:])
    assert torch.equal(quantize_per_token(torch.zeros(2, 8), bits)[0], torch.zeros(2, 8, dtype=torch.int8))


# ---------------------------------------------------------------- bytes, and one copy


def analytic_linear_bytes(n: int, k: int, storage: str, group: int) -> int:
    g = fit_group_size(k, group)
    meta = 2 * (n * k // g) * 4  # fp32 scale + fp32 offset per group
    return {
        "dense": 4 * n * k,
        "int8": n * k + 4 * n,  # int8 codes + one fp32 scale per output channel
        "int4": n * k // 2 + meta,
        "int4g": n * k // 2 + (n * k // g) * 4 + 4 * n,  # an int32 of s2 and z s2 a group, an fp32 scale a channel
        "planes": n * k + 3 * meta,  # on the CPU: the codes, and the scales and offsets once more, doubled
    }[storage]


def held_tensors(model: torch.nn.Module) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """Every tensor any module holds: parameters, buffers, and plain tensor attributes (a cache would be one)."""
    out = {}
    for mname, mod in model.named_modules():
        for attr, val in vars(mod).items():
            if attr in ("_parameters", "_buffers"):
                items = val.items()
            elif isinstance(val, torch.Tensor):
                items = [(attr, val)]
            elif isinstance(val, (list, tuple)):
                items = [(f"{attr}[{i}]", v) for i, v in enumerate(val)]
            elif isinstance(val, dict) and not attr.startswith("_"):
                items = [(f"{attr}[{key!r}]", v) for key, v in val.items()]
            else:
                continue
            for name, t in items:
                if isinstance(t, torch.Tensor):
                    out[f"{mname}.{name}"] = (t.data_ptr(), tuple(t.shape), t.dtype)
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("storage", STORAGES)
def test_weight_bytes_match_analytic_size(storage, tied):
    cfg, sd, _ = tiny_model("qwen2", seed=9, tie_word_embeddings=tied)  # qwen2: biases count too
    model = Transformer(cfg, sd)
    model.quantize(storage, GROUP)
    lin_bytes = 0
    for lin in model.linears():
        n, k = lin.weight.shape
        assert lin.weight.storage == storage
        assert lin.weight.nbytes() == analytic_linear_bytes(n, k, storage, GROUP), (storage, n, k)
        lin_bytes += lin.weight.nbytes()
    d, v, hd, kv = cfg.dim, cfg.vocab_size, cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = sum(analytic_linear_bytes(n, k, storage, GROUP) for n, k in
                    [(d, d), (kv, d), (kv, d), (d, d), (cfg.hidden_dim, d), (cfg.hidden_dim, d), (d, cfg.hidden_dim)])
    assert lin_bytes == cfg.n_layers * per_layer
    embed = 4 * v * d
    head = 0 if tied else 4 * v * d
    norms = 4 * (2 * d * cfg.n_layers + d)
    biases = 4 * (d + 2 * kv) * cfg.n_layers
    rope = 2 * 4 * cfg.max_seq_len * hd
    assert model.weight_bytes() == lin_bytes + embed + head + norms + biases + rope
    if tied:
        assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()


PAIRS = {  # storage -> (draft, verify) pairs it runs from its one copy
    "int4": [("w4a4", "w4a16"), ("w4a8", "w4a16")],
    "int4g": [("w4a4", "w4a16"), ("w4a8", "w4a16")],
    "planes": [("upper", "full"), ("w4a8", "w8a16"), ("w4a4", "w8a8")],
    "int8": [("w8a8", "w8a16")],
    "dense": [("bf16", "fp32")],
}


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("storage", STORAGES)
def test_draft_and_verify_read_one_copy(storage, rotate):
    """DESIGN invariant 3: forwards in the draft mode then the verify mode add no tensor to the model
    (rotated: the one shared Hadamard matrix is all the rotation adds, and the modes add nothing to it)."""
    cfg, sd, _ = tiny_model("llama", seed=10)
    model = Transformer(cfg, sd)
    model.quantize(storage, GROUP, rotate)
    rotation = model.linears()[0].weight.rotation
    assert (rotation is not None) == rotate
    assert all(lin.weight.rotation is rotation for lin in model.linears())  # K = 64 or 128: all blocks of 32
    before_bytes, before = model.weight_bytes(), held_tensors(model)
    assert len(before) > 7 * cfg.n_layers
    toks = torch.randint(0, cfg.vocab_size, (1, 6))
    for draft, verify in PAIRS[storage]:
        cache = model.new_cache(16)
        model(toks, torch.arange(6), cache, MODES[verify])
        cache.commit(6)
        for i in range(3):
            model(toks[:, :1], torch.tensor([6 + i]), cache, MODES[draft])
        model(toks[:, :4], torch.arange(6, 10), cache, MODES[verify])
        assert model.weight_bytes() == before_bytes
        assert held_tensors(model) == before


def test_the_upper_view_reads_only_the_upper_plane():
    w = quantize_weight(torch.randn(64, 256), "planes", 64).to("meta")  # off the CPU: the two planes
    assert not w.cpu_layout
    assert w.nbytes_read(MODES["full"]) == w.nbytes() == 64 * 256 + 2 * 64 * 4 * 4
    assert w.nbytes_read(MODES["upper"]) == w.nbytes() - 64 * 128  # the lower plane: one byte per two weights
    cpu = quantize_weight(torch.randn(64, 256), "planes", 64)  # one byte per code: every mode reads all of them
    assert cpu.nbytes_read(MODES["upper"]) == cpu.nbytes_read(MODES["full"]) == 64 * 256 + 4 * 64 * 4 * 4
    int4 = quantize_weight(torch.randn(64, 256), "int4", 64)
    assert int4.nbytes_read(MODES["w4a16"]) == int4.nbytes()
