"""The serving engine over a paged quantized KV cache (cache/paged_quant.py), on a tiny random model with KV groups of
G = 16 tokens, so that each sequence's buffer rolls over several times: batched greedy == solo greedy (LLM.generate
of the same recipe) as requests of different lengths join at different times, speculative == AR of the verify
configuration, preemption and aborts, block accounting back to empty, quantization that keeps going past 4G."""
from dataclasses import replace

import pytest
import torch

from conftest import check_mixed_batch_equals_solo, tiny_model
from selfspec.cache.paged_quant import PagedQuantKVCache
from selfspec.cache.quant_kv import QuantKVCache
from selfspec.engine.engine import Engine
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.kernels import reference_op
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

G = 16


def make_llm(recipe: str = "selfspec", kv: str = "hier"):
    cfg, sd, _ = tiny_model("llama", seed=1, max_position_embeddings=512)
    return build(cfg, sd, None, replace(resolve_recipe(recipe), kv=kv, kv_group=G), group_size=32)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def serve(engine: Engine, requests: list[tuple[list[int], SamplingParams, int | None]],
          arrivals: list[int]) -> dict[str, list[int]]:
    """Request i joins at step arrivals[i]; step until idle -> each request's tokens."""
    tokens, step = {}, 0
    while step <= max(arrivals) or engine.has_work():
        for i, (p, params, gamma) in enumerate(requests):
            if arrivals[i] == step:
                engine.add_request(str(i), p, params, gamma=gamma)
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return tokens


def assert_idle(engine: Engine):
    s = engine.stats()
    assert (s.waiting, s.running, s.kv_blocks_used) == (0, 0, 0)
    assert len(engine.cache.free_rows) == engine.max_batch  # every buffer row back


def test_paged_quantized_attention_matches_the_contiguous_cache():
    """Two sequences at different lengths in a shared pool of scattered blocks read the same as each alone in a
    contiguous cache, for every query of a verify pass past group boundaries (reference attention)."""
    hkv, d, lengths = 2, 8, [5 * G + 3, 2 * G + 9]
    paged = PagedQuantKVCache(1, 16, hkv, 2 * G, d, torch.float32, "cpu", "hier", G, max_seqs=3)
    paged.allocate("pad")  # blocks taken by another sequence: the two rows' blocks are not in order
    gen = torch.Generator().manual_seed(0)
    solo = []
    for i, n in enumerate(lengths):
        paged.allocate(str(i))
        solo.append(QuantKVCache(1, 1, hkv, 8 * G, d, torch.float32, "cpu", "hier", G))
        for first in range(0, n + G, G):  # a group a pass (+ scratch past the length), committed as the engine does
            pos = torch.arange(first, first + G)[None]
            paged.extend("pad", G)
            paged.extend(str(i), G)
            kv = 2 * torch.randn(G, hkv, d, generator=gen)
            for cache in (paged.view([str(i)]), solo[i]):
                slots, layer = cache.slots(pos), cache.layer(0)
                for pool in (layer.k, layer.v):
                    pool[slots // pool.shape[2], :, slots % pool.shape[2]] = kv[None]
            paged.truncate(str(i), min(first + G, n))
            solo[i].commit(min(first + G, n))
        paged.truncate("pad", 0)
    assert [paged.quantized[str(i)] for i in range(2)] == [n // G * G for n in lengths]
    q = torch.randn(2, 4, 5, d, generator=gen)
    q_pos = torch.tensor(lengths)[:, None] + torch.arange(5)
    for upper in (False, True):
        out = reference_op("quantized_attention")(q, paged.view(["0", "1"]).layer(0), q_pos, upper)
        for i in range(2):
            alone = reference_op("quantized_attention")(q[i:i + 1], solo[i].layer(0), q_pos[i:i + 1], upper)
            assert torch.equal(out[i:i + 1], alone)


def test_batched_greedy_equals_solo_as_requests_join(llm):
    """Prompts of 3 to 2G + 8 tokens joining at different steps, generating 3G-4G tokens each (buffers roll over
    several times per row), drafting per request or by the policy: each request's tokens are its solo greedy AR
    run's, and the pool is empty at the end."""
    ps = prompts([3, 2 * G + 8, G + 1, 9, G, 2 * G - 1])
    lengths = [3 * G, 4 * G, 3 * G + 5, 3 * G, 4 * G - 3, 3 * G]
    gammas = [None, 3, 0, 5, 2, None]
    refs = [llm.generate(p, greedy(n), gamma=0).token_ids for p, n in zip(ps, lengths)]
    engine = Engine(llm, max_batch=4, block_size=G, num_blocks=80, prefill_chunk=24, max_gamma=5)
    tokens = serve(engine, [(p, greedy(n), g) for p, n, g in zip(ps, lengths, gammas)], [0, 0, 2, 5, 9, 14])
    assert [tokens[str(i)] for i in range(len(ps))] == refs
    s = engine.stats()
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # speculative rows accepted and rejected drafts
    assert_idle(engine)


def test_engine_batched_equals_engine_solo_and_solo_speculative(llm):
    """The same requests through an engine of one row at a time and of four, and solo speculative decoding."""
    ps = prompts([7, 2 * G + 3, G + 5], seed=1)
    params = greedy(3 * G)
    requests = [(p, params, 4) for p in ps]
    batched = serve(Engine(llm, max_batch=4, block_size=2 * G, num_blocks=40, max_gamma=4), requests, [0, 1, 3])
    one = serve(Engine(llm, max_batch=1, block_size=G, num_blocks=40, max_gamma=4), requests, [0, 0, 0])
    assert batched == one
    assert [batched[str(i)] for i in range(3)] == [llm.generate(p, params, gamma=4).token_ids for p in ps]


def test_preemption_and_aborts_keep_outputs_and_free_everything(llm):
    """A pool too small for every sequence at once: the newest are preempted (blocks and buffer freed, recomputed
    on resume) and still give their solo tokens; aborted requests free theirs."""
    ps = prompts([2 * G + 2, G + 3, 5, 20], seed=2)
    params = greedy(3 * G)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in ps]
    engine = Engine(llm, max_batch=4, block_size=G, num_blocks=12, prefill_chunk=G, max_gamma=3)
    tokens = serve(engine, [(p, params, None) for p in ps], [0, 0, 1, 1])
    assert [tokens[str(i)] for i in range(4)] == refs
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)
    for i, p in enumerate(ps):
        engine.add_request(f"a{i}", p, params, gamma=2)
    for _ in range(6):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    for i in range(4):
        engine.abort(f"a{i}")
    engine.step()
    assert_idle(engine)


