"""Chunked and packed prefill on the GPU, through the engine, on SmolLM2 (or SELFSPEC_GPU_MODEL: its .gguf path or
HF directory): a prompt prefilled in chunks of 16, 128 or 512 tokens leaves the same KV cache bits and draws its
first token from the same logits bits as in one piece; prompts packed into one prefill pass give the bits each
gives alone; prompt passes replayed from CUDA graphs give the bits of the same passes run eagerly. The Triton
linear and attention are meant to be batch invariant (a row's reductions do not depend on the other rows, nor on
the keys past its position), so these should hold bitwise at any size."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import gpu_test_model, served_tokens  # noqa: E402
import selfspec  # noqa: E402
from selfspec.bench.prompts import PROMPTS  # noqa: E402
from selfspec.engine.engine import Engine  # noqa: E402
from selfspec.speculative.sampling import SamplingParams  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module", params=["planes", "qspec"])
def llm(request):
    return selfspec.load(gpu_test_model(), request.param, device="cuda")


class PrefillLogits:
    """The engine's runner, keeping a copy of the logits rows every prefill pass returns (a CUDA graph's replay
    runs no Python, so the head's own output cannot be hooked)."""

    def __init__(self, runner) -> None:
        self.runner, self.rows = runner, []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        out = self.runner(*args, **kwargs)
        if kwargs.get("packed") is not None:
            self.rows.append(out.clone())
        return out


def serve_first_tokens(llm, prompts: list[list[int]], chunk: int, engine: Engine | None = None,
                       eager: bool = False) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Serve each prompt one new token, all submitted at once (on `engine`, else a fresh one; `eager`: without
    graphs): (the KV pools after, the logits rows the first tokens were drawn from, in request order, each
    request's tokens)."""
    if engine is None:
        total = sum(-(-len(p) // BLOCK) for p in prompts)
        engine = Engine(llm, max_batch=len(prompts), block_size=BLOCK, num_blocks=total + len(prompts),
                        prefill_chunk=chunk)
    runner = engine.runner
    engine.runner = PrefillLogits(llm.model if eager else runner)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_new_tokens=1, ignore_eos=True), gamma=0)
        tokens = served_tokens(engine)
        return engine.cache, torch.cat(engine.runner.rows), [tokens[str(i)] for i in range(len(prompts))]
    finally:
        engine.runner = runner


def long_prompt(llm, n: int) -> list[int]:
    ids = []
    for p in PROMPTS * 8:
        ids += llm.encode(p, chat=True)
    return ids[:n]


@pytest.mark.parametrize("chunk", [16, 128, 512])
def test_chunked_prefill_equals_one_piece(llm, chunk):
    prompt = long_prompt(llm, 1500)
    whole, whole_logits, whole_tokens = serve_first_tokens(llm, [prompt], 2048)
    cache, head, tokens = serve_first_tokens(llm, [prompt], chunk)
    assert torch.equal(cache.k, whole.k) and torch.equal(cache.v, whole.v)
    assert torch.equal(head, whole_logits) and tokens == whole_tokens


def test_packed_prefill_equals_each_prompt_alone(llm):
    """Prompts of 1 to 700 tokens packed into passes of 512 (long ones cut across passes) against each alone: the
    logits of each first token (whose every layer read the prompt's KV) are the same bits."""
    prompts = [long_prompt(llm, n) for n in (700, 1, 37, 300, 129)]
    alone = [serve_first_tokens(llm, [p], 2048) for p in prompts]
    _, head, tokens = serve_first_tokens(llm, prompts, 512)
    assert torch.equal(head, torch.cat([a[1] for a in alone]))  # first tokens, drawn in request order
    assert tokens == [a[2][0] for a in alone]


def test_prompt_graphs_give_the_eager_bits(llm):
    """Prompt passes replayed from CUDA graphs (tokens and rows padded to their buckets, the padding on the trash
    block) leave the KV cache and give the logits of the same passes run eagerly; a second serve replays them."""
    prompts = [long_prompt(llm, n) for n in (700, 1, 37, 300, 129)]
    eager_kv, eager_head, eager_tokens = serve_first_tokens(llm, prompts, 512, eager=True)
    eager_kv = eager_kv.k.clone(), eager_kv.v.clone()
    total = sum(-(-len(p) // BLOCK) for p in prompts)
    engine = Engine(llm, max_batch=len(prompts), block_size=BLOCK, num_blocks=total + len(prompts),
                    prefill_chunk=512)
    for serve in range(2):  # captures, then replays
        cache, head, tokens = serve_first_tokens(llm, prompts, 512, engine)
        assert engine.runner._prompts, "no prompt pass was captured"
        if serve == 0:  # the blocks of a fresh engine, in the eager one's order
            assert torch.equal(cache.k[:, 1:], eager_kv[0][:, 1:]) and torch.equal(cache.v[:, 1:], eager_kv[1][:, 1:])
        assert torch.equal(head, eager_head) and tokens == eager_tokens


def test_warm_up_compiles_every_prefill_kernel(llm):
    """After Engine.warm_up, serving prompts of many sizes (packed, cut into 512-token chunks) compiles no kernel:
    the first requests of a server do not wait on Triton."""
    knobs = pytest.importorskip("triton.knobs")
    prompts = [long_prompt(llm, n) for n in (3, 40, 200, 700, 1500)]
    engine = Engine(llm, max_batch=len(prompts), block_size=BLOCK, num_blocks=sum(-(-len(p) // BLOCK) + 2
                                                                                  for p in prompts),
                    prefill_chunk=512)
    engine.warm_up()
    compiled = []
    hook, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, lambda **kw: compiled.append(kw["repr"])
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_new_tokens=3, ignore_eos=True), gamma=0)
        served_tokens(engine)
    finally:
        knobs.runtime.jit_cache_hook = hook
    assert compiled == []
