"""Fixtures shared by the GPU tests."""
import os

import pytest


@pytest.fixture(scope="module", params=["planes", "qspec"])
def llm(request):
    """SmolLM2 (or SELFSPEC_GPU_MODEL: a .gguf path or HF directory) on the GPU, once per speculative recipe."""
    import selfspec

    return selfspec.load(os.environ.get("SELFSPEC_GPU_MODEL"), request.param, device="cuda")
