"""Serving engine on tiny random models: batched (speculative) greedy == solo greedy for every request as
requests join and leave, chunked prefill, preemption and resume, aborts and errors free blocks, block accounting
under a random schedule, validation, thread-safe inbox."""
import random
import threading

import pytest
import torch

from conftest import fail_from, tiny_model
from selfspec.engine.engine import IN_STEP_ROWS, Engine, QueueFull, StepPlan, in_step
from selfspec.engine.graphs import PagedGraphedModel, bucket, pad_into
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.serve.metrics import ServerMetrics
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=1)
    return build(cfg, sd, None, resolve_recipe("planes", draft="w4a4"), group_size=32)


def greedy(n=10):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def prompts(count, seed=0, lo=3, hi=200, max_len=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (int(torch.randint(1, max_len, (), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def run(engine, feed=None):
    """Step until idle; feed(step) may add requests. Returns {id: (tokens, final output)} and the step count."""
    tokens, final, step = {}, {}, 0
    while (feed is not None and feed(step)) | engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
        step += 1
    return {k: (tokens.get(k, []), final[k]) for k in final}, step


def assert_idle(engine):
    s = engine.stats()
    assert (s.waiting, s.running, s.kv_blocks_used) == (0, 0, 0)


def test_batched_greedy_equals_solo_as_requests_join_and_leave(llm):
    """36 requests, 6 rows at a time, staggered arrivals, per-request gammas mixed with the policy's, varied
    lengths: every request's tokens are exactly those of a solo greedy run."""
    ps = prompts(36)
    lengths = [4 + i % 9 for i in range(36)]
    gammas = [None, 0, 1, 3, 5, None]
    refs = [llm.generate(p, greedy(n), gamma=0).token_ids for p, n in zip(ps, lengths)]
    engine = Engine(llm, max_batch=6, block_size=4, num_blocks=120, prefill_chunk=24)
    for i in range(20):
        engine.add_request(str(i), ps[i], greedy(lengths[i]), gamma=gammas[i % 6])

    def feed(step):  # the rest arrive one per step; True while some are still to come
        i = 20 + step
        if i < 36:
            engine.add_request(str(i), ps[i], greedy(lengths[i]), gamma=gammas[i % 6])
        return i < 35

    out, _ = run(engine, feed)
    assert sorted(out, key=int) == [str(i) for i in range(36)]
    for i in range(36):
        toks, final = out[str(i)]
        assert toks == refs[i] == final.generation.token_ids, i
        assert final.finish_reason == "length"
    s = engine.stats()
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # drafts accepted and rejected in batched rounds
    assert_idle(engine)


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 64]


@torch.inference_mode()
def test_a_batch_padded_to_its_bucket_gives_its_rows_results(llm):
    """What a CUDA-graph replay of the engine computes, run eagerly: 3 rows padded to the bucket of 4 (a padding
    row of token 0 at position 0 on trash blocks, tables padded to max_len's blocks) give the 3 rows' logits and
    KV writes; the padding writes only the trash block."""
    model, mode = llm.model, llm.verify_mode
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=40)
    cache = engine.cache
    history = prompts(3, seed=5)
    for i, p in enumerate(history):
        cache.allocate(str(i), len(p) + 3)
        model(torch.tensor([p]), torch.arange(len(p)), cache.view([str(i)]), mode)
    view = cache.view(["0", "1", "2"])
    toks = torch.randint(3, 200, (3, 3))
    pos = torch.tensor([len(p) for p in history])[:, None] + torch.arange(3)  # a verify pass of 3 tokens per row
    before = cache.k.clone(), cache.v.clone()
    want = model(toks, pos, view, mode)
    after = cache.k.clone(), cache.v.clone()
    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    static, rows = PagedGraphedModel(model, cache, engine.max_len)._static(view, 3)
    assert rows == 4 and static.table.shape == (4, cache.blocks_for(engine.max_len))
    padded_toks, padded_pos = torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 3, dtype=torch.long)
    pad_into(padded_toks, toks)
    pad_into(padded_pos, pos)
    got = model(padded_toks, padded_pos, static, mode)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    for pool, ref in zip((cache.k, cache.v), after):
        torch.testing.assert_close(pool[:, 1:], ref[:, 1:], rtol=1e-5, atol=1e-5)  # every block but the trash
        assert not torch.equal(pool[:, 0], ref[:, 0])  # the padding row wrote there


def test_sampling_rows_share_the_batch_with_greedy_rows(llm):
    ps = prompts(6, seed=3)
    refs = [llm.generate(p, greedy(8), gamma=0).token_ids for p in ps[:3]]
    engine = Engine(llm, max_batch=6, block_size=4, num_blocks=64)
    for i, p in enumerate(ps):
        params = greedy(8) if i < 3 else SamplingParams(temperature=1.0, top_k=20, seed=i, max_new_tokens=8,
                                                         ignore_eos=True)
        engine.add_request(str(i), p, params, gamma=3)
    out, _ = run(engine)
    assert [out[str(i)][0] for i in range(3)] == refs
    assert all(len(out[str(i)][0]) == 8 and max(out[str(i)][0]) < 256 for i in range(3, 6))
    assert_idle(engine)


def finish_steps(engine: Engine) -> dict[str, tuple[int, object]]:
    """Step the engine until idle: each request's (step it finished at, its generation)."""
    finished, step = {}, 0
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = (step, o.generation)
        step += 1
    return finished


class Drafts3(GammaPolicy):
    """Drafts 3 tokens every round: to measure only (as a drafting probe does while decoding plainly), or not."""

    def __init__(self, measuring: bool):
        super().__init__(3)
        self.only_measures = measuring

    def choose(self, batch: int) -> int:
        self.last_gamma, self.measuring = 3, self.only_measures
        return 3


def test_measuring_rounds_keep_greedy_rows_in_lockstep(llm):
    """Rounds drafting only to measure: each greedy row of the policy emits one token a round (its solo greedy
    output), so requests of one length started together finish at one step (drafting rounds of chosen speculation
    spread them); the drafts verify accepted still reach the policy and the engine's counters, and no greedy row
    counts a draft it did not emit. A seeded sampling row commits what it accepts either way (the same draws)."""
    ps = torch.randint(3, 200, (5, 6), generator=torch.Generator().manual_seed(7)).tolist()  # one prompt length
    sampling = SamplingParams(temperature=1.0, seed=5, max_new_tokens=16, ignore_eos=True)
    refs = [llm.generate(p, greedy(16), gamma=0).token_ids for p in ps[:4]]
    runs = {}
    for measuring in (True, False):
        policy = Drafts3(measuring)
        engine = Engine(llm, max_batch=5, block_size=4, num_blocks=64, max_gamma=3, policy=policy)
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(16) if i < 4 else sampling)
        finished = finish_steps(engine)
        assert [finished[str(i)][1].token_ids for i in range(4)] == refs
        runs[measuring] = finished, engine.stats(), policy
        assert_idle(engine)
    finished, s, policy = runs[True]
    assert len({finished[str(i)][0] for i in range(4)}) == 1  # the greedy rows in lockstep ...
    assert len({runs[False][0][str(i)][0] for i in range(4)}) > 1  # ... which speculation's rounds break
    assert s.num_lockstep_rows > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert policy.acceptance > 0  # the drafts the greedy rows did not emit were measured
    for i in range(4):
        stats = finished[str(i)][1].stats
        assert stats.draft_proposed > 0 and stats.draft_accepted == 0  # drafted, and emitted none of them
    assert finished["4"][1].token_ids == runs[False][0]["4"][1].token_ids
    assert finished["4"][1].stats.draft_accepted > 0


