"""Prefill on tiny random models: logits only where asked (the head runs on those rows only), bitwise equal to the
full forward's at those positions; --prefill-chunk on serve, bench serve and eval; packed prefill (no padding)
== each prompt alone, and the budget counts real tokens.

Bitwise on the CPU needs every op to see the shapes it sees alone where its kernel is not batch invariant: the
linear runs row by row up to 64 rows and as one GEMM above (kernels/cpu.py), and torch's attention gives other bits
when the number of keys (a row's table width x block size) changes, or for fewer than 4 queries. Packed rows get
one attention call each, over their own table, so packed == alone holds bitwise up to 64 tokens (or with every
linear row by row); a chunk of a prompt sees fewer keys than the whole prompt, so chunked == one piece holds
bitwise within one KV block, with every linear row by row. Elsewhere they are equal within float32 rounding."""
import pytest
import torch

import selfspec
from conftest import recorded_logits, served_tokens, tiny_model
from selfspec.bench import serve as bench_serve
from selfspec.cli import main
from selfspec.engine import engine as engine_module
from selfspec.engine.engine import DEFAULT_PREFILL_CHUNK, Engine
from selfspec.cache.paged import PagedKVCache
from selfspec.eval import command as eval_command
from selfspec import kernels
from selfspec.errors import SelfspecError
from selfspec.kernels import cpu as cpu_kernels
from selfspec.kernels import reference_op
from selfspec.model import Packed
from selfspec.engine.llm import build
from selfspec.quant.modes import prompt_mode
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=2)
    return build(cfg, sd, None, resolve_recipe("planes", draft="w4a4"), group_size=32)


def record_head_inputs(model, monkeypatch) -> list[tuple[int, ...]]:
    """Shapes of the hidden states the head is run on, one per forward."""
    shapes, logits = [], model.logits

    def recording(hidden, mode):
        shapes.append(tuple(hidden.shape))
        return logits(hidden, mode)

    monkeypatch.setattr(model, "logits", recording)
    return shapes


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["verify", "draft"])
def test_logits_at_selected_positions_equal_the_full_forward(llm, mode, monkeypatch):
    model, mode = llm.model, getattr(llm, f"{mode}_mode")
    tokens = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 5, 11])[:, None] + torch.arange(7)  # each row its own positions
    full = model(tokens, pos, model.new_cache(32, batch=3), mode)
    at = torch.tensor([6, 7 + 2, 14 + 6])  # row 0's last, row 1's third, row 2's last token
    shapes = record_head_inputs(model, monkeypatch)
    cache = model.new_cache(32, batch=3)
    picked = model(tokens, pos, cache, mode, logits_at=at)
    assert shapes == [(3, model.cfg.dim)]  # the head saw 3 rows, not 3 x 7
    assert torch.equal(picked, full.reshape(-1, full.shape[-1])[at])  # 21 rows: row by row on the CPU, as full


def test_solo_prefill_runs_the_head_on_the_last_position_only(llm, monkeypatch):
    prompt = list(range(10, 40))
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    want = llm.model(torch.tensor([prompt]), torch.arange(30), llm.model.new_cache(32), llm.verify_mode)
    shapes = record_head_inputs(llm.model, monkeypatch)
    assert llm.generate(prompt, params, gamma=0).token_ids == [int(want[0, -1].argmax())]
    assert shapes == [(1, llm.model.cfg.dim)]


def test_engine_prefill_runs_the_head_on_rows_that_draw_a_token_only(llm, monkeypatch):
    """Two short prompts complete in the first chunk; the long one is prefilled in the next two chunks and
    draws its token in the last: the head sees 2 rows, then none, then 1; the tokens are the solo greedy ones."""
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5], list(range(10, 40))]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    engine = Engine(llm, max_batch=3, block_size=4, num_blocks=40, prefill_chunk=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, gamma=0)
    shapes = record_head_inputs(llm.model, monkeypatch)
    out = served_tokens(engine)
    assert shapes == [(2, llm.model.cfg.dim), (1, llm.model.cfg.dim)]
    assert out == {str(i): ref for i, ref in enumerate(refs)}


