"""Execution modes: how one stored weight is read (weight bits) and how activations enter (act bits)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from selfspec.errors import SelfspecError


@dataclass(frozen=True)
class Mode:
    name: str
    weight_bits: int  # 32/16: dense weights; 8 or 4: integer weights
    act_bits: int | None = None  # None: activations stay in floating point
    planes_only: bool = False  # `upper`/`full` name a view of the INT8-plane format
    # Layers a layer-skip draft passes over (the residual stream goes through them unchanged).
    skip_layers: frozenset[int] = frozenset()
    # The pass runs prompt tokens: on the GPU, integer weights with float activations then compute with the weight
    # dequantized to bf16 (kernels/triton_linear.py `prompt_linear`), every prompt token alike, so chunking and
    # packing leave its bits alone; generated tokens keep the exact group affine. The CPU kernels have one path.
    prompt: bool = False
    # Reads only the upper INT4 plane of a hierarchical KV cache (a draft; verify reads both planes).
    kv_upper: bool = False
    # The head reads only the model's draft vocabulary (a draft; speculative/draft_vocab.py): the other tokens'
    # logits are -inf.
    draft_vocab: bool = False

    @property
    def dense(self) -> bool:
        return self.weight_bits >= 16


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("fp32", 32),
        Mode("bf16", 16),
        Mode("w8a16", 8),
        Mode("w8a8", 8, 8),
        Mode("w4a16", 4),
        Mode("w4a8", 4, 8),
        Mode("w4a4", 4, 4),
        Mode("upper", 4, planes_only=True),
        Mode("full", 8, planes_only=True),
    )
}


def prompt_mode(mode: Mode) -> Mode:
    """`mode` for a pass over prompt tokens (prefill)."""
    return replace(mode, prompt=True)


def get_mode(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise SelfspecError(f"unknown mode '{name}'; choose one of: {', '.join(MODES)}") from None
