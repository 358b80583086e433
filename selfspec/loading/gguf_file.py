"""Load a GGUF file (llama.cpp's format): dequantize every tensor to float32 under its HF name."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.loading.weights import check_weights

# GGUF architecture -> ModelConfig arch. Mistral GGUFs are written as "llama" by llama.cpp.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The `ARCH.*` metadata keys this loader implements; any other one would change the model in a way it does not.
KNOWN_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
}


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return the config and all weights as float32, keyed by their HF names."""
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise SelfspecError(f"{path} is not a readable GGUF file: {e}") from e
    # The reader maps tensors past the end of a truncated file without complaint; check up front.
    needed = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if needed > reader.data.size:
        raise SelfspecError(
            f"{path} is not a readable GGUF file: it is truncated ({reader.data.size} bytes, tensors need {needed})"
        )
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise SelfspecError(
            f"unsupported GGUF architecture '{arch}' in {path}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    raw: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        try:
            data = dequantize(t.data, t.tensor_type)
            # GGUF lists dims fastest-first; reversed they are torch's [out, in].
            raw[t.name] = data.reshape([int(d) for d in reversed(t.shape)])
        except NotImplementedError as e:
            raise SelfspecError(f"{path}: tensor {t.name} has an unsupported type: {e}") from e
        except ValueError as e:  # a shape that does not fit the tensor's data
            raise SelfspecError(f"{path} is not a readable GGUF file: tensor {t.name}: {e}") from e

    config = _config(meta, raw, arch, path)
    weights: dict[str, torch.Tensor] = {}
    for name, data in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        if name in GLOBAL_NAMES:
            hf_name = GLOBAL_NAMES[name]
        elif (m := LAYER_RE.fullmatch(name)) and m[2] in LAYER_NAMES:
            hf_name = f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.{m[3]}"
            # llama.cpp's converter permutes llama q/k rows for its rope layout; undo it.
            if arch == "llama" and m[2] == "attn_q":
                data = _unpermute(data, config.n_heads)
            elif arch == "llama" and m[2] == "attn_k":
                data = _unpermute(data, config.n_kv_heads)
        else:
            raise SelfspecError(f"{path}: unexpected tensor '{name}' for architecture {arch}")
        # Copy what is still a read-only view of the memory-mapped file.
        weights[hf_name] = torch.from_numpy(data if data.flags.writeable else data.copy())
    check_weights(config, weights, str(path))
    return config, weights


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's `w.reshape(n_head, 2, hd // 2, rest).swapaxes(1, 2)`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x: float) -> float:
    """GGUF stores float32; go through its shortest repr so 1e-5 stays 1e-5, not 9.99999974e-06."""
    return float(str(np.float32(x)))


def _config(meta: dict, raw: dict[str, np.ndarray], arch: str, path: str | Path) -> ModelConfig:
    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise SelfspecError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    for key, value in meta.items():
        name = key.removeprefix(f"{arch}.")
        dense_moe_key = name.startswith("expert_") and value == 0  # converters write expert counts of 0
        if name != key and name not in KNOWN_KEYS and not dense_moe_key:
            raise SelfspecError(f"{path}: GGUF metadata {key} = {value} is not supported (selfspec does not "
                                "implement what it changes); convert the model without it or use another model")
    dim, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", dim // n_heads)
    for key in ("attention.value_length", "rope.dimension_count"):  # both must be the whole head here
        if get(key, head_dim) != head_dim:
            raise SelfspecError(f"{path}: GGUF metadata {arch}.{key} = {get(key)} differs from the head size "
                                f"{head_dim}; partial rotary or distinct value heads are not supported")
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]

    rope_scaling = None
    if "rope_freqs.weight" in raw:  # llama3-style scaling, baked into per-frequency factors
        rope_scaling = _llama3_rope_scaling(raw["rope_freqs.weight"], rope_theta, head_dim, path)
    elif get("rope.scaling.type", "none") != "none":
        kind = get("rope.scaling.type")
        if kind not in ("linear", "yarn"):
            raise SelfspecError(f"{path}: GGUF rope scaling '{kind}' is not supported; supported: linear, yarn")
        rope_scaling = {"rope_type": kind, "factor": _f32(get("rope.scaling.factor"))}
        # transformers' fallback for the pretraining context, as in config.json
        rope_scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length",
                                                               get("context_length"))

    return ModelConfig(
        arch=GGUF_ARCHITECTURES[arch],
        # The embedding's row count is what the weights need; metadata vocab sizes are sometimes absent.
        vocab_size=raw["token_embd.weight"].shape[0],
        dim=dim,
        n_layers=get("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        hidden_dim=get("feed_forward_length"),
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=get("context_length"),
        tie_embeddings="output.weight" not in raw,
        qkv_bias="blk.0.attn_q.bias" in raw,
        qk_norm="blk.0.attn_q_norm.weight" in raw,
        o_bias="blk.0.attn_output.bias" in raw,
        mlp_bias="blk.0.ffn_down.bias" in raw,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
    )


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, path: str | Path) -> dict | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's per-frequency factors.

    Between the two cut-offs the factor f satisfies smooth = (1/f - 1/F) / (1 - 1/F) with
    smooth = (orig_ctx / wavelen - low) / (high - low), a line in 1/wavelen. Only low/orig_ctx and
    high/orig_ctx are determined, so orig_ctx is fixed at Llama 3's 8192 and the line is fitted.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    inv_wavelen = theta ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * np.pi)
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if mid.sum() < 2:
        raise SelfspecError(f"{path}: cannot recover llama3 rope scaling from rope_freqs.weight")
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[mid], smooth, 1)
    orig_ctx = 8192
    low = -intercept * orig_ctx / slope
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + orig_ctx / slope),
        "original_max_position_embeddings": orig_ctx,
    }
