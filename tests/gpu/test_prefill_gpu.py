"""Chunked and packed prefill on the GPU, through the engine, on SmolLM2 (or SELFSPEC_GPU_MODEL: its .gguf path or
HF directory): a prompt prefilled in chunks of 16, 128 or 512 tokens leaves the same KV cache bits and draws its
first token from the same logits bits as in one piece; prompts packed into one prefill pass give the bits each
gives alone. The Triton linear and attention are meant to be batch invariant (a row's reductions do not depend on
the other rows, nor on the keys past its position), so these should hold bitwise at any size."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from conftest import recorded_logits, served_tokens  # noqa: E402
import selfspec  # noqa: E402
from selfspec.bench.prompts import PROMPTS  # noqa: E402
from selfspec.engine.engine import Engine  # noqa: E402
from selfspec.speculative.sampling import SamplingParams  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module", params=["planes", "qspec"])
def llm(request):
    return selfspec.load(os.environ.get("SELFSPEC_GPU_MODEL"), request.param, device="cuda")


def serve_first_tokens(llm, prompts: list[list[int]], chunk: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Serve each prompt one new token, all submitted at once: (the KV pools after, the logits rows the first
    tokens were drawn from, in request order, each request's tokens)."""
    with recorded_logits(llm.model) as heads:
        total = sum(-(-len(p) // BLOCK) for p in prompts)
        engine = Engine(llm, max_batch=len(prompts), block_size=BLOCK, num_blocks=total + len(prompts),
                        prefill_chunk=chunk)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_new_tokens=1, ignore_eos=True), gamma=0)
        tokens = served_tokens(engine)
    return engine.cache, torch.cat(heads), [tokens[str(i)] for i in range(len(prompts))]


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
