"""The prefill benchmark's torch peer computes the same model as ours (on the CPU, float32 and bf16)."""
import argparse

import pytest
import torch

from selfspec.bench.prefill import our_prefill, peer_prefill, size
from selfspec.model import Transformer
from tests.conftest import tiny_model


@pytest.mark.parametrize("dtype,mode,tol", [(torch.float32, "fp32", 1e-4), (torch.bfloat16, "bf16", 5e-2)])
def test_peer_prefill_matches_our_model(dtype, mode, tol):
    cfg, sd, _ = tiny_model("qwen2")  # GQA and qkv biases
    model = Transformer(cfg, {k: v.to(dtype) for k, v in sd.items()})
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        ours = our_prefill(model, tokens, mode)
        peer = peer_prefill(model, tokens)
    assert ours.shape == peer.shape == (2, cfg.vocab_size)
    assert (ours - peer).abs().max() <= tol * ours.abs().max()


def test_size_argument():
    assert size("8x512") == (8, 512)
    for bad in ("8", "x512", "0x5", "8x-1", "ax2"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxTOKENS"):
            size(bad)
