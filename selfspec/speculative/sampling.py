"""Sampling parameters and the one transform (temperature, top-k, top-p) applied to draft and verify alike."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from selfspec.errors import SelfspecError

# Positive temperatures below this overflow the scaled float32 logits to inf (NaN probabilities); 0 is greedy.
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 1e-6  # smaller values round to 0 in float32, where nucleus sampling drops every token
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # OpenAI's seed is a signed 64-bit integer, as is torch's


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise SelfspecError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                                f"got {self.temperature!r}")
        if not MIN_TOP_P <= self.top_p <= 1:  # also refuses NaN
            raise SelfspecError(f"top-p must be between {MIN_TOP_P:g} and 1, got {self.top_p!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise SelfspecError(f"seed must be a signed 64-bit integer ({SEED_RANGE[0]}..{SEED_RANGE[1]}), "
                                f"got {self.seed}")
        if self.top_k < 0:
            raise SelfspecError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SelfspecError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities after temperature, top-k and top-p (sampling only)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))