def test_long_prompt_is_chunk_prefilled_while_others_decode(llm):
    short = prompts(3, seed=4)
    long = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    refs = [llm.generate(p, greedy(20), gamma=0).token_ids for p in short + [long]]
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=120, prefill_chunk=32)
    for i, p in enumerate(short):
        engine.add_request(str(i), p, greedy(20), gamma=2)
    tokens = {}
    for o in engine.step():  # the short ones are prefilled and decoding
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.add_request("long", long, greedy(20), gamma=2)
    steps_before_first, decoded_meanwhile = 0, 0
    while engine.has_work():
        outs = engine.step()
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if "long" not in tokens:
            steps_before_first += 1
            decoded_meanwhile += sum(len(o.new_token_ids) for o in outs)
    assert steps_before_first >= 150 // 32  # five chunks of 32 tokens (the last one emits the first token)
    assert decoded_meanwhile >= 3 * steps_before_first  # every short row got tokens in every one of those steps
    assert [tokens[k] for k in ("0", "1", "2", "long")] == refs
    assert_idle(engine)


def test_abort_frees_blocks(llm):
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=40)
    for i, p in enumerate(prompts(4, seed=6)):
        engine.add_request(str(i), p, greedy(30))
    engine.step()
    engine.step()
    used = engine.stats().kv_blocks_used
    assert used > 0 and engine.stats().running == 2 and engine.stats().waiting == 2
    engine.abort("0")  # running
    engine.abort("3")  # waiting
    engine.abort("3")  # twice: fine
    engine.abort("nope")  # unknown: fine
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.finish_reason == "abort"}
    assert sorted(aborted) == ["0", "3"] and all(o.finished for o in aborted.values())
    assert "0" not in engine.cache.tables
    engine.abort("1")
    engine.abort("2")
    engine.step()
    assert_idle(engine)
    engine.add_request("0", [5, 6, 7], greedy(3))  # a finished id can be reused
    run(engine)
    assert_idle(engine)


