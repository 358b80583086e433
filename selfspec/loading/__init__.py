"""Turn a model argument (a name, an HF directory or a .gguf file) into config, weights and tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.loading.gguf_file import load_gguf
from selfspec.loading.hf import load_hf_dir
from selfspec.loading.named import DEFAULT_MODEL, NAMED_MODELS, named_model_path
from selfspec.loading.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["resolve", "load_hf_dir", "load_gguf", "load_tokenizer", "NAMED_MODELS", "DEFAULT_MODEL"]


def resolve(
    model: str | None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], PreTrainedTokenizerBase | None, str]:
    """Load `model` (None: the default named model); returns config, float32 weights, tokenizer, description."""
    name = DEFAULT_MODEL if model is None else model
    if name in NAMED_MODELS:
        path = named_model_path(name)
        label = f"{name} ({NAMED_MODELS[name].description})"
    else:
        path = Path(name)
        label = str(path)
        if not path.exists():
            raise SelfspecError(
                f"model path {path} does not exist; give a named model ({', '.join(NAMED_MODELS)}), "
                "an HF directory or a .gguf file"
            )
    if not path.is_dir() and not path.is_file():
        raise SelfspecError(f"{path} is neither a directory nor a regular file")
    config, weights = load_hf_dir(path) if path.is_dir() else load_gguf(path)
    description = f"{label}: {config.arch}, {config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}"
    return config, weights, load_tokenizer(path), description