def test_greedy_and_sampling_rows_mixed_equal_solo(llm):
    """conftest's mixed batch (per-request gammas, the policy's, seeded sampling rows beside greedy ones)."""
    s = check_mixed_batch_equals_solo(llm, prompts([2 * G + 5, G - 1], seed=4))
    assert s.kv_blocks_used == 0 and s.num_draft_tokens > 0


def test_a_long_generation_keeps_quantizing(llm):
    """One request generating 6G tokens: its quantized positions keep growing a group at a time, its buffer keeps
    between G and 2G committed tokens, and its blocks cover exactly its quantized groups."""
    engine = Engine(llm, max_batch=2, block_size=G, num_blocks=20, max_gamma=3)
    p = prompts([G + 4])[0]
    engine.add_request("0", p, greedy(6 * G), gamma=3)
    seen, cache = [], engine.cache
    while engine.has_work():
        engine.step()
        if "0" in cache.lengths:
            n = cache.lengths["0"]
            seen.append(cache.quantized["0"])
            assert cache.quantized["0"] == n // G * G
            assert G <= n - cache.starts["0"] < 2 * G
            assert len(cache.tables["0"]) == n // G
    assert seen == sorted(seen) and seen[-1] >= len(p) + 5 * G - G
    assert len(set(seen)) >= 6


def test_int8_kv_and_quantspec_serve_their_solo_output():
    for recipe, kv in (("planes", "int8"), ("quantspec", "hier")):
        llm = make_llm(recipe, kv)
        ps = prompts([G + 7, 4], seed=3)
        refs = [llm.generate(p, greedy(2 * G + 4), gamma=0).token_ids for p in ps]
        engine = Engine(llm, max_batch=2, block_size=G, num_blocks=20, max_gamma=3)
        tokens = serve(engine, [(p, greedy(2 * G + 4), 3) for p in ps], [0, 2])
        assert [tokens[str(i)] for i in range(2)] == refs, recipe
        assert_idle(engine)


def test_a_verify_pass_longer_than_a_group_is_refused(llm):
    with pytest.raises(SelfspecError, match="--kv-group"):
        Engine(llm, max_gamma=G)


def test_graph_batch_view_pads_with_the_trash_row(llm):
    """The static batch view a decode graph replays (engine/graphs.py, a bucket of 4 rows for 3): padding rows read
    and write only the trash buffer row and trash blocks, so the real rows get the logits of their own view and their
    buffers stay as that pass left them."""
    from selfspec.engine.graphs import PagedGraphedModel

    engine = Engine(llm, max_batch=4, block_size=G, max_gamma=0)
    for i, p in enumerate(prompts([20, 37, 9])):
        engine.add_request(str(i), p, greedy(40))
    for _ in range(6):
        engine.step()
    seqs = list(engine.running)
    assert len(seqs) == 3 and all(s.row is not None for s in seqs)
    for s in seqs:
        engine.cache.extend(s.id, 1)
    view = engine.cache.view([s.id for s in seqs])
    static, size = PagedGraphedModel(llm.model, engine.cache, engine.max_len)._static(view, 3)
    assert size == 4 and int(static.rows[3]) == 0 and int(static.starts[3]) == 0 and not static.table[3].any()
    assert torch.equal(static.rows[:3], view.rows) and torch.equal(static.starts[:3], view.starts)
    tokens = torch.tensor([[s.row.pending] for s in seqs])
    pos = torch.tensor([[s.row.length] for s in seqs])
    mode = llm.verify_mode
    with torch.inference_mode():
        alone = llm.model(tokens, pos, view, mode)
        k, v = engine.cache.k[:, 1:].clone(), engine.cache.v[:, 1:].clone()
        padded = llm.model(torch.cat([tokens, torch.tensor([[0]])]), torch.cat([pos, torch.tensor([[0]])]), static,
                           mode)
    assert torch.equal(padded[:3], alone)
    assert torch.equal(engine.cache.k[:, 1:], k) and torch.equal(engine.cache.v[:, 1:], v)