def test_error_in_one_request_leaves_the_others_serving(llm, monkeypatch):
    """The model raises whenever a row reaches position 45 (only the long request gets there): its batched
    round fails, the engine retries the rows one by one, and only that request ends with an error."""
    ps = prompts(5, seed=7)
    bad = torch.randint(3, 200, (40,)).tolist()
    refs = [llm.generate(p, greedy(12), gamma=0).token_ids for p in ps]
    fail_from(monkeypatch, llm.model, 45)
    engine = Engine(llm, max_batch=6, block_size=4, num_blocks=80)
    engine.add_request("bad", bad, greedy(12), gamma=2)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(12), gamma=2)
    out, _ = run(engine)
    toks, final = out["bad"]
    assert final.finish_reason == "error" and "boom" in final.error and 0 < len(toks) < 12
    assert [out[str(i)][0] for i in range(5)] == refs
    assert all(out[str(i)][1].finish_reason == "length" for i in range(5))
    assert_idle(engine)


def test_error_while_emitting_tokens(llm, monkeypatch):
    append = llm.append_tokens

    def failing(out, chunk, params):
        if out.stats.prompt_tokens == 7:
            raise ValueError("cannot detokenize")
        return append(out, chunk, params)

    monkeypatch.setattr(llm, "append_tokens", failing)
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=40)
    engine.add_request("bad", list(range(3, 10)), greedy(5))
    engine.add_request("good", [4, 5, 6], greedy(5))
    out, _ = run(engine)
    assert out["bad"][1].finish_reason == "error" and "cannot detokenize" in out["bad"][1].error
    assert out["good"][0] == llm.generate([4, 5, 6], greedy(5), gamma=0).token_ids
    assert_idle(engine)


def test_validation_and_queue_limit(llm):
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=10, max_queue=2)
    with pytest.raises(SelfspecError, match="gamma"):
        engine.add_request("a", [3, 4], greedy(), gamma=99)
    with pytest.raises(SelfspecError, match="empty"):
        engine.add_request("a", [], greedy())
    with pytest.raises(SelfspecError, match="KV blocks"):
        engine.add_request("a", [3, 4], greedy(100))
    with pytest.raises(SelfspecError, match="SamplingParams"):
        engine.add_request("a", [3, 4], {"max_new_tokens": 4})
    engine.add_request("a", [3, 4], greedy(4))
    with pytest.raises(SelfspecError, match="already in use"):
        engine.add_request("a", [3, 4], greedy(4))
    engine.add_request("b", [3, 4], greedy(4))
    with pytest.raises(QueueFull):
        engine.add_request("c", [3, 4], greedy(4))
    with pytest.raises(SelfspecError, match="max_batch"):
        Engine(llm, max_batch=0)
    run(engine)
    assert_idle(engine)


def test_add_request_from_another_thread(llm):
    engine = Engine(llm, max_batch=3, block_size=4, num_blocks=60)
    ps = prompts(8, seed=8)
    done = threading.Event()

    def client():
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, greedy(4))
        done.set()

    threading.Thread(target=client).start()
    finished = set()
    while not done.is_set() or engine.has_work():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {str(i) for i in range(8)}
    assert_idle(engine)


