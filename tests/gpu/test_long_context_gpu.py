"""The long-context benchmarks on the GPU: the quantized attention they time (captured in a CUDA graph, positions
given on the host) computes what the eager call does, a verify pass's queries keep their bits whichever program
of the pass takes them at Llama-3-8B heads, and the tiny runs go through (Triton kernels, graphs)."""
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from selfspec.bench import long_context as lc  # noqa: E402
from selfspec.bench import quant_attention as qa  # noqa: E402
from selfspec.kernels import reference_op, triton_quant_attention  # noqa: E402


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_graph_captured_quantized_attention_equals_eager(fmt, upper):
    heads, context, t = lc.LLAMA_3_8B, 1000, 5
    cache = lc.quant_cache(heads, fmt, context, t, 1, torch.device("cuda"))
    q = torch.randn(1, heads.q, t, heads.dim, device="cuda", dtype=torch.bfloat16)
    pos = context + torch.arange(t, device="cuda")[None]
    eager = triton_quant_attention.quantized_attention(q, cache.layer(0), pos, upper)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_quant_attention.quantized_attention(q, cache.layer(0), pos, upper, max_pos=context + t - 1)
    graph.replay()
    assert torch.equal(out, eager)


def test_tiny_run_times_every_kernel(tmp_path):
    path = tmp_path / "lc.json"
    lc.main(["--tiny", "--json", str(path)])
    rows = [r for r in json.loads(path.read_text())["rows"] if r["part"] == "attention"]
    assert {r["kernel"] for r in rows} == set(lc.KERNELS) and all(r["us"] > 0 for r in rows)


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_verify_pass_queries_keep_their_bits_in_every_tile(fmt, upper):
    """4 query heads a kv head: a pass of 9 queries across a group boundary (36 rows: three programs), its first 4
    (16 rows, one program), its last 5 (20 rows, two) and each query alone (4 rows) give each query the same bits,
    close to the reference."""
    heads, context, t = lc.LLAMA_3_8B, 1020, 9
    cache = lc.quant_cache(heads, fmt, context, t, 1, torch.device("cuda"))
    kv = cache.layer(0)
    q = torch.randn(1, heads.q, t, heads.dim, device="cuda", dtype=torch.bfloat16)
    pos = context + torch.arange(t, device="cuda")[None]  # quantized below 768, then 896 from position 1024
    out = triton_quant_attention.quantized_attention(q, kv, pos, upper)
    ref = reference_op("quantized_attention")(q.float(), kv, pos, upper)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    for lo, hi in [(0, 4), (4, 9), *((i, i + 1) for i in range(t))]:
        assert torch.equal(triton_quant_attention.quantized_attention(q[:, :, lo:hi], kv, pos[:, lo:hi], upper),
                           out[:, :, lo:hi]), (lo, hi)


def test_quant_attention_bench_runs(tmp_path):
    path = tmp_path / "qa.json"
    qa.main(["--contexts", "4096", "--queries", "1", "5", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert {(r["queries"], r["kernel"]) for r in rows} == {(t, k) for t in (1, 5) for k in qa.KERNELS}
    assert all(r["us"] > 0 for r in rows)
