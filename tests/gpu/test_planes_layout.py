"""An INT8-plane weight moved between the CPU (one tensor of 8-bit codes) and a CUDA device (two nibble planes)."""
import pytest
import torch

from selfspec.quant.formats import quantize_weight
from selfspec.quant.modes import MODES

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def test_planes_weight_moves_to_the_gpu_and_back():
    g = torch.Generator().manual_seed(3)
    w = quantize_weight(torch.randn(96, 576, generator=g), "planes", 64)
    q8, (upper, lower) = w.q8.clone(), w.planes()
    full, up = w.dequantize(MODES["full"]), w.dequantize(MODES["upper"])
    w.cuda()
    assert not w.cpu_layout and w.upper.is_cuda
    assert torch.equal(w.upper.cpu(), upper) and torch.equal(w.lower.cpu(), lower)
    assert torch.equal(w.dequantize(MODES["full"]).cpu(), full)
    assert torch.equal(w.dequantize(MODES["upper"]).cpu(), up)
    w.cpu()
    assert w.cpu_layout and torch.equal(w.q8, q8)
    assert torch.equal(w.dequantize(MODES["full"]), full)
