"""The CPU kernels of the integer formats (kernels/cpu.py) against the torch reference, on fresh random inputs:
the same float weight bit for bit, the product within float32 rounding of the reference's, and each row's
result the same bits whatever the number of rows in the call (what greedy speculative == AR rests on)."""
import threading

import pytest
import torch

from selfspec.kernels import cpu, lookup, reference_op
from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

pytestmark = pytest.mark.usefixtures("one_thread")

INT_CASES = [("planes", m) for m in ("full", "upper", "w8a16", "w8a8", "w4a16", "w4a4")] + \
            [("int4", m) for m in ("w4a16", "w4a8", "w4a4")] + [("int8", m) for m in ("w8a16", "w8a8")]
CASES = [("dense", "fp32")] + INT_CASES
# K = 576 (groups of 64, nibble rows a multiple of 4 bytes: the 32-bit path), 1536 (groups of 128), 40 (groups of
# 8: 20-byte rows, 32-bit path), 12 (groups of 4: 6-byte nibble rows, the byte path; 12-byte INT8 rows), 10
# (groups of 2: 5-byte nibble rows and 10-byte INT8 rows, both on the byte path)
SHAPES = [(96, 576, 64), (40, 1536, 128), (24, 40, 8), (20, 12, 4), (12, 10, 2)]


def random_weight(storage: str, n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, k)[torch.randperm(k, generator=g)]
    return quantize_weight(w, storage, group)


def random_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with no zero entry: a zero would hide a mix-up of k order or of rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    return x + torch.where(x >= 0, 0.1, -0.1)


def test_registered_for_cpu():
    for storage in ("dense", "int8", "int4", "planes"):
        assert lookup("linear", storage, "cpu") is cpu.linear


def test_dense_bf16_takes_the_reference():
    w = random_weight("dense", 32, 64, 32, seed=12)
    x = random_rows(3, 64, seed=13)
    ref = reference_op("linear", "dense")(x, w, MODES["bf16"], None)
    assert torch.equal(cpu.linear(x, w, MODES["bf16"], None), ref)


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("storage,mode", INT_CASES)
def test_weight_is_the_reference_dequantization(storage, mode, n, k, group):
    w = random_weight(storage, n, k, group, seed=n + k)
    m = MODES[mode]
    got = cpu.weight_block(w, m, cpu.affine(w, m), 0, n)
    ref = w.dequantize(m)
    if storage != "int8":  # nibble formats: every even k, then every odd k
        ref = torch.cat((ref[:, 0::2], ref[:, 1::2]), 1)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("storage,mode", CASES)
def test_linear_matches_reference(storage, mode, n, k, group):
    w = random_weight(storage, n, k, group, seed=3 * n + k)
    m = MODES[mode]
    x, bias, residual = random_rows(2 * 7, k, seed=k).view(2, 7, k), torch.randn(n), torch.randn(2, 7, n)
    ref = reference_op("linear", storage)(x, w, m, bias, residual)
    got = cpu.linear(x, w, m, bias, residual)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("storage,mode", CASES)
def test_rows_are_batch_invariant(storage, mode):
    """Row r of a call over M rows is bitwise row r computed alone (M = 1: plain decoding) or among 5 (a verify
    pass of 4 drafts) or 17, with a bias; whichever block of output rows the weight is dequantized in."""
    n, k = 200, 576
    w = random_weight(storage, n, k, 64, seed=5)
    m, bias = MODES[mode], torch.randn(n)
    x = random_rows(17, k, seed=6)
    alone = torch.cat([cpu.linear(x[r:r + 1], w, m, bias) for r in range(17)])
    assert torch.equal(cpu.linear(x[:5], w, m, bias), alone[:5])
    assert torch.equal(cpu.linear(x, w, m, bias), alone)
    blocks = cpu.BLOCK_FLOATS
    try:
        cpu.BLOCK_FLOATS = 64 * k  # several blocks of 64 output rows, the last one shorter
        assert torch.equal(cpu.linear(x[:5], w, m, bias), alone[:5])
    finally:
        cpu.BLOCK_FLOATS = blocks


def test_many_rows_take_one_gemm():
    """A prefill of more than ROW_BY_ROW_MAX rows: one GEMM per block, still the reference's product."""
    w = random_weight("planes", 64, 576, 64, seed=8)
    x = random_rows(cpu.ROW_BY_ROW_MAX + 3, 576, seed=9)
    for mode in ("full", "upper"):
        ref = reference_op("linear", "planes")(x, w, MODES[mode], None)
        torch.testing.assert_close(cpu.linear(x, w, MODES[mode], None), ref, rtol=1e-5,
                                   atol=1e-5 * ref.abs().max().item())


def test_non_float32_activations_take_the_reference():
    w = random_weight("int4", 32, 64, 32, seed=10)
    x = random_rows(3, 64, seed=11).bfloat16()
    ref = reference_op("linear", "int4")(x, w, MODES["w4a16"], None)
    assert torch.equal(cpu.linear(x, w, MODES["w4a16"], None), ref)


def test_inside_and_outside_inference_mode(monkeypatch):
    """The scratch buffers, first made inside torch.inference_mode, are reused outside it."""
    monkeypatch.setattr(cpu, "_local", threading.local())  # no buffers yet
    w = random_weight("planes", 32, 64, 32, seed=12)
    x = random_rows(2, 64, seed=13)
    with torch.inference_mode():
        inside = cpu.linear(x, w, MODES["full"], None)
    assert torch.equal(cpu.linear(x, w, MODES["full"], None), inside)


@pytest.mark.parametrize("verify_keys,step_keys", [(64, 37), (48, 96)])
def test_cpu_attention_gives_a_query_the_same_bits_in_a_verify_pass_and_a_plain_step(verify_keys, step_keys):
    """A verify pass of 6 queries in a cache of one length == each query alone in a cache of another (solo decoding
    sizes its cache by gamma): torch's CPU attention alone changes a query's bits with both."""
    attention = lookup("attention", "", "cpu")
    torch.manual_seed(21)
    k, v = torch.randn(1, 3, 128, 64), torch.randn(1, 3, 128, 64)
    q, pos, table = torch.randn(1, 9, 6, 64), torch.arange(30, 36)[None], torch.zeros(1, 1, dtype=torch.long)
    y = attention(q, k[:, :, :verify_keys], v[:, :, :verify_keys], table, pos)
    for i in range(6):
        alone = attention(q[:, :, i:i + 1], k[:, :, :step_keys], v[:, :, :step_keys], table, pos[:, i:i + 1])
        assert torch.equal(y[:, :, i:i + 1], alone), i
    assert torch.allclose(y, reference_op("attention")(q, k[:, :, :verify_keys], v[:, :, :verify_keys], table, pos),
                          atol=1e-5)
