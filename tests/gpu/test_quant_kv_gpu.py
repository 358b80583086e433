"""The quantized KV cache on the GPU: the Triton attention against the torch reference (contiguous and paged), greedy
speculative == greedy AR of the verify configuration (weights mode + INT8 KV) on real SmolLM2 with a prompt longer
than 2G, and the serving engine over the paged cache == solo decoding."""
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import gpu_test_model  # noqa: E402
from selfspec.cache.paged_quant import PagedQuantKVCache  # noqa: E402
from selfspec.cache.quant_kv import QuantKVCache  # noqa: E402
from selfspec.engine.engine import Engine  # noqa: E402
from selfspec.engine.llm import build  # noqa: E402
from selfspec.kernels import reference_op  # noqa: E402
from selfspec.kernels import triton_quant_attention  # noqa: E402
from selfspec.loading import resolve  # noqa: E402
from selfspec.speculative.recipes import resolve_recipe  # noqa: E402
from selfspec.speculative.sampling import SamplingParams  # noqa: E402

G = 64


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_quantized_attention_matches_reference(fmt, upper):
    cache = QuantKVCache(1, 2, 3, 16 * G, 64, torch.bfloat16, "cuda", fmt, G)
    gen = torch.Generator(device="cuda").manual_seed(0)
    length = 10 * G + 5
    for first in range(0, length + G, G):
        pos = torch.arange(first, first + G, device="cuda").expand(2, G)
        slots, kv = cache.slots(pos), cache.layer(0)
        for pool in (kv.k, kv.v):
            pool[slots // cache.block_size, :, slots % cache.block_size] = (
                2 * torch.randn(2, G, 3, 64, device="cuda", generator=gen)).bfloat16()
        cache.commit(min(first + G, length))
    kv = cache.layer(0)
    q = torch.randn(2, 9, 5, 64, device="cuda", generator=gen).bfloat16()
    q_pos = length + torch.tensor([[0, 1, 2, 3, 4], [0, 2, 4, 6, 8]], device="cuda")
    ref = reference_op("quantized_attention")(q.float(), kv, q_pos, upper)
    out = triton_quant_attention.quantized_attention(q, kv, q_pos, upper)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    alone = triton_quant_attention.quantized_attention(q[:1, :, 3:4], kv, q_pos[:1, 3:4], upper)
    assert torch.equal(alone, out[:1, :, 3:4])


@pytest.mark.parametrize("recipe", ["selfspec", "quantspec"])
def test_greedy_speculative_equals_ar_with_quantized_kv(recipe):
    cfg, sd, tok, desc = resolve(gpu_test_model())  # SmolLM2, embedded or its .gguf
    llm = build(cfg, sd, tok, replace(resolve_recipe(recipe), verify="bf16" if recipe == "quantspec" else "full",
                                      kv_group=G), device="cuda")
    ids = tok.encode(" ".join(["The printing press spread across Europe within decades of its invention."] * 12))
    assert len(ids) > 2 * G
    params = SamplingParams(max_new_tokens=2 * G, ignore_eos=True)
    ar = llm.generate(ids, params, gamma=0).token_ids
    for gamma in (2, 5):
        out = llm.generate(ids, params, gamma=gamma)
        assert out.token_ids == ar, gamma
        assert out.stats.draft_accepted > 0


@pytest.mark.parametrize("fmt,upper", [("int8", False), ("hier", False), ("hier", True)])
def test_quantized_attention_over_paged_blocks_matches_reference(fmt, upper):
    """Two sequences at different lengths whose blocks interleave in the pool (the serving engine's cache)."""
    cache = PagedQuantKVCache(1, 32, 3, 2 * G, 64, torch.bfloat16, "cuda", fmt, G, max_seqs=2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [7 * G + 5, 3 * G + 40]
    for s in "01":
        cache.allocate(s)
    for first in range(0, max(lengths) + G, G):  # the two sequences take their blocks in turn
        for s, n in zip("01", lengths):
            if first < n + G:
                cache.extend(s, G)
                view = cache.view([s])
                slots, kv = view.slots(torch.arange(first, first + G, device="cuda")[None]), view.layer(0)
                for pool in (kv.k, kv.v):
                    pool[slots // pool.shape[2], :, slots % pool.shape[2]] = (
                        2 * torch.randn(1, G, 3, 64, device="cuda", generator=gen)).bfloat16()
                cache.truncate(s, min(first + G, n))
    kv = cache.view(["0", "1"]).layer(0)
    q = torch.randn(2, 9, 5, 64, device="cuda", generator=gen).bfloat16()
    q_pos = torch.tensor(lengths, device="cuda")[:, None] + torch.tensor([[0, 1, 2, 3, 4], [0, 2, 4, 6, 8]],
                                                                         device="cuda")
    ref = reference_op("quantized_attention")(q.float(), kv, q_pos, upper)
    out = triton_quant_attention.quantized_attention(q, kv, q_pos, upper)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    alone = triton_quant_attention.quantized_attention(q[1:, :, 3:4], cache.view(["1"]).layer(0), q_pos[1:, 3:4],
                                                       upper)
    assert torch.equal(alone, out[1:, :, 3:4])


def test_engine_serves_recipe_selfspec_as_solo():
    """The serving engine over the paged quantized cache (eager on the GPU): requests of different lengths, joining
    at different steps, give their solo greedy tokens (SmolLM2, G = 64, generations past several groups)."""
    cfg, sd, tok, desc = resolve(gpu_test_model())
    llm = build(cfg, sd, tok, replace(resolve_recipe("selfspec"), kv_group=G), device="cuda")
    base = "The printing press spread across Europe within decades of its invention."
    prompts = [tok.encode(" ".join([base] * n)) for n in (1, 9, 4)]
    params = SamplingParams(max_new_tokens=3 * G, ignore_eos=True)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    engine = Engine(llm, max_batch=4, max_gamma=4)
    tokens, step = {}, 0
    while step < 3 or engine.has_work():
        if step < 3:
            engine.add_request(str(step), prompts[step], params, gamma=[None, 4, 2][step])
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert [tokens[str(i)] for i in range(3)] == refs
    s = engine.stats()
    assert s.kv_blocks_used == 0 and s.num_accepted_tokens > 0
