"""Serving benchmark pieces: the closed loop on a tiny model (tokens == solo greedy, metrics), repeated AR/spec
pairs (best of each and each pair's spec/AR), the truncated ShareGPT reader, percentiles."""
import time

import pytest
import torch

from conftest import tiny_model
from selfspec.bench.serve import (HEADER, bench_recipe, make_engine, markdown_row, output_lengths, pair_speedups,
                                  percentiles, poisson_arrivals, read_json_array_head, run_load)
from selfspec.bench.traces import ReplayAcceptance, Round, serve_replay
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=1, eos_token_id=None)
    return build(cfg, sd, None, resolve_recipe("planes", draft="w4a4"), group_size=32)


def random_prompts(count):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (count,), generator=g)]


def test_closed_loop_serves_every_prompt_as_solo_greedy_would(llm):
    prompts = random_prompts(7)
    params = SamplingParams(max_new_tokens=6)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    engine = make_engine(llm, prompts, 3, 6, 4, None)  # one engine serves every run, as in bench_recipe
    for gamma in (0, None, 3):
        r = run_load(engine, prompts, params, gamma)
        assert r["tokens"] == refs
        assert r["output_tokens"] == 7 * 6 and r["tokens_per_s"] > 0
        assert r["graph_captures"] == 0 and 0 < r["slowest_step_s"] < r["wall_s"]  # CPU: no graphs
        # A burst's tokens (engine decode_steps) arrive together: many intervals are 0, not all.
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and 0 <= r["itl_s"]["p50"] < r["itl_s"]["p99"]
        if gamma is not None:
            assert r["mean_gamma"] == gamma
            assert r["drafting_share"] == (gamma > 0)
        # every request of 7 prefilled (in passes of up to 3), the batch of 3 emptying at the end
        assert 3 <= r["prefill_passes"] <= 7 and 1 < r["rows_per_verify_pass"] <= 3


def test_requests_of_their_own_lengths_make_what_their_solo_runs_make(llm):
    """--max-new-tokens-spread: each request's length drawn (seeded) from [N(1 - R), N(1 + R)], the same draw for
    every run; the closed loop serves each request its own length, AR and speculative, as its solo run."""
    lengths = output_lengths(7, 8, 0.5, seed=3)
    assert lengths == output_lengths(7, 8, 0.5, seed=3) and all(4 <= n <= 12 for n in lengths)
    assert len(set(lengths)) > 1 and output_lengths(7, 8, 0.0, seed=3) is None
    with pytest.raises(SelfspecError, match="spread of output lengths must be in"):
        output_lengths(7, 8, 1.0, seed=3)
    prompts = random_prompts(7)
    params = SamplingParams(max_new_tokens=8)
    refs = [llm.generate(p, SamplingParams(max_new_tokens=n), gamma=0).token_ids for p, n in zip(prompts, lengths)]
    engine = make_engine(llm, prompts, 3, max(lengths), 4, None)
    for gamma in (0, None):
        r = run_load(engine, prompts, params, gamma, lengths)
        assert r["tokens"] == refs and r["output_tokens"] == sum(lengths)


def test_an_open_loop_serves_requests_as_they_arrive(llm):
    """--request-rate: arrivals of a seeded Poisson process (the first at 0, mean gap 1 / rate); each request
    is submitted at its arrival, not before, and makes what its solo run makes; time to first token counts from
    the arrival, and the run lasts at least until the last one arrived."""
    arrivals = poisson_arrivals(6, 50.0, seed=2)
    assert arrivals == poisson_arrivals(6, 50.0, seed=2) and arrivals[0] == 0.0
    assert all(b > a for a, b in zip(arrivals, arrivals[1:])) and 0.02 < arrivals[-1] < 1.0
    prompts = random_prompts(6)
    params = SamplingParams(max_new_tokens=5)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    engine = make_engine(llm, prompts, 2, 5, 4, None)
    added = []
    add = engine.add_request
    engine.add_request = lambda rid, *a, **k: added.append((rid, time.perf_counter())) or add(rid, *a, **k)
    for gamma in (0, None):
        added.clear()
        start = time.perf_counter()
        r = run_load(engine, prompts, params, gamma, arrivals=arrivals)
        assert r["tokens"] == refs and r["wall_s"] >= arrivals[-1]
        assert [rid for rid, _ in added] == [str(i) for i in range(6)]
        assert all(t - start >= a for (_, t), a in zip(added, arrivals))
        assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p50"] and r["e2e_s"]["p99"] < r["wall_s"]


