"""Synthetic model shapes for benchmarks (weights are random, labelled synthetic in every output)."""
from __future__ import annotations

from selfspec.config import ModelConfig

SHAPES: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(arch="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                              hidden_dim=14336, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
                              max_seq_len=8192),
    "llama-3-70b": ModelConfig(arch="llama", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                               hidden_dim=28672, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
                               max_seq_len=8192),
    "llama-2-7b": ModelConfig(arch="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                              hidden_dim=11008, vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0,
                              max_seq_len=4096),
    "llama-2-13b": ModelConfig(arch="llama", dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128,
                               hidden_dim=13824, vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0,
                               max_seq_len=4096),
    "qwen2.5-7b": ModelConfig(arch="qwen2", dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                              hidden_dim=18944, vocab_size=152064, norm_eps=1e-6, rope_theta=1e6,
                              max_seq_len=8192, qkv_bias=True),
    # A small model with a large vocabulary: its tied head is 233M of 1.5B parameters (the trace models' shape).
    "qwen2.5-1.5b": ModelConfig(arch="qwen2", dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                                hidden_dim=8960, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6,
                                max_seq_len=8192, qkv_bias=True, tie_embeddings=True),
    # Its draft model's shape (recipe draft-model: Qwen2.5-Coder-0.5B drafting for the 1.5B).
    "qwen2.5-0.5b": ModelConfig(arch="qwen2", dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                                hidden_dim=4864, vocab_size=151936, norm_eps=1e-6, rope_theta=1e6,
                                max_seq_len=8192, qkv_bias=True, tie_embeddings=True),
}


def layer_gemms(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's linears (q/k/v and gate/up are fused, as in model.py)."""
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    return [("qkv", qkv, cfg.dim), ("o", cfg.dim, cfg.n_heads * cfg.head_dim), ("gate/up", 2 * cfg.hidden_dim, cfg.dim),
            ("down", cfg.dim, cfg.hidden_dim)]
