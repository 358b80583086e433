"""Tokenizers from an HF directory or a GGUF file, via transformers, strictly offline."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.errors import SelfspecError
from selfspec.loading.cache import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """Tokenizer for a model path; None for an HF directory that ships none (tiny test models)."""
    from transformers import AutoTokenizer  # imported here: it takes seconds, and only tokenizers need it

    path = Path(path)
    try:
        if path.is_dir():
            if not any((path / f).is_file() for f in TOKENIZER_FILES):
                return None
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        cached = cache_dir() / "tokenizers" / _gguf_key(path)
        if not cached.is_dir():
            _convert_gguf_tokenizer(path, cached)
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise SelfspecError(f"cannot load a tokenizer from {path}: {e}") from e


def _gguf_key(path: Path) -> str:
    """Key a GGUF by its size and first 4 MB (the metadata), so copies of a file share one entry.

    The transformers version is part of the key since the converted format may change with it.
    """
    import transformers

    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
    h.update(f"{path.stat().st_size}:{transformers.__version__}".encode())
    return h.hexdigest()[:24]


def _convert_gguf_tokenizer(path: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    # Converting a GGUF vocabulary takes seconds, so do it once and keep the result.
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-")
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, dest)  # atomic: a concurrent loader sees all of it or none
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