def test_replayed_acceptance_runs_through_the_engine(llm):
    """Each greedy round of each row accepts what the trace says (min(trace[i], k)), through the real draft,
    verify and rollback: the engine's accepted-draft count is the trace's, round for round."""
    trace = [2, 0, 3, 1, 5]
    prompts = random_prompts(5)
    engine = make_engine(llm, prompts, 3, 8, 4, ReplayAcceptance(trace))
    r = run_load(engine, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True), 3)
    rounds = engine.accept.i
    assert rounds == engine.stats().num_row_rounds > 0
    assert engine.stats().num_accepted_tokens == sum(min(trace[i % len(trace)], 3) for i in range(rounds))
    assert r["output_tokens"] == 5 * 8 and r["mean_gamma"] == 3


@pytest.mark.parametrize("tasks", [
    [[Round("tree", 9, 0, 4, 16, 2, nodes=6), Round("none", 0, 0, 1, 1, 0)], [Round("tree", 5, 0, 2, 8, 3, nodes=4)]],
    [[Round("lookup", 2, 0, 1, 3, 1), Round("none", 0, 0, 1, 1, 0)], [Round("lookup", 3, 0, 1, 4, 3)]],
], ids=["trees", "lookups"])
def test_rounds_with_no_draft_step_are_replayed_whole(llm, tasks, monkeypatch):
    """A lookup or tree trace on random prompts: the engine's drafter is the trace's replay, each sequence's round
    the recorded one at its place in the text with its recorded shape and the rest of its count, so the engine
    proposes and accepts what those rounds did (trees in shared rounds of several sequences)."""
    from selfspec.engine.engine import Engine

    drafter = llm.drafter
    llm.drafter = replay = serve_replay(tasks)
    sizes, tree_round = [], Engine._tree_round
    monkeypatch.setattr(Engine, "_tree_round",
                        lambda self, seqs, k, lock: sizes.append(len(seqs)) or tree_round(self, seqs, k, lock))
    handed, take = [], replay.take
    monkeypatch.setattr(replay, "take", lambda r, k: handed.append(take(r, k)) or handed[-1])
    try:
        prompts = random_prompts(5)
        engine = make_engine(llm, prompts, 3, 10, 3, replay)
        handed.clear()
        run_load(engine, prompts, SamplingParams(max_new_tokens=10, ignore_eos=True), 3)
    finally:
        llm.drafter = drafter
    s = engine.stats()
    assert len(handed) > 3 and not replay.due
    assert s.num_draft_tokens == sum(r.width for r in handed if r.proposed)
    assert s.num_accepted_tokens == sum(r.accepted for r in handed)
    assert (max(sizes, default=0) > 1) == (tasks[0][0].kind == "tree")


def test_a_tree_round_that_proposed_nothing_is_a_plain_step(llm):
    """Every sequence of a tree round proposed nothing: the round runs the plain decoding pass (1 token a row), not a
    tree pass padded to the graphs' width, which costs more and would be priced as a plain step by the policy."""
    drafter = llm.drafter
    llm.drafter = replay = serve_replay([[Round("tree", 0, 0, 2, 2, 0, nodes=0)]])
    try:
        prompts = random_prompts(3)
        engine = make_engine(llm, prompts, 2, 5, 3, replay)
        r = run_load(engine, prompts, SamplingParams(max_new_tokens=5, ignore_eos=True), 3)
    finally:
        llm.drafter = drafter
    shapes = [p[1] for p in r["passes"]]
    assert replay.i > 0 and r["output_tokens"] == 3 * 5
    assert not [s for s in shapes if s[0] == "tree"] and {s[1] for s in shapes if s[0] != "prefill"} == {1}


