"""Sharding the one weight copy across tensor-parallel ranks, before it is quantized (gpt-fast `_apply_tp_linear`).

Column-parallel (output features): q, k, v by heads (rank r gets its query heads and the KV heads they read, so each
rank's cache holds only its KV heads), gate and up by the same slice of the FFN; their concatenation in model.py
then puts each rank's own q, k, v (gate, up) side by side. Row-parallel (input features): o and down, each followed by
one all-reduce, their bias and the residual added on rank 0 only (model.RowParallelLinear). Embedding and head by
vocabulary rows. Norms and the q/k norms (per head) are replicated. Every split of an input dimension falls on a
quantization group boundary, so each rank quantizes exactly the groups the unsharded model would (and a Hadamard
rotation's blocks stay whole); per-channel INT8 (one scale per output row) is the exception: under a row split each
rank's scale covers its own K slice.
"""
from __future__ import annotations

import torch

from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.quant.formats import fit_group_size

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # split dim 0
ROW = ("o_proj", "down_proj")  # split dim 1 (input features); their biases are not split


def tensor_parallel_problems(cfg: ModelConfig, size: int, group_size: int) -> list[str]:
    """Why `size` ranks cannot split this model (empty: they can)."""
    counts = {"attention heads": cfg.n_heads, "KV heads": cfg.n_kv_heads, "vocabulary rows": cfg.vocab_size}
    problems = [f"{n} {what}" for what, n in counts.items() if n % size]
    for what, k in (("attention output features", cfg.n_heads * cfg.head_dim), ("FFN features", cfg.hidden_dim)):
        g = fit_group_size(k, group_size)
        if k % size or (k // size) % g:
            problems.append(f"{k} {what} in quantization groups of {g}")
    return problems


def check_tensor_parallel(cfg: ModelConfig, size: int, group_size: int) -> None:
    """Refuse, before any process starts, a TP size that does not split the heads, KV heads, vocabulary and
    quantization groups evenly; the message lists the sizes that do."""
    if size < 1:
        raise SelfspecError(f"tensor parallel size must be >= 1 (processes, one GPU each), got {size}")
    problems = tensor_parallel_problems(cfg, size, group_size)
    if problems:
        fits = [n for n in range(1, 65) if not tensor_parallel_problems(cfg, n, group_size)]
        raise SelfspecError(f"--tensor-parallel {size} does not evenly split this model's {', '.join(problems)}; "
                            f"sizes that do: {', '.join(map(str, fits))}")


def shard_state_dict(sd: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of an HF-named state dict (module docstring); each shard its own contiguous copy, so
    the full tensors can be freed. Splits are even: check_tensor_parallel first."""
    if size == 1:
        return sd
    out = {}
    for name, t in sd.items():
        parts = name.split(".")
        proj, kind = (parts[-2], parts[-1]) if len(parts) > 1 else ("", "")
        if proj in COLUMN:
            dim = 0
        elif proj in ROW and kind == "weight":
            dim = 1
        else:
            out[name] = t
            continue
        if t.shape[dim] % size:
            raise SelfspecError(f"{name}: {t.shape[dim]} rows cannot be split evenly across {size} ranks")
        out[name] = t.chunk(size, dim)[rank].clone(memory_format=torch.contiguous_format)
    return out
