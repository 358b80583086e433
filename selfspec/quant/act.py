"""Per-token symmetric activation quantization (INT8, or INT4 as a narrower INT8 range)."""
import torch


def quantize_per_token(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], scale [..., 1]) with x ~= q * scale."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.float().abs().amax(-1, keepdim=True)
    # Divide by a tensor, not a Python number: CUDA turns division by a scalar into a multiplication by its
    # reciprocal (1 ulp off), which moves rounding ties and breaks bitwise agreement with the kernels.
    scale = (amax / torch.full_like(amax, qmax)).clamp_min(1e-8)
    q = (x.float() / scale).round().clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def fake_quantize_per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    q, scale = quantize_per_token(x, bits)
    return (q.float() * scale).to(x.dtype)
