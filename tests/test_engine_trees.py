"""Token trees in the serving engine: each sequence forked into branch rows over its paged blocks (PagedTree), or
for a drafter that forks no rows its nodes stored once in its own blocks (SharedTree), every branch of every row
verified in one pass. Greedy engine output == AR of the verify mode for ngram-tree:4, hybrid-tree
and tree:upper:3 as requests join at different times (tiny model, block size 4: branches start inside a shared partial
block); sampling: engine == solo for the same seed; the fork's rows read the committed KV and copy exactly; the pool
is empty at the end and no block has two owners after any step; an abort mid-stream leaves the others exact; the
policy's plain rounds mix with tree rounds; a failing request fails alone; block accounting under a random schedule;
SmolLM2 `hybrid` served over HTTP == the library's AR text."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import fail_from, tiny_model
from selfspec.bench.traces import ReplayAcceptance
from selfspec.cache.paged import PagedKVCache, PagedTree, tree_view
from selfspec.engine.engine import Engine
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.speculative.drafters import SHARED_TREE_BATCH, make_drafter
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams
from test_engine import assert_blocks_owned_once, assert_idle, prompts
from test_trees import REPETITIVE, greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=1)
    return build(cfg, sd, None, resolve_recipe("hybrid"), group_size=32)


class Passes:
    """The model, recording each pass's rows and mode (the engine takes it for its runner)."""

    def __init__(self, model):
        self.model, self.device, self.seen, self.shared = model, model.device, [], []

    def __call__(self, tokens, pos, cache, mode, *args, **kwargs):
        self.seen.append((tokens.shape[0], mode))
        if kwargs.get("tree") is not None:  # a node-packed tree pass: do its rows share their sequence's row?
            self.shared.append(kwargs["tree"].tails is not None)
        return self.model(tokens, pos, cache, mode, *args, **kwargs)


def serve(engine: Engine, requests: list[tuple[list[int], SamplingParams, int | None]], arrivals: list[int],
          aborts: dict[int, str] | None = None) -> dict[str, tuple[list[int], str]]:
    """Request i joins at step arrivals[i]; aborts[step] is aborted before that step. Steps until idle, checking
    block ownership after every step -> {id: (tokens, finish reason)}."""
    tokens, reasons, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_work():
        for i, (prompt, params, gamma) in enumerate(requests):
            if arrivals[i] == step:
                engine.add_request(str(i), prompt, params, gamma=gamma)
        if aborts and step in aborts:
            engine.abort(aborts[step])
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        assert_blocks_owned_once(engine)
        step += 1
    return {k: (tokens.get(k, []), reasons[k]) for k in reasons}


@pytest.mark.parametrize("name", ["ngram-tree:4", "hybrid-tree", "tree:upper:3", "recycle-tree:6"])
def test_engine_trees_greedy_equal_ar_as_requests_join(llm, name, monkeypatch):
    """Eight requests (repetitive texts, random ones of 9 tokens), joining over five steps, fixed
    gammas and the policy's: each request's tokens are its AR output; branches were accepted; the pool ends empty."""
    llm.drafter = make_drafter(name)
    ps = REPETITIVE + prompts(4, seed=11, hi=12)
    gammas = [4, 4, None, 0, 4, 4, 3, 4]
    requests = [(p, greedy(10 + 3 * (i % 4)), g) for i, (p, g) in enumerate(zip(ps, gammas))]
    refs = [llm.generate(p, params, gamma=0).token_ids for p, params, _ in requests]
    engine = Engine(llm, max_batch=5, block_size=4, num_blocks=96, max_gamma=4)
    engine.runner = passes = Passes(llm.model)
    trees, tree_round = [], Engine._tree_round
    monkeypatch.setattr(Engine, "_tree_round",
                        lambda self, seqs, k, lock: trees.append(len(seqs)) or tree_round(self, seqs, k, lock))
    out = serve(engine, requests, arrivals=[0, 0, 1, 1, 2, 3, 4, 4])
    for i, ref in enumerate(refs):
        assert out[str(i)] == (ref, "length"), (name, i)
    s = engine.stats()
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert_idle(engine)
    assert max(trees) > 1  # a round over several sequences' trees: one verify pass for all their branches
    # ... each sequence's nodes over its own blocks where the drafter forks no rows, else a row per branch
    assert all(passes.shared) and bool(passes.shared) == (not llm.drafter.forks)
    if name not in ("ngram-tree:4", "recycle-tree:6"):  # ... whose draft steps ran together
        assert max(rows for rows, mode in passes.seen if mode == llm.drafter.mode) > llm.drafter.branches


