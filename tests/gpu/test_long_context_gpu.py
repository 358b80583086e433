"""The long-context benchmark on the GPU: the quantized attention it times (captured in a CUDA graph, positions
given on the host) computes what the eager call does, and its tiny run goes through (Triton kernels, graphs)."""
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from selfspec.bench import long_context as lc  # noqa: E402
from selfspec.kernels import triton_quant_attention  # noqa: E402


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