def steps_to_finish(engine, request_id):
    """Step until request_id finishes; -> (its tokens, the steps it took)."""
    tokens, step = [], 0
    while True:
        step += 1
        for o in engine.step():
            if o.request_id == request_id:
                tokens += o.new_token_ids
                if o.finished:
                    return tokens, step


def test_a_small_request_is_not_held_up_by_a_max_context_one(llm):
    """The big request may grow to fill the whole pool (prompt + max_new_tokens = 32 blocks of 16); it holds only
    what it has written, so a small request arriving beside it finishes within 2x the steps it takes alone."""
    small = [7, 8, 9]
    solo_engine = Engine(llm, max_batch=4, block_size=16, num_blocks=32)
    solo_engine.add_request("small", small, greedy(12), gamma=2)
    solo_tokens, solo_steps = steps_to_finish(solo_engine, "small")
    engine = Engine(llm, max_batch=4, block_size=16, num_blocks=32, prefill_wait=0)
    engine.add_request("big", prompts(1, seed=9)[0], greedy(engine.max_len), gamma=2)
    for _ in range(3):
        engine.step()
    engine.add_request("small", small, greedy(12), gamma=2)
    tokens, steps = steps_to_finish(engine, "small")
    assert tokens == solo_tokens == llm.generate(small, greedy(12), gamma=0).token_ids
    assert steps <= 2 * solo_steps, (steps, solo_steps)
    engine.abort("big")
    engine.step()
    assert_idle(engine)


def test_newcomers_wait_a_few_steps_to_share_one_prefill_pass(llm, monkeypatch):
    """While a request decodes, prompts arriving one step apart wait (up to prefill_wait steps from the first)
    and are prefilled in one pass; with prefill_wait=0 each gets its own. Outputs are the solo ones either way,
    and a prompt arriving to an idle engine is prefilled at once."""
    ps = prompts(3, seed=4)
    passes = {}
    for wait in (0, 3):
        engine = Engine(llm, max_batch=4, block_size=16, num_blocks=64, prefill_wait=wait)
        sizes = []
        prefill = engine._prefill_chunk
        monkeypatch.setattr(engine, "_prefill_chunk", lambda seqs, n, outs: sizes.append(len(seqs)) or
                            prefill(seqs, n, outs))
        arrivals = {0: ("first", ps[0], 12), 1: ("a", ps[1], 6), 2: ("b", ps[2], 6)}

        def feed(step):
            if step in arrivals:
                rid, p, n = arrivals[step]
                engine.add_request(rid, p, greedy(n), gamma=0)
            return step < len(arrivals)

        out, _ = run(engine, feed)
        passes[wait] = sizes
        for rid, p in (("a", ps[1]), ("b", ps[2])):
            assert out[rid][0] == llm.generate(p, greedy(6), gamma=0).token_ids
        assert_idle(engine)
    assert passes == {0: [1, 1, 1], 3: [1, 2]}  # the first, on an idle engine, at once


def test_a_successor_waits_only_for_company_that_can_come(llm, monkeypatch):
    """A full batch in a closed loop (each finished request's successor submitted at once): the successor waits
    for the other row's successor while that row's tokens due end within the wait, and is prefilled at once where
    they do not (its row would stay empty for the whole wait). Outputs equal their solo runs."""
    ps = prompts(4, seed=7)
    passes = {}
    for other in (9, 40):  # tokens the second request makes: 3 after the first ends, or 34
        engine = Engine(llm, max_batch=2, block_size=16, num_blocks=64, prefill_wait=8, decode_steps=1)
        sizes = []
        prefill = engine._prefill_chunk
        monkeypatch.setattr(engine, "_prefill_chunk", lambda seqs, n, outs: sizes.append(len(seqs)) or
                            prefill(seqs, n, outs))
        lengths = {"a": 6, "b": other, "c": 6, "d": 6}
        engine.add_request("a", ps[0], greedy(6), gamma=0)
        engine.add_request("b", ps[1], greedy(other), gamma=0)
        tokens, successors, added, first = {}, iter([("c", ps[2]), ("d", ps[3])]), {}, {}
        while engine.has_work():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                first.setdefault(o.request_id, engine.steps)
                if o.finished and (nxt := next(successors, None)):
                    engine.add_request(nxt[0], nxt[1], greedy(6), gamma=0)
                    added[nxt[0]] = engine.steps
        passes[other] = sizes, first["c"] - added["c"]
        for rid, p in zip("abcd", ps):
            assert tokens[rid] == llm.generate(p, greedy(lengths[rid]), gamma=0).token_ids
        assert_idle(engine)
    assert passes == {9: ([2, 2], 4), 40: ([2, 1, 1], 1)}  # c waited for d, or its first token came next step