COMMANDS = {"serve": ["serve"], "bench serve": ["bench", "serve", "--no-check"], "eval": ["eval", "--tasks", "gsm8k"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("bad", ["0", "-3"])
def test_prefill_chunk_below_one_is_refused_before_loading(command, bad, monkeypatch, capsys):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: pytest.fail("loaded a model before checking"))
    assert main([*COMMANDS[command], "--prefill-chunk", bad]) == 2
    assert "--prefill-chunk must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_prefill_chunk_is_documented(command, capsys):
    with pytest.raises(SystemExit):
        main([*COMMANDS[command], "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--prefill-chunk N" in text and f"(default: {DEFAULT_PREFILL_CHUNK})" in text


class Built(Exception):
    """Raised by a stand-in Engine once it has seen its arguments."""


@pytest.mark.parametrize("command", ["serve", "bench serve"])
def test_prefill_chunk_reaches_the_engine(command, monkeypatch):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: (*tiny_model("llama", seed=4)[:2], None, "tiny"))
    seen = {}

    def engine(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(engine_module, "Engine", engine)
    monkeypatch.setattr(bench_serve, "Engine", engine)
    monkeypatch.setattr(bench_serve, "prompt_pool", lambda *a: [[5, 6, 7]])
    with pytest.raises(Built):
        main([*COMMANDS[command], "--group-size", "32", "--prefill-chunk", "48"])
    assert seen["prefill_chunk"] == 48


def test_eval_passes_prefill_chunk_on(monkeypatch):
    seen = {}

    def run_eval(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(eval_command, "run_eval", run_eval)
    with pytest.raises(Built):
        main(["eval", "--tasks", "gsm8k", "--prefill-chunk", "48"])
    assert seen["prefill_chunk"] == 48


def test_packed_layout():
    packed = Packed.of([3, 1, 2], [3, 8, 2])
    assert packed.index.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]  # padding repeats the row's last token
    x = torch.arange(6)[None] * 10
    assert torch.equal(packed.unpad(packed.pad(x)), x)


@torch.inference_mode()
def test_packed_attention_padded_equals_row_by_row():
    """The default packed attention (rows padded to [B, T], what the GPU runs) against the CPU's one call per row."""
    g = torch.Generator().manual_seed(4)
    pools = [torch.randn(12, 2, 4, 16, generator=g) for _ in "kv"]
    table = torch.tensor([[3, 1, 0], [2, 0, 0], [4, 5, 6]])  # rows of 9, 3 and 12 keys, blocks of 4
    lengths, keys = [5, 3, 7], [9, 3, 12]
    pos = torch.tensor([[t for n, k in zip(lengths, keys) for t in range(k - n, k)]])
    q = torch.randn(1, 4, sum(lengths), 16, generator=g)
    packed = Packed.of(lengths, keys)
    padded = reference_op("packed_attention")(q, *pools, table, pos, packed)
    torch.testing.assert_close(padded, cpu_kernels.packed_attention(q, *pools, table, pos, packed))


@torch.inference_mode()
@pytest.mark.parametrize("lengths", [[5, 17, 30], [16, 48]])  # padded to 64 tokens in 4 rows; fills 64 in 2 rows
def test_prompt_graph_inputs_give_the_packed_pass_bits(llm, lengths, monkeypatch):
    """A prompt graph's static inputs (engine/graphs.py: tokens and rows padded to their buckets, padding rows and
    tokens on the trash block), run eagerly with the GPU's packed attention (pad, attention, unpad): the same KV
    outside the trash block and the same logits as the packed pass itself."""
    from selfspec.engine.graphs import _PromptGraph, bucket, prompt_bucket

    monkeypatch.setitem(kernels._TABLE, ("packed_attention", "", "cpu"), reference_op("packed_attention"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    model, cfg = llm.model, llm.model.cfg
    caches = [PagedKVCache(cfg.n_layers, 32, cfg.n_kv_heads, 4, cfg.head_dim, model.dtype) for _ in "ab"]
    for c in caches:
        for i, p in enumerate(prompts):
            c.allocate(str(i), len(p))
    ids = [str(i) for i in range(len(prompts))]
    tokens = torch.tensor([sum(prompts, [])])
    pos = torch.tensor([[t for n in lengths for t in range(n)]])
    last = torch.tensor(lengths).cumsum(0) - 1
    packed = Packed.of(lengths, lengths)
    mode = prompt_mode(llm.verify_mode)
    eager = model(tokens, pos, caches[0].view(ids), mode, logits_at=last, packed=packed)
    n = sum(lengths)
    shape = (64, len(lengths) if n == 64 else bucket(len(lengths) + 1), prompt_bucket(max(lengths)))
    graph = _PromptGraph(model, caches[1], mode, shape, caches[1].blocks_for(64))
    graph.fill(tokens, pos, caches[1].view(ids).table, last, packed)
    assert torch.equal(graph.run()[:len(lengths)], eager)
    assert torch.equal(caches[1].k[:, 1:], caches[0].k[:, 1:]) and torch.equal(caches[1].v[:, 1:], caches[0].v[:, 1:])


def test_packed_layout_padded_to_a_graph_shape():
    packed = Packed.of([3, 1], [3, 8], shape=(6, 4, 4))
    assert packed.index.tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4], [4, 4, 4, 4]]
    assert packed.where.tolist() == [0, 1, 2, 4, 12, 12]  # padding tokens: the last row's first entry
    with pytest.raises(SelfspecError, match="padding rows need padding tokens"):
        Packed.of([3, 1], [3, 8], shape=(4, 4, 4))


def prefill_alone_and_packed(llm, prompts, block_size):
    """Each prompt prefilled alone, then all packed in one pass, each into its own fresh cache: (caches,
    last-position logits [B, vocab]) of both."""
    model, cfg = llm.model, llm.model.cfg
    caches = [PagedKVCache(cfg.n_layers, 64, cfg.n_kv_heads, block_size, cfg.head_dim, model.dtype) for _ in "ab"]
    for c in caches:
        for i, p in enumerate(prompts):
            c.allocate(str(i), len(p))
    alone = torch.cat([model(torch.tensor([p]), torch.arange(len(p)), caches[0].view([str(i)]), llm.verify_mode,
                             logits_at=torch.tensor([len(p) - 1])) for i, p in enumerate(prompts)])
    lengths = [len(p) for p in prompts]
    pos = torch.tensor([[t for n in lengths for t in range(n)]])
    last = torch.tensor(lengths).cumsum(0) - 1
    packed = model(torch.tensor([sum(prompts, [])]), pos, caches[1].view([str(i) for i in range(len(prompts))]),
                   llm.verify_mode, logits_at=last, packed=Packed.of(lengths, lengths))
    return caches, alone, packed


@torch.inference_mode()
@pytest.mark.parametrize("block_size", [4, 64])
def test_packed_prefill_equals_each_prompt_alone_bitwise(llm, block_size):
    """52 tokens (row by row in every linear), tables of 1 to 8 blocks: the KV pools (the trash block too:
    nothing is written for padding) and the last positions' logits are the same bits."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 30)]
    (a, b), alone, packed = prefill_alone_and_packed(llm, prompts, block_size)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert torch.equal(alone, packed)


@torch.inference_mode()
def test_packed_prefill_equals_each_prompt_alone_past_64_tokens(llm, monkeypatch):
    """151 tokens: with the CPU kernels as they are (one GEMM per linear above 64 rows) equal within float32
    rounding; with every linear row by row, the same bits."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 104, 44)]
    (a, b), alone, packed = prefill_alone_and_packed(llm, prompts, block_size=4)
    torch.testing.assert_close(b.k, a.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.v, a.v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert alone.abs().max() > 1  # logits of a real forward, not an empty comparison
    monkeypatch.setattr(cpu_kernels, "ROW_BY_ROW_MAX", 1024)
    (a, b), alone, packed = prefill_alone_and_packed(llm, prompts, block_size=4)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(alone, packed)


def test_prefill_budget_counts_real_tokens(llm, monkeypatch):
    """Budget 32 with prompts of 5, 7 and 100 tokens: the first pass packs 5 + 7 + 20 real tokens (padded to the
    longest it would have been 3 x 20 = 60), then 32 at a time; no pass exceeds the budget and all are exact."""
    passes, forward = [], llm.model.forward

    def recording(tokens, pos, cache, mode, logits_at=None, packed=None):
        if packed is not None:
            passes.append((tuple(tokens.shape), packed.index.shape[0]))
        return forward(tokens, pos, cache, mode, logits_at, packed)

    monkeypatch.setattr(llm.model, "forward", recording)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 27)), list(range(30, 130))]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine = Engine(llm, max_batch=3, block_size=4, num_blocks=60, prefill_chunk=32)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, gamma=0)
    out = served_tokens(engine)
    assert passes == [((1, 32), 3), ((1, 32), 1), ((1, 32), 1), ((1, 16), 1)]
    monkeypatch.undo()
    assert out == {str(i): llm.generate(p, params, gamma=0).token_ids for i, p in enumerate(prompts)}


