"""Shared helpers: tiny random transformers models built in memory (no files, no downloads); the default model
(SmolLM2-135M) read once per session; cached dequantization; one torch thread per module."""
from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from selfspec.config import ModelConfig
from selfspec.engine.llm import LLM, build
from selfspec.errors import SelfspecError
from selfspec.loading import resolve
from selfspec.loading.named import DEFAULT_MODEL, named_model_path
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.recipes import resolve_recipe

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random HF model -> (ModelConfig, HF-named float32 state dict (fresh copies), HF model).

    Weights are scaled so activations and logits are O(1) (the HF init, std 0.02, leaves logits near 0,
    where a parity test proves little) and norm weights / biases are randomised so a mix-up would show.
    `overrides` go to the HF config (e.g. tie_word_embeddings=True, vocab_size=16, rope_parameters=...).
    """
    cfg_cls, model_cls = ARCHS[arch]
    kw = {**TINY, **overrides}
    if arch == "mistral":
        kw.setdefault("sliding_window", None)
    hf_cfg = cfg_cls(**kw)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            else:  # [out, in] projections, and an untied lm_head
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ModelConfig.from_hf(hf_cfg.to_dict()), sd, model


def gpu_test_model() -> str | None:
    """The model the GPU tests load: SELFSPEC_GPU_MODEL (a .gguf path or HF directory), else the embedded default
    (None); the test is skipped, saying why, where neither is on this machine (a GPU host without the package)."""
    path = os.environ.get("SELFSPEC_GPU_MODEL")
    if path is None:
        try:
            named_model_path(DEFAULT_MODEL)
        except SelfspecError as e:
            pytest.skip(f"no GPU test model: {e}; or set SELFSPEC_GPU_MODEL")
    return path


@pytest.fixture(scope="session")
def smollm2_resolved():
    """resolve(None): the default model (SmolLM2-135M) as config, float32 weights, tokenizer and description.
    Read from its GGUF once for the session (~10 s each time); tests must not modify the weights."""
    return resolve(None)


@pytest.fixture(scope="session")
def smollm2(smollm2_resolved):
    """make(recipe) -> the default model under a recipe, as `selfspec.load(None, recipe)` builds it; each build
    quantizes its own copy of the weights."""
    cfg, sd, tok, desc = smollm2_resolved

    def make(recipe: str | None = None) -> LLM:
        weights = {name: t.clone() for name, t in sd.items()}
        return build(cfg, weights, tok, resolve_recipe(recipe), description=desc)

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): its matmuls are tiny,
    and with other jobs on a 2-core CPU two OpenMP threads mostly spin-wait for each other."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextmanager
def recorded_logits(model):
    """Every output of model.logits while the block runs, in call order (the rows an engine draws first tokens
    from)."""
    heads, logits = [], model.logits

    def recording(hidden, mode):
        heads.append(logits(hidden, mode))
        return heads[-1]

    model.logits = recording
    try:
        yield heads
    finally:
        del model.logits


def served_tokens(engine) -> dict[str, list[int]]:
    """Step the engine until it is idle: each request's tokens."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


class ShuffledGammaPolicy(GammaPolicy):
    """The policy's drafts per round drawn from a seeded generator: a schedule that does not follow this machine's
    timings, so a test sees the same batches, groups and preemptions on every run (seed by seed)."""

    def __init__(self, seed: int, max_gamma: int = 4):
        super().__init__(max_gamma)
        self.rng = random.Random(seed)

    def choose(self, rows: int) -> int:
        return self.rng.randint(0, self.max_gamma)


def check_mixed_batch_equals_solo(llm, prompts: list[list[int]], policy: GammaPolicy | None = None):
    """The prompts and 4 random ones served together: per-request gammas next to the policy's, greedy rows next to
    seeded sampling rows, a pool small enough to preempt. Each request must equal its solo run (a sampling row drafts
    a fixed count, as its solo run does). -> the engine's stats."""
    from selfspec.engine.engine import Engine
    from selfspec.speculative.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    randoms = [torch.randint(3, 250, (int(torch.randint(2, 10, (), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    ps = prompts + randoms
    gammas = [2, None, 4, 3, None, 0, 1, None]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True) if i % 3
              else SamplingParams(temperature=1.0, seed=i, max_new_tokens=30, ignore_eos=True) for i in range(len(ps))]
    refs = [llm.generate(p, sp, gamma=0 if sp.greedy else g).token_ids for p, sp, g in zip(ps, params, gammas)]
    engine = Engine(llm, max_batch=8, block_size=4, num_blocks=40, prefill_chunk=16, max_gamma=4, policy=policy)
    for i, (p, sp, gm) in enumerate(zip(ps, params, gammas)):
        engine.add_request(str(i), p, sp, gamma=gm)
    tokens = served_tokens(engine)
    assert [tokens[str(i)] for i in range(len(ps))] == refs
    return engine.stats()


class RecordedPasses:
    """The model, recording each pass's token shape (rows, tokens per row; a tree pass: its branch rows'); the
    decoding loop takes it for the model."""

    def __init__(self, model):
        self.model, self.shapes = model, []
        self.device, self.cfg, self.new_cache = model.device, model.cfg, model.new_cache

    def __call__(self, tokens, *args, **kwargs):
        tree = kwargs.get("tree")
        self.shapes.append(tuple((tokens if tree is None else tree.rows).shape))
        return self.model(tokens, *args, **kwargs)


def fail_from(monkeypatch, model, position: int) -> None:
    """Make model raise on every pass that reaches `position` (the engine's error isolation tests)."""
    forward = model.forward

    def failing(tokens, pos, cache, mode, **kwargs):
        if pos.max() >= position:
            raise RuntimeError("boom")
        return forward(tokens, pos, cache, mode, **kwargs)

    monkeypatch.setattr(model, "forward", failing)


_INTERPRETED_KERNELS_SKIPPED: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # tests/test_triton_kernels.py skips itself when the kernels were defined before it set TRITON_INTERPRET=1: a
    # test module that imports selfspec.kernels at collection, ahead of it, does that and silently drops its tests.
    if (report.nodeid.endswith("test_triton_kernels.py") and report.skipped
            and "before TRITON_INTERPRET=1 was set" in str(report.longrepr)):
        _INTERPRETED_KERNELS_SKIPPED.append(str(report.longrepr))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    if _INTERPRETED_KERNELS_SKIPPED:
        raise pytest.UsageError("tests/test_triton_kernels.py skipped itself at collection: a test module "
                                "collected before it imports selfspec.kernels at module level (import the kernels "
                                f"inside its tests). Skip reason: {_INTERPRETED_KERNELS_SKIPPED[0]}")