def test_replayed_acceptance_takes_one_count_a_sequence_a_tree_round(llm, monkeypatch):
    """The serving benchmark's replayed acceptance through the engine's shared tree rounds of several sequences:
    one recorded count per sequence and round (not one per branch), so replayed rounds accept what the trace's
    rounds did."""
    llm.drafter = make_drafter("recycle-tree:6")
    acc = ReplayAcceptance([3, 0, 1, 2])
    engine = Engine(llm, max_batch=3, block_size=4, num_blocks=96, max_gamma=4, accept=acc)
    counted, tree_round = [], Engine._tree_round
    monkeypatch.setattr(Engine, "_tree_round",
                        lambda self, seqs, k, lock: counted.append(len(seqs)) or tree_round(self, seqs, k, lock))
    serve(engine, [(p, greedy(12), 4) for p in REPETITIVE[:3]], arrivals=[0, 0, 0])
    assert max(counted) == 3 and acc.i == sum(counted)


@pytest.mark.parametrize("name", ["ngram-tree:4", "recycle-tree:6"])
def test_a_lone_sequences_tree_reads_its_own_row(llm, name):
    """A drafter that forks no rows, in a round of one sequence: its branches read the sequence's own blocks
    (SharedTree, a node-packed pass, accepted drafts moved to their positions); the tokens are AR's."""
    llm.drafter = make_drafter(name)
    requests = [(p, greedy(14), 4) for p in REPETITIVE[:2]]
    refs = [llm.generate(p, params, gamma=0).token_ids for p, params, _ in requests]
    engine = Engine(llm, max_batch=1, block_size=4, num_blocks=40, max_gamma=4)
    engine.runner = passes = Passes(llm.model)
    out = serve(engine, requests, arrivals=[0, 0])
    for i, ref in enumerate(refs):
        assert out[str(i)] == (ref, "length"), (name, i)
    assert engine.stats().num_accepted_tokens > 0 and passes.shared and all(passes.shared)
    assert_idle(engine)


def test_the_policy_times_tree_rounds_by_the_tokens_they_verify(llm):
    """The policy learns a tree round's time as that of a pass of the tokens it prices such rounds by
    (TreeDrafter.verify_tokens): a drafter that forks no rows, in a round of up to SHARED_TREE_BATCH sequences,
    runs each one's nodes and pending token (2 x (4 x k + 1)); past that, and for a drafter that forks, each
    sequence's branches as rows of k + 1."""
    llm.drafter = make_drafter("ngram-tree:4")
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=80, max_gamma=4)
    assert engine.policy.pass_tokens(2, 3) == 2 * (4 * 3 + 1) and engine.policy.pass_tokens(1, 3) == 4 * 3 + 1
    assert engine.policy.pass_tokens(SHARED_TREE_BATCH + 1, 3) == (SHARED_TREE_BATCH + 1) * 4 * 4
    assert make_drafter("tree:upper:3").verify_tokens(2, 3) == 2 * 3 * 4
    serve(engine, [(p, greedy(14), 4) for p in REPETITIVE[:2]], arrivals=[0, 0])
    assert {1, 2, 2 * (4 * 4 + 1), 4 * 4 + 1} == set(engine.policy.verify_cost)


def test_warm_up_timings_keep_a_tree_that_must_lose_from_exploring(llm):
    """Given the warm-up's pass timings (on the GPU; here made up, a pass costing 1 + tokens / 16), the policy
    does not explore a tree round at batch 8 (each sequence's 4 nodes and pending token: 40 tokens for one draft
    a row, a loss even if accepted), and does at batch 1 (5 tokens)."""
    llm.drafter = make_drafter("ngram-tree:4")
    engine = Engine(llm, max_batch=8, block_size=4, num_blocks=200, max_gamma=4)
    engine.seed_policy({t: 1 + t / 16 for t in (1, 2, 4, 8, 16, 32, 64, 128)}, {})
    assert (engine.policy.choose(8), engine.policy.measuring) == (0, False)
    assert (engine.policy.choose(1), engine.policy.measuring) == (1, True)