def test_a_successor_waits_where_rows_finish_often_enough(llm):
    """EOS ends rows before their tokens due, so the rate at which rows finish (an average over about 32 decode
    steps) is company too: where one row is expected to finish within the wait's steps left, the successor waits
    for it, though no running row's due count ends within them."""
    from selfspec.engine.engine import FINISH_RATE_STEPS, finish_rate

    assert finish_rate(0.0, 0, 4) == 0.0 and finish_rate(0.5, 2, 4) == pytest.approx(0.5)
    assert finish_rate(0.0, 1, 1) == pytest.approx(1 / FINISH_RATE_STEPS)
    assert finish_rate(0.0, 4, 2) == pytest.approx(2 * (1 - (1 - 1 / FINISH_RATE_STEPS) ** 2))
    ps = prompts(2, seed=9)
    engine = Engine(llm, max_batch=1, block_size=16, num_blocks=64, prefill_wait=8, decode_steps=1)
    engine.add_request("a", ps[0], greedy(40), gamma=0)
    engine.step()
    engine.add_request("b", ps[1], greedy(4), gamma=0)  # the batch full: only a finish frees a row for b
    engine._drain(engine._take_inbox(), [])
    plan = StepPlan([], {}, {})
    assert not engine._hold_prefill(plan)  # a is due 39 tokens, and no row has finished yet
    engine.finish_rate = 1 / 8
    assert engine._hold_prefill(plan)  # one finish expected within the 8 steps left
    engine.finish_rate = 0.0
    engine.abort("a")
    engine.step()  # a's row freed (an abort frees a row as a finish does), b admitted
    assert engine.finish_rate == pytest.approx(1 / FINISH_RATE_STEPS)
    engine.abort("b")
    engine.step()
    assert_idle(engine)


def test_preempted_requests_resume_with_unchanged_greedy_output(llm, monkeypatch):
    """Six requests whose worst cases (up to 14 blocks each) far exceed a 20-block pool: the engine admits them on
    current need, preempts the newest when the pool runs out and re-prefills it (prompt + tokens so far) on resume.
    Every output is exactly the solo greedy one, the pool ends empty and /metrics counts the preemptions. Prompt
    tokens are prefilled in the prompt arithmetic (Mode.prompt), the generated ones recomputed on resume in the
    arithmetic they were generated with, never both in one pass."""
    ps = prompts(6, seed=10)
    gammas = [None, 0, 2, 3, None, 1]
    refs = [llm.generate(p, greedy(40), gamma=0).token_ids for p in ps]
    engine = Engine(llm, max_batch=6, block_size=4, num_blocks=20, prefill_chunk=8)
    passes = []
    chunk = Engine._prefill_chunk

    def recorded(self, seqs, sizes, outputs):
        passes.append([(s.prefilled, n, len(s.prompt)) for s, n in zip(seqs, sizes)])
        return chunk(self, seqs, sizes, outputs)

    forward = llm.model.forward
    modes = []
    monkeypatch.setattr(Engine, "_prefill_chunk", recorded)
    monkeypatch.setattr(llm.model, "forward", lambda *a, **kw: modes.append(a[3]) or forward(*a, **kw))
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, greedy(40), gamma=gammas[i])
    out, _ = run(engine)
    kinds = [{start + n <= prompt_len for start, n, prompt_len in rows} for rows in passes]
    assert all(len(k) == 1 for k in kinds), "a prefill pass mixed prompt and generated tokens"
    for rows, (kind,) in zip(passes, kinds):
        if not kind:
            assert all(start >= prompt_len for start, _, prompt_len in rows)
    assert {False} in kinds and {True} in kinds  # resumes recomputed generated tokens
    assert sum(m.prompt for m in modes) == sum(k == {True} for k in kinds)
    assert [out[str(i)][0] for i in range(6)] == refs
    assert all(out[str(i)][1].finish_reason == "length" for i in range(6))
    s = engine.stats()
    assert s.num_preemptions > 0
    assert f"selfspec:num_preemptions_total {s.num_preemptions:.1f}" in ServerMetrics(engine.stats).render().decode()
    assert_idle(engine)


