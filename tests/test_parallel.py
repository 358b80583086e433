"""Tensor parallelism on the CPU: 2 processes over gloo, tiny random models (parallel/, model.RowParallelLinear)."""
import json
import multiprocessing

import pytest
import torch
from conftest import tiny_model
from tp_ranks import GROUP, RUNS, collectives, logits_and_bytes, rows_of_rank

import selfspec
from selfspec.cli import main
from selfspec.errors import SelfspecError
from selfspec.parallel import SOLO
from selfspec.parallel.launch import on_ranks, run_ranks

# Weight-only modes of group-aligned formats store the same codes at TP2 and TP1: only the split sums differ.
# Per-channel INT8 scales and per-token activation scales of a row-split layer cover its rank's features only.
CLOSE = {"fp32": 1e-5, "w4a16": 1e-5, "full": 1e-5, "upper": 1e-5, "w8a16": 0.02, "w8a8": 0.05, "w4a4": 0.4}


def models():
    """A llama with every bias (o and down too: added on rank 0 only) and a qwen3 with qk-norm and tied embeddings."""
    return [tiny_model("llama", seed=1, attention_bias=True, mlp_bias=True)[:2],
            tiny_model("qwen3", seed=2, tie_word_embeddings=True, head_dim=16)[:2]]


@pytest.mark.parametrize("shape", [(4, 96), (2, 3, 64)])
def test_all_reduce_adds_in_float32_in_rank_order_and_gather_last_concatenates(shape):
    """Three ranks: every rank's all_reduce holds the bits of the float32 sum of the bf16 parts in rank order,
    rounded once (a sum kept in bf16 differs on these values), and gather_last the parts side by side in rank
    order."""
    g = torch.Generator().manual_seed(len(shape))
    parts = [(torch.randn(shape, generator=g) * s).bfloat16() for s in (300.0, 1.0, 1.0)]
    want = ((parts[0].float() + parts[1].float()) + parts[2].float()).bfloat16()
    assert not torch.equal(want, parts[0] + parts[1] + parts[2])
    for total, side in run_ranks(collectives, 3, parts):
        assert torch.equal(total, want)
        assert torch.equal(side, torch.cat(parts, dim=-1))


def test_tp2_logits_close_to_tp1_and_shards_hold_half():
    """Every stored format and mode, on two model families: the ranks agree bitwise, TP2 is close to TP1, and each
    rank stores half the sharded bytes (per-channel INT8 a little more: its scales are not split by a row split)."""
    both = models()
    tokens = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    solos = logits_and_bytes(SOLO, both, tokens)
    ranks = run_ranks(logits_and_bytes, 2, both, tokens)
    for which, solo in enumerate(solos):
        for storage, _, modes in RUNS:
            for name in modes:
                got = ranks[0][which][name]
                assert torch.equal(got, ranks[1][which][name]), f"model {which} {name}: the ranks disagree"
                err = (got - solo[name]).abs().max() / solo[name].abs().max()
                assert err < CLOSE[name], f"model {which} {storage} {name}: TP2 off TP1 by {err:.2e} of the top logit"
            half = solo[storage] / 2
            held = [r[which][storage] for r in ranks]
            assert all(half <= b <= half * (1.02 if storage == "int8" else 1) for b in held), \
                f"model {which} {storage}: ranks store {held} bytes of {solo[storage]}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=5)[2].save_pretrained(path)
    return str(path)


def test_tp2_greedy_speculative_equals_ar(tiny_dir):
    """Under TP 2 (this process rank 0, one spawned worker): planes drafting 4 a round == `full` AR, token for token;
    again the same on a second run, and with lookup drafts; each rank holds less than the whole model."""
    solo = selfspec.load(tiny_dir, recipe="planes", group_size=GROUP)
    llm = selfspec.load(tiny_dir, recipe="planes", group_size=GROUP, tensor_parallel=2)
    try:
        params = selfspec.SamplingParams(max_new_tokens=24, ignore_eos=True)
        prompt = [3, 17, 9, 200, 41, 17, 9, 200]
        ar = llm.generate(prompt, params, gamma=0)
        spec = llm.generate(prompt, params, gamma=4)
        assert spec.token_ids == ar.token_ids
        assert spec.stats.draft_accepted > 0 and spec.stats.rounds < len(ar.token_ids), spec.stats.summary()
        assert llm.generate(prompt, params, gamma=4).token_ids == spec.token_ids
        sampled = selfspec.SamplingParams(temperature=0.8, seed=7, max_new_tokens=12, ignore_eos=True)
        assert llm.generate(prompt, sampled).token_ids == llm.generate(prompt, sampled).token_ids
        assert len(llm.rank_weight_bytes) == 2
        assert all(b < solo.model.weight_bytes() for b in llm.rank_weight_bytes)
    finally:
        llm.close()