def test_engine_tree_sampling_equals_solo_with_the_seed(llm):
    """T > 0: multi-candidate rejection sampling draws the same random numbers per request as solo decoding, so
    a seeded request's tokens are the solo ones (the solo path's distribution test: test_trees.py)."""
    llm.drafter = make_drafter("hybrid-tree:3")
    params = [SamplingParams(temperature=0.8, top_k=40, seed=i, max_new_tokens=14, ignore_eos=True)
              for i in range(4)]
    requests = [(p, sp, 3) for p, sp in zip(REPETITIVE, params)]
    solo = [llm.generate(p, sp, gamma=3) for p, sp, _ in requests]
    out = serve(Engine(llm, max_batch=4, block_size=4, num_blocks=64), requests, arrivals=[0, 1, 1, 2])
    assert [out[str(i)][0] for i in range(4)] == [s.token_ids for s in solo]
    assert sum(s.stats.draft_accepted for s in solo) > 0


def test_an_abort_mid_stream_leaves_the_others_exact(llm):
    llm.drafter = make_drafter("ngram-tree:4")
    requests = [(p, greedy(24), 4) for p in REPETITIVE]
    refs = [llm.generate(p, params, gamma=0).token_ids for p, params, _ in requests]
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=64)
    out = serve(engine, requests, arrivals=[0, 0, 0, 1], aborts={3: "1"})
    assert out["1"][1] == "abort" and 0 < len(out["1"][0]) < 24
    for i in (0, 2, 3):
        assert out[str(i)] == (refs[i], "length"), i
    assert_idle(engine)


def test_a_tight_pool_preempts_for_the_branch_blocks(llm):
    """A pool too small for every tree at once: the branch rows' blocks are budgeted, so the engine preempts
    rather than running out, and the outputs are unchanged."""
    llm.drafter = make_drafter("hybrid-tree")
    requests = [(p, greedy(30), 4) for p in REPETITIVE]
    refs = [llm.generate(p, params, gamma=0).token_ids for p, params, _ in requests]
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=30, prefill_chunk=8)
    out = serve(engine, requests, arrivals=[0, 0, 0, 0])
    assert [out[str(i)] for i in range(4)] == [(r, "length") for r in refs]
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)


@torch.inference_mode()
def test_paged_tree_rows_share_the_prefix_and_copy_exactly():
    """Random pools: a fork at a length inside a block gives every branch row the committed KV of positions
    0..length-1 (the shared blocks, the partial block copied); writes at positions >= length stay in their row;
    copy_positions copies one row's positions to the others bit for bit; release returns exactly the branch blocks."""
    cache = PagedKVCache(2, 20, 2, 4, 8, torch.float32)
    cache.k.normal_(), cache.v.normal_()
    cache.allocate("s", 10)
    cache.truncate("s", 6)  # positions 0..5: one full block, two slots of the second
    cache.extend("s", 4)  # room for the round: positions 6..9
    free = len(cache.free_blocks)
    tree = PagedTree(cache, "s", 3)
    assert len(cache.free_blocks) == free - 2 * 2 and tree.table.shape == (3, 3)
    view = tree.rows(0, 3)
    committed = view.slots(torch.arange(6).expand(3, -1))
    for pool in (cache.k, cache.v):
        kv = pool[:, committed // 4, :, committed % 4]  # [3, 6, layers, heads, dim]
        assert torch.equal(kv[1], kv[0]) and torch.equal(kv[2], kv[0])
    new = view.slots(torch.arange(6, 10).expand(3, -1))
    assert len(set(new.flatten().tolist())) == 12  # each row's round positions have their own slots
    before = cache.k.clone()
    tree.copy_positions(2, 6, 9)
    at = lambda pool, slots: pool[:, slots // 4, :, slots % 4]  # noqa: E731
    for b in (0, 1):
        assert torch.equal(at(cache.k, new[b, :3]), at(before, new[2, :3]))  # copied
        assert torch.equal(at(cache.k, new[b, 3:]), at(before, new[b, 3:]))  # past `end`: untouched
    assert torch.equal(at(cache.k, new[2]), at(before, new[2]))  # the source row: untouched
    both = tree_view([tree, tree], [(1, 2), (0, 3)])
    assert both.table.shape == (4, 3) and torch.equal(both.table[0], tree.table[1])
    assert torch.equal(both.table[1:], tree.table)
    tree.release()
    assert len(cache.free_blocks) == free and sorted(cache.free_blocks + cache.tables["s"]) == list(range(1, 21))


def test_engine_refuses_a_tree_over_a_quantized_kv_cache():
    cfg, sd, _ = tiny_model("llama", seed=1)
    quant = build(cfg, sd, None, resolve_recipe("selfspec", draft="hybrid-tree"), group_size=32)
    with pytest.raises(SelfspecError, match="token trees fork"):
        Engine(quant)


def test_serve_recipe_hybrid_on_smollm2(smollm2):
    """`selfspec serve --recipe hybrid`: two completions over HTTP, each the library's AR text."""
    from test_server import serving

    llm = smollm2("hybrid")
    prompts_ = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
                "The quick brown fox jumps over the lazy dog. The quick brown fox"]
    refs = [llm.generate(p, SamplingParams(max_new_tokens=12), gamma=0).text for p in prompts_]
    with serving(Engine(llm, max_batch=4)) as live:
        client = live.client()
        outs = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"gamma": 4}) for p in prompts_]
    assert [o.choices[0].text for o in outs] == refs
    assert sum(o.usage.accepted_tokens for o in outs) > 0


