"""SmoothQuant: each fold leaves the float model's function unchanged, the GQA sharing included; at alpha 0.5 the
smoothed activation and weight maxima meet; W8A8 of a model with outlier channels gets closer to float; the
`quasar` recipe stores the smoothed weights."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from selfspec.errors import SelfspecError
from selfspec.model import Transformer
from selfspec.quant import smooth
from selfspec.quant.modes import MODES
from selfspec.speculative.recipes import resolve_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
# llama: GQA (4 query heads, 2 kv heads); qwen2: q/k/v biases; qwen3: q/k norms; MQA: every query head on one kv head
ARCHS = [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama", dict(num_key_value_heads=1))]


def outlier_model(arch: str = "llama", seed: int = 0, **overrides) -> Transformer:
    """A tiny fp32 model whose norms and up projections write a few outlier channels, as trained LLMs do: the
    smoothing scales then lie far from 1, and W8A8 suffers without them."""
    cfg, sd, _ = tiny_model(arch, seed=seed, **overrides)
    model = Transformer(cfg, sd)
    for block in model.layers:
        block.attention_norm.weight.data[3] *= 30
        block.ffn_norm.weight.data[5] *= 30
        block.feed_forward.gate_up.weight.weight[cfg.hidden_dim + 7] *= 30  # up row 7: down's input channel 7
        q_rows, kv_rows, _ = block.attention.sizes
        block.attention.wqkv.weight.weight[q_rows + kv_rows + 1] *= 30  # v channel 1: wo's input channel 1 per head
    return model


def logits(model: Transformer, mode: str = "fp32") -> torch.Tensor:
    n = TOKENS.shape[1]
    return model(TOKENS, torch.arange(n), model.new_cache(n), MODES[mode])


def maxima(model: Transformer) -> dict[str, torch.Tensor]:
    return smooth.activation_maxima(model, TOKENS[0].tolist())


def weights(model: Transformer) -> list[torch.Tensor]:
    return [t.clone() for t in list(model.parameters()) + list(model.buffers())]


@pytest.mark.parametrize("arch,overrides", ARCHS)
def test_smoothed_model_computes_the_original_function(arch, overrides):
    model = outlier_model(arch, **overrides)
    ref, before = logits(model), weights(model)
    smooth.smooth_(model, maxima(model))
    torch.testing.assert_close(logits(model), ref, rtol=1e-4, atol=1e-4)
    changed = [not torch.allclose(a, b, rtol=0.01) for a, b in zip(before, weights(model))]
    assert sum(changed) >= 4 * len(model.layers)  # two norms, wqkv (columns and v rows), gate_up, wo, down


FOLDS = {
    "attention norm": lambda b, x, cfg: smooth.fold_into_norm_(b.attention_norm, [b.attention.wqkv],
                                                                 x["attention.wqkv"], 0.5),
    "ffn norm": lambda b, x, cfg: smooth.fold_into_norm_(b.ffn_norm, [b.feed_forward.gate_up],
                                                           x["feed_forward.gate_up"], 0.5),
    "v rows": lambda b, x, cfg: smooth.fold_into_v_(b, x["attention.wo"], 0.5, cfg.n_heads, cfg.n_kv_heads),
    "up rows": lambda b, x, cfg: smooth.fold_into_up_(b, x["feed_forward.down"], 0.5),
}


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("arch,overrides", ARCHS[1:3])  # with biases (qwen2), with q/k norms (qwen3)
def test_each_fold_alone_computes_the_original_function(fold, arch, overrides):
    model = outlier_model(arch, **overrides)
    ref, x = logits(model), maxima(model)
    before = weights(model)
    for i, block in enumerate(model.layers):
        FOLDS[fold](block, {name: x[f"layers.{i}.{name}"] for name in smooth.LINEARS}, model.cfg)
    assert any(not torch.allclose(a, b, rtol=0.01) for a, b in zip(before, weights(model)))
    torch.testing.assert_close(logits(model), ref, rtol=1e-4, atol=1e-4)


def test_group_max_takes_each_kv_heads_query_heads():
    # 4 query heads of 2 channels on 2 kv heads: heads 0, 1 read kv head 0, heads 2, 3 kv head 1
    per_query_channel = torch.tensor([1.0, 8, 5, 2, 3, 4, 7, 0])
    assert smooth.group_max(per_query_channel, 4, 2).tolist() == [5, 8, 7, 4]
    assert smooth.group_max(per_query_channel, 4, 1).tolist() == [7, 8]
    assert smooth.group_max(per_query_channel, 4, 4).tolist() == per_query_channel.tolist()


@pytest.mark.parametrize("arch,overrides", ARCHS[::3])  # GQA and MQA
def test_half_migration_balances_activation_and_weight_maxima(arch, overrides):
    """At alpha 0.5, max|X_j / s_j| = max|W_j s_j| = sqrt(max|X_j| max|W_j|): recalibrating the smoothed model
    finds each input channel's maximum equal to its weight column's (for wo: per kv-head group, as shared)."""
    model = outlier_model(arch, **overrides)
    smooth.smooth_(model, maxima(model))
    after = maxima(model)
    cfg = model.cfg
    for i, block in enumerate(model.layers):
        for name in smooth.LINEARS:
            x_max, w_max = after[f"layers.{i}.{name}"], smooth.column_maxima(block.get_submodule(name))
            if name == "attention.wo":
                x_max, w_max = (smooth.group_max(t, cfg.n_heads, cfg.n_kv_heads) for t in (x_max, w_max))
            torch.testing.assert_close(x_max, w_max, rtol=1e-4, atol=1e-6)


def test_smoothing_brings_w8a8_closer_to_float():
    plain, smoothed = outlier_model(seed=1), outlier_model(seed=1)
    ref = logits(plain)
    smooth.smooth_(smoothed, maxima(smoothed))
    errors = []
    for model in (plain, smoothed):
        model.quantize("int8")
        errors.append((logits(model, "w8a8") - ref).abs().mean().item())
    assert errors[1] < errors[0] / 2, errors


def test_bad_alpha_and_quantized_weights_are_refused():
    model = outlier_model()
    x = maxima(model)
    with pytest.raises(SelfspecError, match=r"alpha must lie in \[0, 1\]"):
        smooth.smooth_(model, x, alpha=1.5)
    model.quantize("int8")
    with pytest.raises(SelfspecError, match="smooth the model before quantizing"):
        smooth.smooth_(model, x)


def test_quasar_recipe_is_smoothed_w8a8_with_lookup_drafts():
    r = resolve_recipe("quasar")
    assert (r.storage, r.verify, r.draft, r.smooth_alpha) == ("int8", "w8a8", "ngram", smooth.DEFAULT_ALPHA)
    assert resolve_recipe("quasar", verify="w8a16").smooth_alpha == smooth.DEFAULT_ALPHA  # the weights stay smoothed


def test_eval_checks_quasar_against_its_own_smoothed_weights():
    """Plain w8a8 stores other weights: quasar's reference is the recipe itself at gamma 0."""
    from selfspec.eval.runner import plan_configs

    configs = {c.label: c for c in plan_configs(["w8a8"], ["quasar"])}
    assert configs["quasar"].reference == "quasar-ar"
    assert configs["quasar-ar"].storage == configs["quasar"].storage == "int8+smoothquant(alpha 0.5)"
    assert configs["w8a8"].storage == "int8"
