"""Synthetic-weight models of real shapes, built on the GPU (randn * 0.02; never zeros), for speed benchmarks."""
from __future__ import annotations

from dataclasses import replace

import torch

from selfspec.bench.shapes import SHAPES
from selfspec.engine.llm import LLM
from selfspec.model import Transformer
from selfspec.parallel import SOLO, TensorParallel, shard_state_dict
from selfspec.speculative.recipes import PRESETS


def synthetic_state_dict(shape: str, device: str = "cuda", seed: int = 0,
                         tp: TensorParallel = SOLO) -> dict[str, torch.Tensor]:
    """HF-named bf16 weights: projections randn * 0.02, norms 1 + 0.1 randn, biases 0.02 randn; under tensor
    parallelism this rank's shard, layer by layer (a 70B model's full weights would not fit one GPU)."""
    cfg = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * std + mean).bfloat16()

    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sd = shard_state_dict({"model.embed_tokens.weight": randn(cfg.vocab_size, cfg.dim),
                           "model.norm.weight": randn(cfg.dim, std=0.1, mean=1),
                           "lm_head.weight": randn(cfg.vocab_size, cfg.dim)}, tp.rank, tp.size)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layer = {p + "input_layernorm.weight": randn(cfg.dim, std=0.1, mean=1),
                 p + "post_attention_layernorm.weight": randn(cfg.dim, std=0.1, mean=1),
                 p + "self_attn.q_proj.weight": randn(q, cfg.dim), p + "self_attn.k_proj.weight": randn(kv, cfg.dim),
                 p + "self_attn.v_proj.weight": randn(kv, cfg.dim), p + "self_attn.o_proj.weight": randn(cfg.dim, q),
                 p + "mlp.gate_proj.weight": randn(cfg.hidden_dim, cfg.dim),
                 p + "mlp.up_proj.weight": randn(cfg.hidden_dim, cfg.dim),
                 p + "mlp.down_proj.weight": randn(cfg.dim, cfg.hidden_dim)}
        if cfg.qkv_bias:
            layer |= {p + f"self_attn.{n}_proj.bias": randn(d) for n, d in (("q", q), ("k", kv), ("v", kv))}
        sd |= shard_state_dict(layer, tp.rank, tp.size)
    return sd


def synthetic_model(shape: str, storage: str, group_size: int = 128, device: str = "cuda", seed: int = 0,
                    rotate: bool = False, tp: TensorParallel = SOLO, max_seq_len: int | None = None) -> Transformer:
    """A Transformer of a named shape with synthetic weights, stored in `storage` (dense: bf16), Hadamard-rotated
    with `rotate` (as a recipe asks); under tensor parallelism (`tp`), this rank's shard of it. max_seq_len: rope
    tables for this many positions instead of the shape's own (long-context benchmarks)."""
    cfg = SHAPES[shape] if max_seq_len is None else replace(SHAPES[shape], max_seq_len=max_seq_len)
    model = Transformer(cfg, synthetic_state_dict(shape, device, seed, tp), tp)
    model.quantize(storage, group_size, rotate)
    return model.to(device)


def synthetic_llm(shape: str, recipe: str, max_gamma: int, group_size: int, device: str) -> LLM:
    """An LLM (no tokenizer: token ids in and out) of a recipe over a synthetic model of a named shape."""
    r = PRESETS[recipe]
    model = synthetic_model(shape, r.storage, group_size, device, rotate=r.rotate)
    return LLM(model, None, r, max_gamma, f"{shape} (SYNTHETIC weights, randn * 0.02)")
