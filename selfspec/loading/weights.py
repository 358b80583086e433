"""Check a checkpoint's tensors against its config: every one the model needs, none it would silently drop."""
from __future__ import annotations

import torch

from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved; recomputed from the config


def expected_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF name -> shape of every tensor the model reads, and the names it may ignore (a tied model's lm_head)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.dim), "model.norm.weight": (cfg.dim,)}
    head = {"lm_head.weight": (cfg.vocab_size, cfg.dim)}
    optional = set(head) if cfg.tie_embeddings else set()
    if not cfg.tie_embeddings:
        shapes.update(head)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layer = {"input_layernorm": (cfg.dim,), "post_attention_layernorm": (cfg.dim,),
                 "self_attn.q_proj": (q, cfg.dim), "self_attn.k_proj": (kv, cfg.dim), "self_attn.v_proj": (kv, cfg.dim),
                 "self_attn.o_proj": (cfg.dim, q), "mlp.gate_proj": (cfg.hidden_dim, cfg.dim),
                 "mlp.up_proj": (cfg.hidden_dim, cfg.dim), "mlp.down_proj": (cfg.dim, cfg.hidden_dim)}
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm": (cfg.head_dim,), "self_attn.k_norm": (cfg.head_dim,)}
        shapes |= {f"{p}{name}.weight": shape for name, shape in layer.items()}
        biased = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"] * cfg.qkv_bias
        biased += ["self_attn.o_proj"] * cfg.o_bias + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] * cfg.mlp_bias
        shapes |= {f"{p}{name}.bias": layer[name][:1] for name in biased}
    return shapes, optional


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Refuse, naming the tensors, a checkpoint that lacks one the config needs, has one it would not use (e.g. a
    bias the config does not declare) or one of the wrong shape."""
    shapes, optional = expected_shapes(cfg)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise SelfspecError(f"{source}: the config needs tensors the checkpoint lacks: {_names(missing)}")
    unused = [n for n in weights if n not in shapes and n not in optional and not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        raise SelfspecError(f"{source}: tensors the config does not account for (they would be ignored): "
                            f"{_names(unused)}; the config and the weights disagree")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise SelfspecError(f"{source}: {name} has shape {tuple(weights[name].shape)}, the config implies {shape}")


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