def test_request_gamma_is_capped_at_the_engine_gamma(llm):
    """gamma 8 on an engine run with max_gamma 2 drafts 2 tokens per round (a clamp, not an error)."""
    engine = Engine(llm, max_batch=2, block_size=4, num_blocks=40, max_gamma=2)
    engine.add_request("a", [5, 6, 7], greedy(12), gamma=8)
    out, _ = run(engine)
    toks, final = out["a"]
    stats = final.generation.stats
    assert toks == llm.generate([5, 6, 7], greedy(12), gamma=0).token_ids
    assert stats.rounds > 0 and stats.draft_proposed == 2 * stats.rounds
    assert engine.stats().num_draft_tokens == 2 * engine.stats().num_row_rounds


def assert_blocks_owned_once(engine):
    cache = engine.cache
    owned = [b for table in cache.tables.values() for b in table]
    assert len(owned) == len(set(owned)), "a block is in two block tables"
    assert sorted(owned + cache.free_blocks) == list(range(1, cache.num_blocks + 1)), "a block is lost or doubled"
    assert engine.stats().kv_blocks_used == len(owned)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_accounting_under_a_random_schedule(llm, seed):
    """Requests join (varied prompts, lengths, gammas, greedy and sampling), finish, get aborted and preempted on a
    tight pool; after every step each block has at most one owner and none is lost; at the end the pool is empty
    and every greedy request that ran to its length produced its solo output."""
    rng = random.Random(seed)
    engine = Engine(llm, max_batch=5, block_size=4, num_blocks=24, prefill_chunk=12, max_gamma=3)
    requests, finished, next_id = {}, {}, 0
    for step in range(400):
        if next_id < 24 and rng.random() < 0.3:
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 30))]
            params = greedy(rng.randrange(1, 40)) if rng.random() < 0.7 else SamplingParams(
                temperature=1.0, top_k=20, seed=next_id, max_new_tokens=rng.randrange(1, 40), ignore_eos=True)
            requests[str(next_id)] = (prompt, params)
            engine.add_request(str(next_id), prompt, params, gamma=rng.choice([None, 0, 1, 3, 5]))
            next_id += 1
        live = [r for r in requests if r not in finished]
        if live and rng.random() < 0.05:
            engine.abort(rng.choice(live))
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        assert_blocks_owned_once(engine)
        if next_id == 24 and not engine.has_work():
            break
    assert sorted(finished, key=int) == [str(i) for i in range(24)]
    assert {o.finish_reason for o in finished.values()} == {"length", "abort"}  # no error: no pass ran out of blocks
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)
    for rid, o in finished.items():
        prompt, params = requests[rid]
        if o.finish_reason == "length" and params.greedy:
            assert o.generation.token_ids == llm.generate(prompt, params, gamma=0).token_ids, rid


def test_plain_decoding_steps_run_back_to_back_with_unchanged_output(llm, monkeypatch):
    """decode_steps: a round of plain greedy decoding runs up to that many steps before the host waits
    (run_steps). Requests of different lengths, some stopping at EOS inside a burst, and one sampling request
    that turns bursts off while it runs: every output equals its solo run, and the bursts ran (and some were cut
    short by the longest output still due)."""
    import selfspec.engine.engine as engine_module
    from selfspec.speculative.decode import run_steps

    bursts = []
    monkeypatch.setattr(engine_module, "run_steps",
                        lambda *a: bursts.append((len(a[2]), a[4])) or run_steps(*a))
    ps = prompts(9, seed=5)
    lengths = [3, 17, 9, 12, 6, 30, 11, 8, 21]
    eos = {llm.generate(ps[1], greedy(17), gamma=0).token_ids[10]}  # request 1 stops at its 11th token
    monkeypatch.setattr(llm, "eos_ids", eos)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0) for i, n in enumerate(lengths)]
    params[7] = SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, ignore_eos=True)
    refs = [llm.generate(p, sp, gamma=0).token_ids for p, sp in zip(ps, params)]
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, prefill_chunk=32, decode_steps=5)
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(str(i), p, sp, gamma=0)
    out, _ = run(engine)
    assert [out[str(i)][0] for i in range(9)] == refs
    assert out["1"][1].finish_reason == "stop" and len(refs[1]) == 10
    assert bursts and {steps for _, steps in bursts} >= {5} and min(steps for _, steps in bursts) < 5
    assert engine.stats().num_row_rounds >= sum(map(len, refs)) - 9  # each burst step counted as a round
    assert_idle(engine)