def test_a_served_sequence_reads_the_recorded_text_from_a_tasks_start():
    """The k-th sequence seen starts at task k's first round (mod the tasks); at generated token g it gets the round
    whose tokens hold its text position, accepting what remains of that round's run; past the trace it cycles."""
    from types import SimpleNamespace

    from selfspec.engine.stats import GenerationStats

    a = [Round("lookup", 3, 0, 1, 4, 2), Round("none", 0, 0, 1, 1, 0)]  # text positions 0-2, then 3
    b = [Round("lookup", 4, 0, 1, 5, 4)]  # 4-8
    replay = serve_replay([a, b])
    rows = [SimpleNamespace(stats=GenerationStats(prompt_tokens=10), length=10) for _ in range(3)]
    assert [replay.round_at(r) for r in rows] == [a[0], b[0], a[0]]  # tasks in turn
    rows[0].length = 11  # one plain step in: one of a[0]'s two accepted drafts remains
    assert replay.round_at(rows[0]) == Round("lookup", 3, 0, 1, 4, 1)
    rows[0].length = 13
    assert replay.round_at(rows[0]) == a[1]
    rows[1].length = 16  # position 4 + 6 = 10: past the trace's 9 positions, so 1 (a[0] with 1 left)
    assert replay.round_at(rows[1]) == Round("lookup", 3, 0, 1, 4, 1)
    assert replay.next_rounds(rows[:1], 1) == [a[1].cut(1)] and replay.i == 1


def test_pair_speedups_are_per_pair_not_best_of():
    runs = {"ar": [{"tokens_per_s": t} for t in (100.0, 80.0, 100.0)],
            "spec": [{"tokens_per_s": t} for t in (90.0, 96.0, 105.0)]}
    r = pair_speedups(runs)
    assert r["speedup_per_pair"] == pytest.approx([0.9, 1.2, 1.05])
    assert (r["speedup_median"], r["speedup_min"], r["speedup_max"]) == pytest.approx((1.05, 0.9, 1.2))


def test_bench_recipe_takes_the_pairs_in_turn_ar_first_and_spec_first(llm, monkeypatch):
    """AB BA AB: drift through the runs hits each side as often first as second in its pair."""
    from selfspec.bench import serve

    order = []

    def fake_run(engine, prompts, params, gamma, lengths=None, arrivals=None):
        order.append("ar" if gamma == 0 else "spec")
        return {"tokens_per_s": 1.0, "passes": [], "output_tokens": 1, "ttft_s": {}, "itl_s": {}, "mean_gamma": 0.0,
                "drafting_share": 0.0, "rows_per_verify_pass": 1.0, "prefill_passes": 1, "graph_captures": 0,
                "slowest_step_s": 0.0, "policy_end": {}}

    monkeypatch.setattr(serve, "run_load", fake_run)
    monkeypatch.setattr(serve, "bound_seconds", lambda *a: 1.0)
    monkeypatch.setattr(serve, "pass_table", lambda *a: [])
    monkeypatch.setattr(serve, "markdown_row", lambda row: "")
    serve.bench_recipe(llm, random_prompts(2), [1], SamplingParams(max_new_tokens=2), 2, None, repeats=3)
    assert order[1:] == ["ar", "spec", "spec", "ar", "ar", "spec"]  # after make_engine's warm-up run


def test_bench_recipe_reports_best_of_and_each_pair(llm):
    prompts = random_prompts(4)
    params = SamplingParams(max_new_tokens=4)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    (row,) = bench_recipe(llm, prompts, [2], params, 4, refs, repeats=3)
    runs = {side: [r["tokens_per_s"] for r in rs] for side, rs in row["all_runs"].items()}
    assert row["mismatches"] == 0
    assert row["speedup"] == pytest.approx(max(runs["spec"]) / max(runs["ar"]))
    assert row["speedup_per_pair"] == pytest.approx([s / a for a, s in zip(runs["ar"], runs["spec"])])
    assert row["speedup_min"] <= row["speedup_median"] <= row["speedup_max"]
    assert [len(rs) for rs in row["all_runs"].values()] == [3, 3]  # every run's passes, not the best's alone
    assert row["spec"]["passes"] in [r["passes"] for r in row["all_runs"]["spec"]]
    end = row["all_runs"]["spec"][-1]["policy_end"]  # what the policy priced passes and draft steps at, by size
    assert set(end) == {"acceptance", "verify_ms", "draft_ms"} and all(v > 0 for v in end["verify_ms"].values())
    assert all(v >= 0 for v in end["draft_ms"].values())
    cells = markdown_row(row).split(" | ")
    assert len(cells) == HEADER.splitlines()[0].count(" | ") + 1
    assert cells[5] == f"{row['speedup_median']:.2f}x ({row['speedup_min']:.2f}-{row['speedup_max']:.2f}, 3 pairs)"
    ar, spec = row["ar"]["ttft_s"], row["spec"]["ttft_s"]  # each side's own time to first token
    assert cells[8] == f"{row['ar']['rows_per_verify_pass']:.2f}, {row['spec']['rows_per_verify_pass']:.2f}"
    assert cells[9] == f"{ar['p50']:.2f} / {ar['p99']:.2f}, {spec['p50']:.2f} / {spec['p99']:.2f}"