def test_a_failing_request_fails_alone_and_its_tree_blocks_come_back(llm, monkeypatch):
    """The model raises whenever a row reaches position 45 (only the long request's rows do): the batched tree round
    fails, its branch blocks go back, the rows are retried one by one, and only that request ends with an error."""
    llm.drafter = make_drafter("hybrid-tree")
    requests = [(p, greedy(12), 3) for p in REPETITIVE] + [(prompts(1, seed=12, max_len=2)[0] * 40, greedy(12), 3)]
    refs = [llm.generate(p, params, gamma=0).token_ids for p, params, _ in requests[:4]]
    fail_from(monkeypatch, llm.model, 45)
    engine = Engine(llm, max_batch=5, block_size=4, num_blocks=80)
    out = serve(engine, requests, arrivals=[0] * 5)
    assert out["4"][1] == "error" and 0 < len(out["4"][0]) < 12
    assert [out[str(i)] for i in range(4)] == [(r, "length") for r in refs]
    assert_idle(engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_block_accounting_under_a_random_schedule(llm, seed):
    """Requests join at random (greedy and sampling, varied gammas), some are aborted, a tight pool preempts: after
    every step each block has one owner at most and none is lost (serve checks), the pool ends empty, and every
    greedy request that ran to its length gave its AR output."""
    rng = random.Random(seed)
    llm.drafter = make_drafter(rng.choice(["ngram-tree:3", "hybrid-tree:3"]))
    requests, arrivals, aborts = [], [], {}
    for i in range(14):
        prompt = [rng.randrange(3, 12) for _ in range(rng.randrange(1, 24))]
        params = greedy(rng.randrange(1, 30)) if rng.random() < 0.7 else SamplingParams(
            temperature=1.0, top_k=20, seed=i, max_new_tokens=rng.randrange(1, 30), ignore_eos=True)
        requests.append((prompt, params, rng.choice([None, 0, 1, 3, 4])))
        arrivals.append(rng.randrange(0, 30))
        if rng.random() < 0.15:
            aborts[arrivals[-1] + rng.randrange(1, 6)] = str(i)
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=28, prefill_chunk=12, max_gamma=4)
    out = serve(engine, requests, arrivals, aborts)
    assert sorted(out, key=int) == [str(i) for i in range(14)]
    assert {reason for _, reason in out.values()} <= {"length", "abort"}  # no pass ran out of blocks
    s = engine.stats()
    assert s.num_preemptions > 0 and s.num_accepted_tokens > 0
    assert_idle(engine)
    for i, (prompt, params, _) in enumerate(requests):
        if out[str(i)][1] == "length" and params.greedy:
            assert out[str(i)][0] == llm.generate(prompt, params, gamma=0).token_ids, i


def test_eval_sizes_its_pool_for_the_branch_rows(llm):
    """`selfspec eval` sizes the pool per request (batch 1 here): with a tree drafter, the branch rows' blocks too."""
    from selfspec.eval.runner import generate_batched

    llm.drafter = make_drafter("hybrid-tree")
    prompts_ = {str(i): p for i, p in enumerate(REPETITIVE[:2])}
    outs = {o.request_id: o for o in generate_batched(llm, prompts_, greedy(10), gamma=3, batch_size=1)}
    assert {i: o.generation.token_ids for i, o in outs.items()} == {
        i: llm.generate(p, greedy(10), gamma=0).token_ids for i, p in prompts_.items()}