def prefill_through_engine(llm, prompt, chunk, block_size):
    """Serve one request of one new token with prefill chunks of `chunk` tokens: (the KV pools after, the
    logits its token was drawn from)."""
    with recorded_logits(llm.model) as heads:
        engine = Engine(llm, max_batch=1, block_size=block_size, num_blocks=1024 // block_size, prefill_chunk=chunk)
        engine.add_request("0", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), gamma=0)
        served_tokens(engine)
    (head,) = heads
    return engine.cache, head


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_equals_one_piece_bitwise(llm, chunk, monkeypatch):
    """150 prompt tokens in chunks of 16 (the last of 6) or 64, against one piece: the same KV and logits bits.
    The linear runs row by row at every size here (the CPU's one GEMM above 64 rows is not batch invariant), and
    a block of 256 keeps the keys attention sees at 256 for every chunk."""
    monkeypatch.setattr(cpu_kernels, "ROW_BY_ROW_MAX", 1024)
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    whole, whole_logits = prefill_through_engine(llm, prompt, 256, block_size=256)
    chunked, chunked_logits = prefill_through_engine(llm, prompt, chunk, block_size=256)
    assert whole.k.abs().sum() > 0
    assert torch.equal(whole.k, chunked.k) and torch.equal(whole.v, chunked.v)
    assert torch.equal(whole_logits, chunked_logits)


def test_chunked_prefill_equals_one_piece_with_the_cpu_kernels_as_they_are(llm):
    """The same with blocks of 16 and the 150-row GEMM: equal within float32 rounding."""
    prompt = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    whole, whole_logits = prefill_through_engine(llm, prompt, 256, block_size=16)
    for chunk in (16, 64):
        chunked, chunked_logits = prefill_through_engine(llm, prompt, chunk, block_size=16)
        torch.testing.assert_close(chunked.k, whole.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked.v, whole.v, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked_logits, whole_logits, rtol=1e-5, atol=1e-5)