def test_read_json_array_head_stops_at_a_cut_record():
    text = '[\n {"a": 1},\n {"a": [2, 3]},\n {"a": "cut'
    assert read_json_array_head(text, 10) == [{"a": 1}, {"a": [2, 3]}]
    assert read_json_array_head(text, 1) == [{"a": 1}]


def test_percentiles():
    p = percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (51.0, 91.0, 100.0, 50.5)
    assert percentiles([]) == {}


def test_cli_bench_serve_rejects_bad_sizes(capsys):
    from selfspec.cli import main

    assert main(["bench", "serve", "--batch-sizes", "1", "0"]) == 2
    assert "batch sizes" in capsys.readouterr().err
    assert main(["bench", "serve", "--shape", "llama-3-8b", "--device", "cpu"]) == 2
    assert "--device cuda" in capsys.readouterr().err
    assert main(["bench", "serve", "--requests-per-row", "0"]) == 2
    assert "--requests-per-row must be >= 1" in capsys.readouterr().err
    assert main(["bench", "serve", "--max-new-tokens-spread", "-0.5"]) == 2
    assert "spread of output lengths must be in [0, 1)" in capsys.readouterr().err
    assert main(["bench", "serve", "--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err


def test_verify_table_shows_each_pass_against_the_one_token_step():
    from selfspec.bench.steps import verify_table
    rows = [{"kind": "pass", "storage": "planes", "mode": "full", "batch": b, "tokens": t, "ms": ms}
            for b, t, ms in ((1, 1, 5.0), (1, 5, 5.5), (32, 1, 9.0), (32, 5, 27.0))]
    rows.append({"kind": "ar", "storage": "planes", "mode": "full", "batch": 32, "tokens": 1, "ms": 1.0})
    table = verify_table(rows)
    assert "| planes | full | 1 | 5.000 (1.00) | 5.500 (1.10) |" in table
    assert "| planes | full | 32 | 9.000 (1.00) | 27.000 (3.00) |" in table


def test_pass_log_counts_every_pass_of_a_run(llm):
    """The step-cost bound counts what the engine ran: AR passes are 1 token per row, a prefill pass packs the
    prompts' lengths, and the bound (each counted pass timed alone, back to back) gives a ratio to the run."""
    prompts = random_prompts(5)
    engine = make_engine(llm, prompts, 2, 4, 4, None)
    r = run_load(engine, prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), 0)
    passes = r["passes"]
    prefill = {shape: n for (_, shape), n in passes.items() if shape[0] == "prefill"}
    decode = {shape: n for (_, shape), n in passes.items() if shape[0] != "prefill"}
    assert sum(sum(lengths) * n for (_, lengths, _), n in prefill.items()) == sum(map(len, prompts))
    assert decode and all(t == 1 and rows <= 2 for rows, t in decode)
    # each request's first token comes from a prefill pass, each later one from a decode pass
    assert sum(rows * n for (rows, _), n in decode.items()) == 5 * 3
    from selfspec.bench.step_bound import bound_seconds
    costs = {}
    seconds = bound_seconds(engine, passes, 20, costs)
    assert seconds > 0 and len(costs) == len(passes)
    assert bound_seconds(engine, passes, 20, costs) == seconds  # each shape timed once


def test_bench_recipe_reports_the_step_cost_bound(llm):
    prompts = random_prompts(3)
    (row,) = bench_recipe(llm, prompts, [2], SamplingParams(max_new_tokens=3), 4, None)
    for side in ("ar", "spec"):
        run = row[side]
        assert run["step_bound_tokens_per_s"] > 0 and run["preemptions"] == 0
        assert sum(p["ms_total"] for p in run["passes"]) == pytest.approx(1e3 * run["output_tokens"]
                                                                         / run["step_bound_tokens_per_s"])
        assert run["of_step_bound"] == pytest.approx(run["tokens_per_s"] / run["step_bound_tokens_per_s"])


def test_a_recycled_tree_serves_through_the_pass_log_and_its_tree_passes_are_timed(llm):
    """A lone sequence's tree round (a shared-row, node-packed pass: `tree=`) goes through the bench's PassLog, which
    counts it by rows, width and nodes; every request is its solo greedy output (a pass the log refused used to end
    the request with an error, one token short of it) and the bound times the tree passes too."""
    from selfspec.bench.step_bound import bound_seconds
    from selfspec.speculative.drafters import make_drafter

    drafter, llm.drafter = llm.drafter, make_drafter("recycle-tree:6")
    try:
        prompts = [p * 3 for p in random_prompts(4)]  # repeating texts: the recycled tree drafts and accepts
        params = SamplingParams(max_new_tokens=12)
        refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
        engine = make_engine(llm, prompts, 1, 12, 4, None)  # one sequence a round: shared rows
        r = run_load(engine, prompts, params, 4)
        assert r["tokens"] == refs
        trees = {shape: n for (_, shape), n in r["passes"].items() if shape[0] == "tree"}
        # rows as wide as the deepest round (max_gamma 4 and the pending token: the engine's one width of graphs)
        assert trees and all(shared and rows >= 1 and nodes >= 1 and width == 5
                             for _, rows, width, nodes, shared in trees)
        costs = {}
        assert bound_seconds(engine, r["passes"], 20, costs) > 0 and len(costs) == len(r["passes"])
    finally:
        llm.drafter = drafter


@pytest.mark.parametrize("shape", [("tree", 3, 9, 3, True), ("tree", 4, 9, 20, True), ("tree", 2, 5, 9, False),
                                   ("tree", 16, 9, 128, True), ("tree", 12, 9, 10, True)])
def test_tree_pass_shapes_of_several_sequences_are_timed(llm, shape):
    """A shared tree pass of several sequences logs rows padded to the engine's one width, possibly wider than its
    nodes are deep (three sequences proposing nothing: 3 rows of 9 over 3 nodes): the bound rebuilds a pass of that
    shape within its blocks and times it."""
    from selfspec.bench.step_bound import pass_seconds
    from selfspec.speculative.drafters import SHARED_TREE_BATCH

    engine = make_engine(llm, random_prompts(2), 2, 4, 8, None)
    runner, layouts = engine.runner, []
    engine.runner = lambda *args: layouts.append(args[-1]) or runner(*args)
    assert pass_seconds(engine, llm.verify_mode, shape, context=45, repeats=1) > 0
    _, rows, width, nodes, shared = shape
    tree = layouts[-1]
    assert tree.rows.shape == (rows, width) and len(tree.first) == nodes
    # shared rows: as many sequences as a round of them holds (a graph's static starts hold no more)
    assert tree.starts is None if not shared else len(tree.starts) - 1 == min(rows, SHARED_TREE_BATCH)


def test_bench_recipe_serves_requests_of_their_own_lengths_as_they_arrive(llm):
    prompts = random_prompts(4)
    lengths = output_lengths(4, 6, 0.5, seed=1)
    params = SamplingParams(max_new_tokens=6)
    refs = [llm.generate(p, SamplingParams(max_new_tokens=n), gamma=0).token_ids for p, n in zip(prompts, lengths)]
    (row,) = bench_recipe(llm, prompts, [2], params, 4, refs, lengths=lengths, rate=200.0, seed=1)
    assert row["mismatches"] == 0
    assert row["ar"]["output_tokens"] == row["spec"]["output_tokens"] == sum(lengths)
