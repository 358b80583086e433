"""SmoothQuant: move activation outliers into the weights before W8A8 quantization, the model staying one copy.

Per input channel j of a linear, s_j = max|X_j|^alpha / max|W_j|^(1-alpha) (max|X_j| calibrated on text,
max|W_j| over the weight's rows); the linear then reads X / s and W * s, the same product. Each 1/s is folded
into what precedes the linear, so no extra op runs:
- wqkv and gate_up read an RMSNorm's output: the norm's weight is divided by s (both linears' columns share it);
- wo reads attention(V): attention mixes V per channel, so v's output rows (and bias) are divided by s. With GQA
  one kv channel feeds wo's input channel of every query head that reads it, so those channels share one s: their
  activation and weight maxima are taken over the group (the max keeps every outlier of the group migrated);
- down reads silu(gate) * up, linear in up: up's output rows (and bias) are divided by s.
The row folds (into v and up) come first, so the column scales of wqkv and gate_up see the weights that will be
quantized. The activation maxima are the original model's: a fold changes only its own linear's input.
"""
from __future__ import annotations

import torch

from selfspec.errors import SelfspecError
from selfspec.model import Block, Linear, RMSNorm, Transformer
from selfspec.quant.formats import DenseWeight
from selfspec.quant.modes import MODES

DEFAULT_ALPHA = 0.5
CALIBRATION_TOKENS = 512
CALIBRATION_TASKS = ("gsm8k", "humaneval")  # data packages installed with selfspec
LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.gate_up", "feed_forward.down")


def calibration_tokens(tokenizer, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The first n tokens of prompts taken round-robin from the end of the GSM8K and HumanEval files (benchmarks
    and evals read their start), joined by blank lines: deterministic."""
    from selfspec.bench.serve import read_prompts

    if tokenizer is None:
        raise SelfspecError("SmoothQuant calibrates on text and this model came without a tokenizer; load one "
                            "with its tokenizer (an HF directory with tokenizer.json, or a GGUF)")
    per_task = [read_prompts(task)[::-1] for task in CALIBRATION_TASKS]
    texts = [per_task[i % len(per_task)][i // len(per_task)] for i in range(min(map(len, per_task)) * len(per_task))]
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise SelfspecError(f"the calibration prompts hold {len(ids)} tokens, {n} asked for; ask for fewer")


@torch.inference_mode()
def activation_maxima(model: Transformer, tokens: list[int]) -> dict[str, torch.Tensor]:
    """'layers.I.LINEAR' -> max |x| [in_features] (float32) over the tokens, for every block linear's input x,
    the model run densely in its own precision."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module, args):
            amax = args[0].detach().abs().flatten(0, -2).amax(0).float()
            maxima[name] = torch.maximum(maxima[name], amax) if name in maxima else amax
        return hook

    handles = [model.get_submodule(f"layers.{i}.{lin}").register_forward_pre_hook(record(f"layers.{i}.{lin}"))
               for i in range(len(model.layers)) for lin in LINEARS]
    try:
        ids = torch.tensor([tokens], device=model.device)
        mode = MODES["fp32" if model.dtype == torch.float32 else "bf16"]
        model.hidden(ids, torch.arange(len(tokens), device=model.device), model.new_cache(len(tokens)), mode)
    finally:
        for h in handles:
            h.remove()
    return maxima


def smoothing_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = x_max^alpha / w_max^(1 - alpha) per channel (float32); maxima floored so a dead channel gets a finite s."""
    if not 0 <= alpha <= 1:
        raise SelfspecError(f"SmoothQuant alpha must lie in [0, 1] (0: no migration, 1: all into the weights), "
                            f"got {alpha}")
    return x_max.float().clamp_min(1e-5).pow(alpha) / w_max.float().clamp_min(1e-5).pow(1 - alpha)


def dense(lin: Linear) -> torch.Tensor:
    if not isinstance(lin.weight, DenseWeight):
        raise SelfspecError("SmoothQuant folds into float weights: smooth the model before quantizing it")
    return lin.weight.weight


def column_maxima(*lins: Linear) -> torch.Tensor:
    """max |W[:, j]| over the rows of every linear (they read the same input)."""
    return torch.stack([dense(lin).float().abs().amax(0) for lin in lins]).amax(0)


def scale_columns_(lin: Linear, s: torch.Tensor) -> None:
    """W[:, j] *= s_j: the linear now reads X / s."""
    w = dense(lin)
    w.copy_(w.float() * s)


def scale_rows_(lin: Linear, rows: slice, s: torch.Tensor) -> None:
    """Output rows `rows` (and their bias) /= s: what the linear writes there is divided by s."""
    w = dense(lin)
    w[rows] = (w[rows].float() / s[:, None]).to(w.dtype)
    if lin.bias is not None:
        lin.bias.data[rows] = (lin.bias.data[rows].float() / s).to(lin.bias.dtype)


def fold_into_norm_(norm: RMSNorm, lins: list[Linear], x_max: torch.Tensor, alpha: float) -> None:
    """The linears reading norm(x) read norm(x) / s: the norm's weight divided by s, their columns times s."""
    s = smoothing_scales(x_max, column_maxima(*lins), alpha)
    norm.weight.data.copy_(norm.weight.data.float() / s)
    for lin in lins:
        scale_columns_(lin, s)


def group_max(t: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """[n_heads * hd] per query-head channel -> [n_kv_heads * hd]: the max over the query heads that read each kv
    head (query head h reads kv head h // (n_heads / n_kv_heads))."""
    return t.view(n_kv_heads, n_heads // n_kv_heads, -1).amax(1).flatten()


def fold_into_v_(block: Block, x_max: torch.Tensor, alpha: float, n_heads: int, n_kv_heads: int) -> None:
    """wo reads attention(V): v's output rows divided by s (one per kv channel), wo's columns times s, repeated
    for each query head of the group."""
    attn = block.attention
    w_max = group_max(column_maxima(attn.wo), n_heads, n_kv_heads)
    s = smoothing_scales(group_max(x_max, n_heads, n_kv_heads), w_max, alpha)
    q_rows, kv_rows, _ = attn.sizes
    scale_rows_(attn.wqkv, slice(q_rows + kv_rows, q_rows + 2 * kv_rows), s)
    scale_columns_(attn.wo, s.view(n_kv_heads, 1, -1).expand(-1, n_heads // n_kv_heads, -1).flatten())


def fold_into_up_(block: Block, x_max: torch.Tensor, alpha: float) -> None:
    """down reads silu(gate) * up: up's output rows (the second half of gate_up) divided by s, down's columns
    times s."""
    ffn = block.feed_forward
    s = smoothing_scales(x_max, column_maxima(ffn.down), alpha)
    hidden = dense(ffn.down).shape[1]
    scale_rows_(ffn.gate_up, slice(hidden, 2 * hidden), s)
    scale_columns_(ffn.down, s)


@torch.inference_mode()
def smooth_(model: Transformer, maxima: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> None:
    """Smooth every block linear of a float model in place, from its calibrated input maxima (`activation_maxima`)."""
    cfg = model.cfg
    for i, block in enumerate(model.layers):
        x = {lin: maxima[f"layers.{i}.{lin}"].to(model.device) for lin in LINEARS}
        fold_into_v_(block, x["attention.wo"], alpha, cfg.n_heads, cfg.n_kv_heads)
        fold_into_up_(block, x["feed_forward.down"], alpha)
        fold_into_norm_(block.attention_norm, [block.attention.wqkv], x["attention.wqkv"], alpha)
        fold_into_norm_(block.ffn_norm, [block.feed_forward.gate_up], x["feed_forward.gate_up"], alpha)
