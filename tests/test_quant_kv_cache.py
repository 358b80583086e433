"""The quantized KV cache: the double full-precision buffer, quantization far past 2G tokens, greedy speculative
== greedy AR of the verify configuration (weights mode + INT8 KV), and its memory."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import tiny_model
from selfspec.cache import KVCache
from selfspec.cache.quant_kv import QuantKVCache
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.model import prefill
from selfspec.quant.kv import dequantize_hier, quantize_hier
from selfspec.quant.modes import MODES
from selfspec.speculative.decode import decode
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

G = 16


def make_llm(kv: str = "hier", recipe: str = "selfspec"):
    cfg, sd, _ = tiny_model("llama", seed=1, max_position_embeddings=512)
    return build(cfg, sd, None, replace(resolve_recipe(recipe), kv=kv, kv_group=G), group_size=32)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n", [5, G, 2 * G - 1, 2 * G, 45])
def test_prefill_leaves_g_to_2g_full_precision(n):
    llm = make_llm()
    cache = llm.model.new_cache(100)
    prefill(llm.model, prompt(n), cache, llm.verify_mode)
    full = n - cache.start  # committed tokens the next query reads at full precision
    assert (G <= full < 2 * G) if n >= G else full == n
    assert cache.quantized == n // G * G  # every completed group is quantized


def test_groups_hold_the_quantized_keys_of_a_plain_cache():
    """Layer 0's k/v depend on the tokens alone: its groups must be the quantization of a bf16 cache's."""
    llm = make_llm()
    m, toks = llm.model, prompt(50)
    plain = KVCache(m.cfg.n_layers, 1, m.cfg.n_kv_heads, 64, m.cfg.head_dim, m.dtype)
    m(torch.tensor([toks]), torch.arange(50), plain, llm.verify_mode)
    cache = m.new_cache(64)
    prefill(m, toks, cache, llm.verify_mode)
    for g in range(50 // G):
        k = plain.k[0, :, :, g * G:(g + 1) * G]
        upper, lower, scale, zero = quantize_hier(k, -2)
        ours = cache.layer(0).quant.dequantize((g + 1) * G, upper=False)[0][:, :, g * G:]
        assert torch.equal(ours, dequantize_hier(upper, lower, scale, zero))


@pytest.fixture(scope="module")
def hier_llm():
    return make_llm()


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_ar_far_past_2g(hier_llm, gamma):
    """A prompt longer than 2G and a generation of 6G more tokens: groups keep being quantized and the draft
    (upper planes of weights and KV) never changes the verify configuration's output."""
    llm = hier_llm
    p = prompt(2 * G + 7, seed=gamma)
    params = SamplingParams(max_new_tokens=6 * G, ignore_eos=True)
    ref = llm.generate(p, params, gamma=0).token_ids
    out = llm.generate(p, params, gamma=gamma)
    assert out.token_ids == ref
    assert 0 < out.stats.draft_accepted < out.stats.draft_proposed


def test_generation_keeps_quantizing(hier_llm):
    llm, p = hier_llm, prompt(2 * G + 3)
    cache = llm.model.new_cache(len(p) + 8 * G + 8)
    n = len(p)
    for chunk in decode(llm.model, p, llm.verify_mode, llm.draft_mode, 4, SamplingParams(max_new_tokens=8 * G),
                        GenerationStats(), cache):
        n += len(chunk)
        if n >= len(p) + 8 * G:
            break
    assert cache.quantized == cache.length // G * G >= len(p) + 7 * G - G
    assert G <= cache.length - cache.start < 2 * G


def test_draft_reads_the_upper_plane(hier_llm):
    """The draft's KV view differs from verify's (else the test above proves less), the INT8 one is close to a
    bf16 cache's, and the upper one further."""
    llm = hier_llm
    m, toks = llm.model, prompt(3 * G)
    seq = torch.tensor([toks])
    plain = KVCache(m.cfg.n_layers, 1, m.cfg.n_kv_heads, 3 * G, m.cfg.head_dim, m.dtype)
    exact = m(seq, torch.arange(3 * G), plain, llm.verify_mode)[0]
    logits = {}
    for name, mode in (("full", llm.verify_mode), ("upper", replace(llm.verify_mode, kv_upper=True))):
        logits[name] = prefill(m, toks, m.new_cache(3 * G), mode, all_logits=True)
    err_full, err_upper = ((logits[k] - exact).abs().max() for k in ("full", "upper"))
    assert 0 < err_full < err_upper
    assert torch.equal(logits["full"][:2 * G], exact[:2 * G])  # no query before 2G reads a quantized key


def test_int8_cache_equals_ar():
    llm = make_llm("int8")
    p, params = prompt(40, 3), SamplingParams(max_new_tokens=3 * G, ignore_eos=True)
    assert llm.generate(p, params, gamma=3).token_ids == llm.generate(p, params, gamma=0).token_ids


def test_kv_memory_vs_bf16():
    """At a long context the quantized cache takes about half of bf16 (plus scales and the 3G-token buffer)."""
    args = (30, 1, 3, 8192, 64)  # SmolLM2-135M's layers, KV heads and head dim
    bf16 = KVCache(*args, torch.bfloat16).nbytes()
    for fmt in ("int8", "hier"):
        q = QuantKVCache(*args, torch.bfloat16, "cpu", fmt, 128).nbytes()
        assert 0.5 < q / bf16 < 0.58, (fmt, q / bf16)


def test_a_pass_too_long_for_the_buffer_is_refused(hier_llm):
    cache = hier_llm.model.new_cache(100)
    with pytest.raises(SelfspecError, match="gamma"):
        hier_llm.model(torch.tensor([prompt(3 * G + 1)]), torch.arange(3 * G + 1), cache, MODES["full"])


def test_quantspec_greedy_equals_ar_of_dense_weights_and_int8_kv():
    llm = make_llm("hier", "quantspec")  # dense verify weights, their INT4 copy drafts, over hier KV
    assert llm.recipe.storage == "dense+int4" and llm.draft_mode.kv_upper
    p, params = prompt(2 * G + 5, 4), SamplingParams(max_new_tokens=4 * G, ignore_eos=True)
    out = llm.generate(p, params, gamma=4)
    assert out.token_ids == llm.generate(p, params, gamma=0).token_ids
    assert 0 < out.stats.draft_accepted < out.stats.draft_proposed


@pytest.mark.parametrize("recipe", ["selfspec", "quantspec"])
def test_smollm2_greedy_speculative_equals_ar(smollm2_resolved, recipe):
    """Real SmolLM2 (CPU), a prompt longer than 2G, a few tokens past a group boundary."""
    cfg, sd, tok, desc = smollm2_resolved
    llm = build(cfg, {k: t.clone() for k, t in sd.items()}, tok, replace(resolve_recipe(recipe), kv_group=G))
    p = tok.encode("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
                   "combined movable metal type, oil-based ink and a wooden press. Within decades, printing")
    assert len(p) > 2 * G
    params = SamplingParams(max_new_tokens=G + 4, ignore_eos=True)
    out = llm.generate(p, params, gamma=3)
    assert out.token_ids == llm.generate(p, params, gamma=0).token_ids
    assert out.stats.draft_accepted > 0