def run_as_solo(llm, ps, lengths, policy, num_blocks=64):
    """Greedy requests ps of `lengths` tokens through one engine under `policy`, all added at once: each output is
    its solo greedy run's. -> (each request's (step it finished at, its generation), the engine)."""
    refs = [llm.generate(p, greedy(n), gamma=0).token_ids for p, n in zip(ps, lengths)]
    engine = Engine(llm, max_batch=len(ps), block_size=4, num_blocks=num_blocks, max_gamma=3, policy=policy)
    for i, (p, n) in enumerate(zip(ps, lengths)):
        engine.add_request(str(i), p, greedy(n))
    finished = finish_steps(engine)
    assert [finished[str(i)][1].token_ids for i in range(len(ps))] == refs
    return finished, engine


def test_a_measuring_round_keeps_in_step_only_rows_due_alike(llm):
    """Lockstep keeps together rows that would finish together: in a measuring round, greedy rows due as many
    tokens as another emit one token each, and a row due its own count (out of step already) commits what it
    accepts. Every output is its solo greedy run's."""
    ps = torch.randint(3, 200, (3, 6), generator=torch.Generator().manual_seed(7)).tolist()
    finished, engine = run_as_solo(llm, ps, [16, 16, 11], Drafts3(True))
    accepted = [finished[str(i)][1].stats.draft_accepted for i in range(3)]
    assert accepted[0] == accepted[1] == 0 and accepted[2] > 0
    assert finished["0"][0] == finished["1"][0]  # the pair still finish at one step
    assert engine.stats().num_lockstep_rows > 0
    assert_idle(engine)


def test_rows_in_step_from_eight_rows():
    """Rows stay in step (no drafting round) from IN_STEP_ROWS policy rows, where more than three quarters of them
    are each due as many tokens as another row; below that, or with most rows due counts of their own, rounds draft
    as the policy says."""
    assert in_step([16] * IN_STEP_ROWS) and not in_step([16] * (IN_STEP_ROWS - 1))
    assert not in_step(list(range(IN_STEP_ROWS)))
    assert in_step([16] * 7 + [3]) and not in_step([16] * 6 + [3, 4])  # 7 of 8 paired; 6 of 8 is not past 3/4
    assert in_step([9] * 16 + [5] * 12 + [1, 2, 3, 4])  # 28 of 32 in two groups


def test_requests_started_together_stay_in_step_at_eight_rows(llm):
    """Eight requests of one length started together: a policy that would draft every round drafts nothing, so all
    finish at one step (their successors then share a prompt pass); of their own lengths the same requests draft.
    Every output is its solo greedy run's."""
    ps = torch.randint(3, 200, (8, 6), generator=torch.Generator().manual_seed(8)).tolist()
    for lengths in ([12] * 8, [12, 13, 14, 15, 16, 17, 18, 19]):
        finished, engine = run_as_solo(llm, ps, lengths, Drafts3(False), num_blocks=128)
        drafts = engine.stats().num_drafts
        if len(set(lengths)) == 1:
            assert drafts == 0 and len({step for step, _ in finished.values()}) == 1
        else:
            assert drafts > 0
        assert_idle(engine)


