"""Our fp32 forward reproduces transformers' logits: full prompts (prefill) and token by token through the KV cache."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import LLAMA3_ROPE, tiny_model
from selfspec.model import Transformer, rope_attention_factor, rope_frequencies
from selfspec.quant.modes import MODES

FP32 = MODES["fp32"]
ATOL = 1e-4
CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    # head_dim 16 with original context 64 puts frequencies in all three llama3 bands (kept, smoothed, scaled).
    "llama3-rope": ("llama", dict(rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),  # q/k/v biases
    "qwen3": ("qwen3", dict(head_dim=32)),  # q/k norms; head_dim != hidden / heads
    "mistral": ("mistral", {}),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),  # q/k/v/o and gate/up/down biases
    "qwen3-attention-bias": ("qwen3", dict(head_dim=32, attention_bias=True)),
    "linear-rope": ("llama", dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0})),
    # dynamic NTK scaling only starts past max_position_embeddings: plain RoPE inside it
    "dynamic-rope": ("llama", dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 4.0})),
    # head_dim 16, original context 64: frequencies kept, interpolated and on the ramp; attention factor 1.14
    "yarn-rope": ("qwen2", dict(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64})),
    # the context is clamped to the window, inside which sliding-window attention is full attention
    "mistral-window": ("mistral", dict(sliding_window=40)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    arch, overrides = CASES[request.param]
    cfg, sd, hf = tiny_model(arch, seed=len(request.param), **overrides)
    return request.param, cfg, Transformer(cfg, sd), hf


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens).logits.float()


def test_config_features(case):
    """The config reader picked up what each case is about (else the parity below proves less)."""
    name, cfg, model, hf = case
    assert cfg.arch == CASES[name][0]
    assert cfg.qkv_bias == (cfg.arch == "qwen2" or name in ("llama-biases", "qwen3-attention-bias"))
    assert cfg.o_bias == (name in ("llama-biases", "qwen3-attention-bias"))
    assert cfg.mlp_bias == (name == "llama-biases")
    assert cfg.qk_norm == (cfg.arch == "qwen3")
    assert cfg.tie_embeddings == (name == "llama-tied")
    if name == "llama-tied":  # the head is the embedding itself, not a copy
        assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()
    if name == "llama3-rope":
        assert cfg.rope_scaling["rope_type"] == "llama3"
        plain = rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
        scaled = rope_frequencies(cfg)
        assert (scaled == plain).any() and (scaled < plain).any()  # some bands kept, some scaled
    if name == "qwen3":
        assert cfg.head_dim == 32 and cfg.head_dim * cfg.n_heads != cfg.dim
    if name.endswith("rope") and name != "llama3-rope":
        kind = name.removesuffix("-rope")
        plain = rope_frequencies(dataclasses.replace(cfg, rope_scaling=None))
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[kind](hf.config, seq_len=1)
        torch.testing.assert_close(rope_frequencies(cfg).float(), hf_inv)
        assert rope_attention_factor(cfg) == pytest.approx(hf_factor)
        if kind == "yarn":
            assert (rope_frequencies(cfg) == plain).any() and (rope_frequencies(cfg) < plain / 1.01).any()
            assert rope_attention_factor(cfg) > 1.1
    if name == "mistral-window":
        assert (cfg.sliding_window, cfg.max_seq_len) == (40, 40)


def test_prefill_matches_transformers(case):
    _, cfg, model, hf = case
    torch.manual_seed(1)
    for length in (1, 7, 33):
        tokens = torch.randint(0, cfg.vocab_size, (1, length))
        ours = model(tokens, torch.arange(length), model.new_cache(64), FP32)
        ref = hf_logits(hf, tokens)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert ref.std() > 0.5  # logits are O(1), not a near-constant that anything would match
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-5)


def test_batch_prefill_matches_transformers(case):
    _, cfg, model, hf = case
    torch.manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (3, 12))
    ours = model(tokens, torch.arange(12), model.new_cache(16, batch=3), FP32)
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=1e-5)


def test_incremental_decoding_matches_full_sequence(case):
    """Prefill 10 tokens, then 5 single-token steps through the cache == transformers on the whole sequence."""
    _, cfg, model, hf = case
    torch.manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (1, 15))
    ref = hf_logits(hf, tokens)
    cache = model.new_cache(32)
    got = [model(tokens[:, :10], torch.arange(10), cache, FP32)]
    cache.commit(10)
    for p in range(10, 15):
        got.append(model(tokens[:, p : p + 1], torch.tensor([p]), cache, FP32))
        cache.commit(p + 1)
    torch.testing.assert_close(torch.cat(got, dim=1), ref, atol=ATOL, rtol=1e-5)
    # A multi-token step in the middle (what a verify pass does) agrees too.
    cache2 = model.new_cache(32)
    model(tokens[:, :6], torch.arange(6), cache2, FP32)
    mid = model(tokens[:, 6:11], torch.arange(6, 11), cache2, FP32)
    torch.testing.assert_close(mid, ref[:, 6:11], atol=ATOL, rtol=1e-5)


def test_stale_rows_past_length_are_not_read(case):
    """Garbage written past the committed length (rejected drafts) does not change later logits."""
    _, cfg, model, hf = case
    torch.manual_seed(4)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    cache = model.new_cache(32)
    model(tokens[:, :8], torch.arange(8), cache, FP32)
    cache.k[:, :, :, 8:] = 1e3 * torch.randn_like(cache.k[:, :, :, 8:])
    cache.v[:, :, :, 8:] = 1e3 * torch.randn_like(cache.v[:, :, :, 8:])
    out = model(tokens[:, 8:12], torch.arange(8, 12), cache, FP32)
    torch.testing.assert_close(out, hf_logits(hf, tokens)[:, 8:12], atol=ATOL, rtol=1e-5)


def test_rows_at_their_own_positions_match_each_row_alone(case):
    """Batching sequences of different lengths: pos [B, T] gives each row its own offsets in RoPE, cache and mask."""
    _, _, model, _ = case
    torch.manual_seed(11)
    seqs = [torch.randint(0, 256, (n,)) for n in (9, 5)]
    alone = []
    for s in seqs:  # each sequence alone: prefill all but one token, then decode the last one
        cache = model.new_cache(16)
        model(s[None, :-1], torch.arange(len(s) - 1), cache, FP32)
        alone.append(model(s[None, -1:], torch.tensor([len(s) - 1]), cache, FP32)[0, -1])
    cache = model.new_cache(16, batch=2)
    for b, s in enumerate(seqs):  # prefill each row of a batch-2 cache in its own pass (its own length)
        view = model.new_cache(16)
        model(s[None, :-1], torch.arange(len(s) - 1), view, FP32)
        cache.k[:, b], cache.v[:, b] = view.k[:, 0], view.v[:, 0]
    last = torch.stack([s[-1:] for s in seqs])
    pos = torch.tensor([[len(s) - 1] for s in seqs])
    together = model(last, pos, cache, FP32)[:, -1]
    for b in range(2):
        torch.testing.assert_close(together[b], alone[b], rtol=1e-5, atol=1e-5)


def test_tied_head_stays_the_embedding_after_a_move():
    """`.to()` moves parameters and buffers one by one; the tied head must not become a second copy."""
    cfg, sd, _ = tiny_model("llama", seed=3, tie_word_embeddings=True)
    model = Transformer(cfg, sd).to(torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()
    assert model.lm_head.weight.dtype == torch.bfloat16
