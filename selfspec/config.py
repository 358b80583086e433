"""Model configuration: the shape of a decoder-only transformer, read from HF config.json or GGUF."""
from __future__ import annotations

from dataclasses import dataclass, field

from selfspec.errors import SelfspecError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


# What transformers assumes for a field config.json leaves out (its configuration_*.py), per architecture.
HF_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, num_key_value_heads=32, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(max_position_embeddings=32768, num_key_value_heads=32, head_dim=128, sliding_window=4096,
                  max_window_layers=28),
}
COMMON_DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
# RoPE types rope_frequencies computes exactly; "dynamic" equals plain RoPE within max_position_embeddings.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    o_bias: bool = False  # the attention output projection has a bias (llama / qwen3 attention_bias)
    mlp_bias: bool = False  # gate, up and down projections have biases (llama mlp_bias)
    # Attention sees only this many past tokens (itself included). Not implemented past it: max_seq_len is clamped
    # to the window, inside which sliding-window attention is exactly full causal attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise SelfspecError(
                f"unsupported architecture '{self.arch}'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.sliding_window is not None:
            self.max_seq_len = min(self.max_seq_len, self.sliding_window)

    @classmethod
    def from_hf(cls, config_json: dict) -> "ModelConfig":
        """Build from a HF config.json dict; a field that changes the output and is not implemented is refused."""
        model_type = config_json.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise SelfspecError(
                f"unsupported architecture '{model_type}' in config.json; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = model_type
        cfg = {**COMMON_DEFAULTS, **HF_DEFAULTS[arch], **config_json}
        _refuse_unsupported(cfg)
        n_heads = cfg["num_attention_heads"]
        dim = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_positions = cfg["max_position_embeddings"]
        rope_theta, rope_scaling = _hf_rope(cfg, max_positions)
        attention_bias = arch in ("llama", "qwen3") and bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or dim // n_heads,
            hidden_dim=cfg["intermediate_size"],
            norm_eps=cfg["rms_norm_eps"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=max_positions,
            tie_embeddings=bool(cfg["tie_word_embeddings"]),
            qkv_bias=arch == "qwen2" or attention_bias,
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            o_bias=attention_bias,
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            sliding_window=_hf_sliding_window(cfg, arch),
        )


def _refuse_unsupported(cfg: dict) -> None:
    if cfg["hidden_act"] not in ("silu", "swish"):  # transformers maps both to SiLU
        raise SelfspecError(f"config.json: hidden_act '{cfg['hidden_act']}' is not supported; the MLP is SwiGLU, "
                            "so only 'silu' models load")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise SelfspecError(f"config.json: quantization_config ({method}): pre-quantized checkpoints are not "
                            "supported; give the unquantized model (selfspec quantizes it itself)")
    unknown = set(cfg.get("layer_types") or []) - {"full_attention", "sliding_attention"}
    if unknown:
        raise SelfspecError(f"config.json: layer_types {sorted(unknown)} are not supported; "
                            "supported: full_attention, sliding_attention")


def _hf_rope(cfg: dict, max_positions: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config layout: rope_theta + rope_scaling (transformers < 5)
    or rope_parameters (>= 5); as in transformers, a rope_scaling present wins."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise SelfspecError("config.json: rope_parameters per layer type are not supported; give one rope setting")
    theta = float(params.get("rope_theta", cfg["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise SelfspecError(f"config.json: rope_type '{kind}' is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise SelfspecError(f"config.json: partial_rotary_factor {partial} is not supported; RoPE covers the "
                            "whole head here")
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    if kind in ("llama3", "yarn"):  # transformers' fallback for the pretraining context
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or max_positions
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return theta, scaling


def _hf_sliding_window(cfg: dict, arch: str) -> int | None:
    """The window if any layer slides, as transformers decides it per architecture."""
    window = cfg.get("sliding_window")
    if arch == "llama" or window is None:
        return None
    if arch == "mistral":
        return window
    if not cfg.get("use_sliding_window", False):  # qwen2 / qwen3 ignore the window unless this is set
        return None
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    return window if "sliding_attention" in layer_types else None