def test_a_row_whose_prefill_ends_joins_the_burst(llm):
    """A request prefilled in a plain step joins the step's burst after its first token (the prefill's): a lone
    newcomer runs decode_steps steps in its first step, and one prefilled while another decodes joins that one's
    burst, its blocks reserved past its prefill chunk; every output equals its solo run."""
    ps = [[5, 6, 7], [8, 9, 10, 11, 12]]
    refs = [llm.generate(p, greedy(20), gamma=0).token_ids for p in ps]
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, prefill_wait=0, decode_steps=8)
    engine.add_request("a", ps[0], greedy(20), gamma=0)
    tokens = {"a": [], "b": []}
    for o in engine.step():
        tokens[o.request_id] += o.new_token_ids
    assert len(tokens["a"]) == 1 + 8
    engine.add_request("b", ps[1], greedy(20), gamma=0)
    engine._drain(engine._take_inbox(), [])
    plan = engine._schedule()
    assert [s.id for s in plan.prefill] == ["b"] and plan.steps == 8
    engine._execute(plan, outs := [])
    engine.steps += 1
    for o in outs:
        tokens[o.request_id] += o.new_token_ids
    assert (len(tokens["a"]), len(tokens["b"])) == (9 + 8, 1 + 8)
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    assert [tokens["a"], tokens["b"]] == refs
    assert_idle(engine)


def test_a_held_prompt_lets_the_others_burst_for_its_wait(llm, monkeypatch):
    """A prompt held for company (prefill_wait, in decode steps) does not stop the others' bursts: they run up to
    the steps its wait has left, then it is prefilled; outputs equal their solo runs."""
    import selfspec.engine.engine as engine_module

    ps = [[5, 6, 7], [8, 9, 10, 11]]
    refs = [llm.generate(p, greedy(n), gamma=0).token_ids for p, n in zip(ps, (30, 10))]
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, prefill_wait=6, decode_steps=4)
    bursts = []
    steps = engine_module.run_steps
    monkeypatch.setattr(engine_module, "run_steps", lambda *a: bursts.append(a[-1]) or steps(*a))
    engine.add_request("a", ps[0], greedy(30), gamma=0)
    tokens = {"a": [], "b": []}
    for o in engine.step():  # a prefilled, then a burst of 4
        tokens[o.request_id] += o.new_token_ids
    engine.add_request("b", ps[1], greedy(10), gamma=0)
    held_at = engine.steps
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        if tokens["b"] and held_at is not None:
            assert engine.steps - held_at >= 6  # b waited its wait out, a bursting meanwhile
            held_at = None
    assert bursts[:3] == [4, 4, 2]  # the second and third while b waits: 4, then the 2 its wait has left
    assert [tokens["a"], tokens["b"]] == refs
    assert_idle(engine)


def test_no_burst_where_a_prompt_waits_or_the_cache_is_quantized(llm, monkeypatch):
    from dataclasses import replace

    import selfspec.engine.engine as engine_module

    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, prefill_wait=8, decode_steps=8)
    engine.add_request("a", [5, 6, 7], greedy(20), gamma=0)
    engine.step()  # a prefilled; its first round ran, a burst of 8
    running, spare = list(engine.running), len(engine.cache.free_blocks)
    assert engine._burst(StepPlan([], {}, {0: running}), spare) == 8
    more = engine.cache.blocks_needed("a", 8) - engine.cache.blocks_needed("a", 1)  # 8 steps cross a 4-key block
    assert more > 0 and engine._burst(StepPlan([], {}, {0: running}), more - 1) == 1  # not spare enough
    assert engine._burst(StepPlan([], {}, {2: running}), spare) == 1  # it drafts
    assert engine._burst(StepPlan([], {}, {0: running, 2: running}), spare) == 1  # another round this step
    engine.add_request("b", [8, 9], greedy(12), gamma=0)
    engine.step()  # b waits for company to share its prefill pass (prefill_wait) while a decodes
    assert engine.waiting and engine._burst(StepPlan([], {}, {0: running}), spare) == 1  # b would wait the burst
    monkeypatch.setattr(engine_module, "run_steps", lambda *a: pytest.fail("a burst ran"))
    engine = Engine(llm, max_batch=4, block_size=4, num_blocks=80, decode_steps=1)  # off
    engine.add_request("a", [5, 6, 7], greedy(12), gamma=0)
    run(engine)
    cfg, sd, _ = tiny_model("llama", seed=1)
    quant = build(cfg, sd, None, replace(resolve_recipe("selfspec"), kv_group=16), group_size=32)
    engine = Engine(quant, max_batch=4, block_size=16, num_blocks=40, decode_steps=4)
    engine.add_request("a", [5, 6, 7], greedy(12), gamma=0)
    run(engine)
    with pytest.raises(SelfspecError, match="decode_steps must be >= 1"):
        Engine(llm, decode_steps=0)