def test_a_request_whose_tree_cannot_fit_is_refused(llm):
    llm.drafter = make_drafter("ngram-tree:4")
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=8)
    with pytest.raises(SelfspecError, match="branch rows"):
        engine.add_request("a", [3, 4, 5], greedy(8), gamma=4)  # 4 blocks of its own + 3 x 2 for the branches
    out = serve(engine, [([3, 4, 5], greedy(8), 0)], arrivals=[0])  # no drafts, no branches: 3 blocks
    assert out["0"] == (llm.generate([3, 4, 5], greedy(8), gamma=0).token_ids, "length")


@pytest.mark.parametrize("name", ["recycle-tree:6", "hybrid-tree"])
def test_a_tree_recipes_plain_rounds_run_back_to_back(llm, name, monkeypatch):
    """A tree recipe's plain rounds (gamma 0, or the policy's) run decode_steps steps back to back as a chain
    recipe's do: each row's text keeps its drafter's history (and, for the recycled tree, its successor table), and
    tree rounds after the bursts are still AR's tokens."""
    import selfspec.engine.engine as engine_module
    from selfspec.speculative.decode import run_steps

    llm.drafter = make_drafter(name)
    bursts = []
    monkeypatch.setattr(engine_module, "run_steps", lambda *a: bursts.append(a[4]) or run_steps(*a))
    requests = [(p, greedy(16), 0 if i < 2 else 4) for i, p in enumerate(REPETITIVE[:4])]
    refs = [llm.generate(p, params, gamma=0).token_ids for p, params, _ in requests]
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=96, max_gamma=4, decode_steps=4)
    out = serve(engine, requests, arrivals=[0, 0, 1, 1])
    for i, ref in enumerate(refs):
        assert out[str(i)] == (ref, "length"), (name, i)
    assert bursts and max(bursts) == 4 and engine.stats().num_accepted_tokens > 0
    assert_idle(engine)


def test_shared_tree_rounds_are_timed_by_their_own_passes(llm, monkeypatch):
    """The warm-up (on the GPU) times a shared tree round of b sequences at k drafts by its own pass, every branch
    row a chain of k + 1 queries over a real context, keyed as the policy prices it (verify_tokens(b, k)): here
    run through the CPU model with the timer replaced, every pass built and run."""
    from selfspec.engine import engine as engine_module

    llm.drafter = make_drafter("ngram-tree:4")
    engine = Engine(llm, max_batch=3, block_size=4, num_blocks=120, max_gamma=4)
    runs = []
    monkeypatch.setattr(engine_module, "time_ms", lambda fn, warmup, reps: runs.append(fn().shape) or 2.0)
    seconds = engine._time_shared_trees(4, 3)
    assert set(seconds) == {engine.tree.verify_tokens(b, k) for b in (1, 2, 3) for k in range(1, 5)}
    assert set(seconds.values()) == {2e-3} and len(runs) == 12
    assert all(shape[-2] == n for shape, n in zip(runs, [engine.tree.verify_tokens(b, k) for b in (1, 2, 3)
                                                          for k in range(1, 5)]))


@pytest.mark.parametrize("name", ["ngram-tree:4", "hybrid-tree"])
def test_measuring_tree_rounds_keep_greedy_rows_in_lockstep(llm, name):
    """Tree rounds drafting only to measure (an exploration round or a probe), shared rows or forked: each greedy row
    emits one token a round (its solo greedy output), so requests of one length started together finish at one step
    and their successors' prompts are prefilled together again; the accepted drafts still reach the policy."""
    from test_engine import Drafts3, finish_steps

    llm.drafter = make_drafter(name)
    ps = [(p * 3)[:12] for p in REPETITIVE]  # one prompt length, text the lookups match
    refs = [llm.generate(p, greedy(16), gamma=0).token_ids for p in ps]
    ends = {}
    for measuring in (True, False):
        engine = Engine(llm, max_batch=4, block_size=4, num_blocks=96, max_gamma=3, policy=Drafts3(measuring))
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(16))
        finished = finish_steps(engine)
        assert [finished[str(i)][1].token_ids for i in range(4)] == refs
        ends[measuring] = {s for s, _ in finished.values()}
        s = engine.stats()
        assert s.num_accepted_tokens > 0 and (s.num_lockstep_rows > 0) == measuring
        emitted = [g.stats.draft_accepted for _, g in finished.values()]
        assert (max(emitted) == 0) == measuring
        assert_idle(engine)
    assert len(ends[True]) == 1 and len(ends[False]) > 1
