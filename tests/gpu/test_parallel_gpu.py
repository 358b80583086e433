"""Tensor parallelism over NCCL, 2 GPUs: greedy speculative == greedy AR of the verify mode, token for token, through
the Triton kernels, decode passes as CUDA graphs holding the NCCL collectives. The same code as the CPU's gloo tests."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

import selfspec  # noqa: E402
from conftest import tiny_model  # noqa: E402
from tp_ranks import graphed_and_eager, peer_and_gathered  # noqa: E402

from selfspec.parallel.launch import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A qwen2 (q/k/v biases) whose row-split K (256, 512 -> 128, 256 per rank) holds whole groups of 64."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model("qwen2", seed=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512)[2].save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("recipe,draft", [("planes", None), ("qspec", None), ("ngram", None),
                                          ("planes", "ngram-tree:4")], ids=str)
def test_tp2_greedy_speculative_equals_ar_on_gpus(model_dir, recipe, draft):
    llm = selfspec.load(model_dir, recipe, draft, group_size=64, device="cuda", tensor_parallel=2)
    try:
        assert llm.model.dtype == torch.bfloat16 and llm.model.device == torch.device("cuda:0")
        params = selfspec.SamplingParams(max_new_tokens=32, ignore_eos=True)
        for seed in range(4):
            prompt = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
            prompt += prompt[:6]  # a repeat, for the lookup drafters
            ar = llm.generate(prompt, params, gamma=0).token_ids
            for gamma in (2, 4):
                out = llm.generate(prompt, params, gamma=gamma)
                assert out.token_ids == ar, f"prompt {seed}, gamma {gamma}: {out.stats.summary()}"
    finally:
        llm.close()


def test_tp2_engine_batched_equals_solo_ar_on_gpus(model_dir):
    """The serving engine over NCCL: rank 0 schedules, rank 1 follows; 6 greedy requests, 4 at a time, drafting by the
    policy, each == TP2 solo AR of `full`."""
    llm = selfspec.load(model_dir, "planes", group_size=64, device="cuda", tensor_parallel=2)
    try:
        params = selfspec.SamplingParams(max_new_tokens=24, ignore_eos=True)
        prompts = [torch.randint(3, 512, (5 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(6)]
        want = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
        engine = llm.serve_engine(max_batch=4, max_gamma=4)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        got = {}
        while engine.has_work():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert [got[str(i)] for i in range(len(prompts))] == want
    finally:
        llm.close()


def test_tp2_graphs_replay_the_eager_passes_bitwise():
    """Decode passes captured as CUDA graphs with their NCCL collectives replay, with new tokens and positions, the
    bits of the same passes run eagerly; the ranks agree."""
    cfg, sd = tiny_model("qwen2", seed=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)[:2]
    tokens = torch.randint(3, 512, (1, 14), generator=torch.Generator().manual_seed(0))
    ranks = run_ranks(graphed_and_eager, 2, cfg, sd, tokens, "planes", 64, ["full", "upper"], device="cuda")
    for name in ("full", "upper"):
        for step, ((g0, e0), (g1, _)) in enumerate(zip(ranks[0][name], ranks[1][name])):
            assert torch.equal(g0, e0), f"{name}, step {step}: the graph's logits differ from the eager pass's"
            assert torch.equal(g0, g1), f"{name}, step {step}: the ranks disagree"


def test_tp2_peer_all_reduce_has_the_all_gathers_bits():
    """Two GPUs' small bf16 sums through peer memory (comm.PeerAllReduce): the bits of the float32 sum of the two
    parts rounded once, as the all-gather path gives them, at 1, 7 and 160 rows of 4,096."""
    g = torch.Generator().manual_seed(5)
    parts = [(torch.randn(160, 4096, generator=g) * torch.logspace(-6, 6, 4096)).bfloat16() for _ in range(2)]
    for rank in run_ranks(peer_and_gathered, 2, parts, device="cuda"):
        for n, (peer, gathered) in zip((1, 7, 160), rank):
            want = (parts[0][:n].float() + parts[1][:n].float()).bfloat16()
            assert torch.equal(gathered, want)
            assert torch.equal(peer, want), f"{n} rows: the peer-memory sum differs from the all-gather's"