def test_tp2_engine_batched_equals_solo_ar(tiny_dir):
    """The serving engine under TP 2 (rank 0 schedules, the worker follows its steps): 3 greedy requests batched 2 at
    a time in a pool small enough to preempt, drafting by the policy, 4 a round, or not at all, each == TP2 solo AR;
    and a sampled request without a seed (rank 0 draws one for every rank) finishes."""
    llm = selfspec.load(tiny_dir, recipe="planes", group_size=GROUP, tensor_parallel=2)
    try:
        params = selfspec.SamplingParams(max_new_tokens=16, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [100, 3, 4], [9, 9, 9, 9, 1, 2, 3, 4, 5, 6]]
        want = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
        engine = llm.serve_engine(max_batch=2, block_size=4, num_blocks=7, max_gamma=4)
        with pytest.raises(SelfspecError, match="serves an engine"):
            llm.generate(prompts[0], params)
        for i, (p, gamma) in enumerate(zip(prompts, [None, 4, 0])):
            engine.add_request(str(i), p, params, gamma=gamma)
        engine.add_request("sampled", prompts[0], selfspec.SamplingParams(temperature=0.9, max_new_tokens=8,
                                                                             ignore_eos=True))
        got = {}
        while engine.has_work():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert [got[str(i)] for i in range(3)] == want
        assert len(got["sampled"]) == 8
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0, stats
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel": 3}, "4 attention heads, 2 KV heads"),
    ({"tensor_parallel": 2, "group_size": 64}, "64 attention output features in quantization groups of 64"),
    ({"tensor_parallel": 2, "recipe": "quasar"}, "SmoothQuant"),
])
def test_bad_tensor_parallel_refused_before_any_process(tiny_dir, kwargs, message):
    with pytest.raises(SelfspecError, match=message):
        selfspec.load(tiny_dir, **{"group_size": GROUP, **kwargs})
    assert not multiprocessing.active_children()


def test_generate_cli_tensor_parallel(capsys, tmp_path):
    """`selfspec generate --tensor-parallel 2`: text in and out through rank 0's tokenizer, each rank's bytes in the
    JSON's memory report."""
    from test_cli_errors import save_byte_tokenizer

    tiny_model("llama", seed=5)[2].save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--prompt", "hello hello", "--group-size", str(GROUP), "--json",
            "--max-new-tokens", "10", "--fixed-gamma"]
    assert main(args + ["--tensor-parallel", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["stats"]["new_tokens"] == 10 and res["stats"]["draft_proposed"] > 0
    assert res["tensor_parallel"]["size"] == 2 and len(res["tensor_parallel"]["weight_bytes_per_rank"]) == 2
    assert main(args + ["--gamma", "0"]) == 0
    # TP1 AR: equal on this model (fixed weights), not across TP sizes in general
    assert json.loads(capsys.readouterr().out)["text"] == res["text"]


def test_serve_refuses_tensor_parallel_with_replicas():
    from selfspec.cli import build_parser
    from selfspec.serve.server import check_serve_args

    args = build_parser().parse_args(["serve", "--tensor-parallel", "2", "--replicas", "2"])
    with pytest.raises(SelfspecError, match="--tensor-parallel and --replicas"):
        check_serve_args(args)


def test_a_dead_worker_is_a_clear_error(tiny_dir):
    llm = selfspec.load(tiny_dir, recipe="planes", group_size=GROUP, tensor_parallel=2)
    try:
        llm.workers[0].kill()
        llm.workers[0].join(10)
        with pytest.raises(SelfspecError, match="worker process ended"):
            llm.generate([5, 6, 7], selfspec.SamplingParams(max_new_tokens=4))
    finally:
        llm.close()
    assert not multiprocessing.active_children()


def test_a_benchmark_measures_here_alone_or_on_ranks():
    """`bench steps` and `bench spec` run their `measure` in this process at size 1, else on spawned ranks with
    each rank's tp, rank 0's rows returned."""
    assert on_ranks(rows_of_rank, 1, 2) == [(0, 1), (0, 1)]
    assert on_ranks(rows_of_rank, 2, 3, device="cpu") == [(0, 2)] * 3


def test_the_step_profile_counts_the_collectives_kernels():
    """`bench steps --tensor-parallel`'s profile: NCCL's kernels and symmetric memory's all-reduce count as
    collectives, per step; every kernel counts toward the step's kernel time; the kernels by time a step, each with
    its launches a step."""
    from selfspec.bench import steps

    step = [("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 20.0),
            ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)", 6.0),
            ("_nibble_ws_kernel", 50.0), ("void at::native::elementwise_kernel<...>", 4.0),
            ("_nibble_ws_kernel", 30.0)]
    got = steps.kernel_profile(step * 3, 3)
    assert (got["collectives"], got["collective_ms"], got["kernel_ms"]) == (2, pytest.approx(0.026),
                                                                            pytest.approx(0.110))
    top = [(k["name"], k["per_step"], k["ms"]) for k in got["top_kernels"]]
    assert top[0] == ("_nibble_ws_kernel", 2, pytest.approx(0.080))
    assert [name for name, _, _ in top[1:]] == [step[0][0], step[1][0], step[3][0]]
    assert len(steps.kernel_profile([(f"k{i}", 1.0 + i) for i in range(20)], 1)["top_kernels"]) == steps.TOP_KERNELS


@pytest.mark.parametrize("joined_before,fresh", [(False, True), (True, False)])
def test_a_group_sums_through_peer_memory_only_when_no_rank_joined_one_before(monkeypatch, joined_before, fresh):
    """Symmetric memory numbers its store exchanges per process, so a process's second peer group would wait forever
    on a fresh peer (comm._joined_peer): every rank reads every rank's flag and all agree."""
    import torch.distributed as dist

    from selfspec.parallel import comm

    monkeypatch.setattr(comm, "_joined_peer", joined_before)
    store = dist.HashStore()
    store.set("peer-fresh/1", "1")  # rank 1: a fresh process
    assert comm._all_fresh(store, 0, 2) is fresh
    assert store.get("peer-fresh/0") == (b"1" if fresh else b"0")
