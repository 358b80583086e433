"""Load a Hugging Face model directory: config.json plus (possibly sharded) *.safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from selfspec.config import ModelConfig
from selfspec.errors import SelfspecError
from selfspec.loading.weights import check_weights


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return the config and all weights as float32, keyed by their HF names."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SelfspecError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        config = ModelConfig.from_hf(_read_json(config_file))
    except KeyError as e:
        raise SelfspecError(f"{config_file} lacks the field {e}") from e

    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded checkpoint: the index names the shard files
        files = sorted({path / f for f in _read_json(index)["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SelfspecError(f"{path} has no *.safetensors weights (other formats are not supported)")

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name).float()
        except (SafetensorError, OSError) as e:
            raise SelfspecError(f"{file} is not a readable safetensors file: {e}") from e

    # Tied models may omit lm_head (the embedding doubles as it); untied ones must have it.
    if not config.tie_embeddings and "lm_head.weight" not in weights:
        raise SelfspecError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    check_weights(config, weights, str(path))
    return config, weights


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SelfspecError(f"{file} is not a readable JSON file: {e}") from e
