"""Where selfspec keeps files it derives from models (assembled GGUFs, converted tokenizers)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SELFSPEC_CACHE`, else `~/.cache/selfspec`; read on every call so tests can redirect it."""
    path = Path(os.environ.get("SELFSPEC_CACHE") or Path.home() / ".cache" / "selfspec")
    path.mkdir(parents=True, exist_ok=True)
    return path
