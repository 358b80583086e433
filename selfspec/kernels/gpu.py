"""Registers the Triton kernels for "cuda" where Triton can run them: on a CUDA device, or in Triton's
interpreter (TRITON_INTERPRET=1, what the CPU tests use). CPU-only installs without Triton keep the references."""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_usable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


if triton_usable():
    import selfspec.kernels.triton_attention  # noqa: F401
    import selfspec.kernels.triton_linear  # noqa: F401
    import selfspec.kernels.triton_quant_attention  # noqa: F401
    import selfspec.kernels.triton_small  # noqa: F401
