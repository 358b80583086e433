"""Speculation traces (selfspec/bench/traces.py) and their replay (bench/spec.py, bench/tables.py): the format round
trips and old traces load; recording logs what each round paid; a replayed round pays exactly its recorded draft
steps and verifies its recorded token count (checked through the passes the model ran); the tables' smoke run on a
tiny model fills every table."""
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from selfspec.bench import tables
from selfspec.bench.spec import decode_speed, predict, predicted_speedup, replayable_traces, unreplayable
from selfspec.bench.passes import PassLog, decode_rows
from selfspec.bench.traces import (FIELDS, TASKS, TRACE_DIR, DraftModelReplay, ReplayAcceptance, Round, Trace,
                                   from_json, load, record, record_trace, replay, trace_path)
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.quant.modes import MODES
from selfspec.speculative.recipes import resolve_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

GROUP = 32


@pytest.fixture(scope="module")
def tiny():
    cfg, sd, _ = tiny_model("llama", seed=3, eos_token_id=None)

    def make(recipe: str, draft: str | None = None, gamma: int = 4):
        r = resolve_recipe(recipe, draft, "bf16" if recipe == "ar" else None)
        return build(cfg, {k: v.clone() for k, v in sd.items()}, None, r, group_size=GROUP)
    return tables.cached(make)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """Token-id prompts that repeat a random phrase, so that lookups match, and others that need not."""
    g = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(3, 200, (int(m),), generator=g).tolist() for m in torch.randint(3, 7, (n,), generator=g)]
    return [p * 3 if i % 2 == 0 else p for i, p in enumerate(phrases)]


def test_format_round_trip(tmp_path):
    rounds = [Round("draft", 4, 4, 1, 5, 2), Round("lookup", 3, 0, 1, 4, 3), Round("tree", 8, 4, 2, 10, 1),
              Round("none", 0, 0, 1, 1, 0)]
    t = Trace("m", "hybrid", "hybrid", "full", 4, 0.5, 16, 2, "test", {"a": rounds, "b": rounds[::-1]})
    t.save(tmp_path / "t.json")
    back = load(tmp_path / "t.json")
    assert back == t and back.accepted("a") == [2, 3, 1, 0]
    d = json.loads((tmp_path / "t.json").read_text())
    assert d["version"] == 3 and d["fields"][0] == "kind"
    v2 = {**d, "version": 2, "fields": d["fields"][:-1],
          "tasks": {k: [r[:-1] for r in rs] for k, rs in d["tasks"].items()}}
    assert from_json(v2) == t  # no nodes: each round's proposed, as these rounds were built
    d["tasks"]["a"][0][d["fields"].index("accepted")] = 9  # accepted past the proposal
    with pytest.raises(SelfspecError, match="malformed trace round"):
        from_json(d)
    with pytest.raises(SelfspecError, match="trace version 7"):
        from_json({**d, "version": 7})


def test_old_traces_load():
    raw = json.loads((TRACE_DIR / "smollm2-135m.qspec.json").read_text())
    assert "version" not in raw
    t = load(TRACE_DIR / "smollm2-135m.qspec.json")
    g = raw["gamma"]
    for task, acc in raw["tasks"].items():
        assert t.accepted(task) == acc
        assert {(r.kind, r.draft_steps, r.verified) for r in t.tasks[task]} == {("draft", g, g + 1)}
    cut = Round("draft", 8, 8, 1, 9, 6).cut(3)
    assert cut == Round("draft", 3, 3, 1, 4, 3)


@pytest.mark.parametrize("path", sorted(TRACE_DIR.glob("*.json")), ids=lambda p: p.name)
def test_committed_trace_is_well_formed(path):
    """Every committed trace loads, each round's fields agree with its kind and its verify pass, no round drafts
    past the trace's gamma, and a recorded (v2, v3) trace commits the tokens it was recorded for on every task."""
    raw, t = json.loads(path.read_text()), load(path)
    assert t.tasks and set(t.tasks) <= set(TASKS) and all(t.tasks.values())
    for task, rounds in t.tasks.items():
        for r in rounds:
            assert r.verified % r.branches == 0 and r.proposed == r.verified - r.branches
            assert 0 <= r.accepted <= r.width <= t.gamma and 0 <= r.draft_steps <= r.width
            assert r.kind == ("none" if r.proposed == 0 else "tree" if r.branches > 1
                              else "draft" if r.draft_steps else "lookup"), r
            assert r.width <= r.nodes <= r.proposed if r.proposed else r.nodes == 0, r
        if raw.get("version", 1) > 1:
            committed = sum(r.accepted + 1 for r in rounds)  # per prompt: max_new_tokens, up to gamma past it
            assert t.prompts * t.max_new_tokens <= committed <= t.prompts * (t.max_new_tokens + t.gamma), task
    assert raw.get("version", 1) == 1 or raw["fields"] == list(FIELDS)[:len(raw["fields"])]
    assert (unreplayable(t) is None) == (path in replayable_traces()) == (t.recipe != "draft-model")


def test_draft_model_traces_are_named_and_skipped(tmp_path, capsys):
    from selfspec.bench.spec import measure

    rounds = [Round("draft", 3, 3, 1, 4, 2)]
    t = Trace("big", "draft-model", "full", "full", 3, prompts=1, tasks={"gsm8k": rounds}, draft_model="small")
    t.save(tmp_path / "t.json")
    assert load(tmp_path / "t.json") == t and "small full" in t.label()
    assert unreplayable(t) and replayable_traces(tmp_path) == []
    assert measure("llama-3-8b", [tmp_path / "t.json"], [2], 16) == []  # skipped before any model is built
    assert "skipping t.json: its draft steps are another model's (small)" in capsys.readouterr().out
    plain = Trace("big", "planes", "upper", "full", 3, tasks={"gsm8k": rounds})
    assert "draft_model" not in plain.to_json() and unreplayable(plain) is None


def test_recording_logs_what_each_round_paid(tiny):
    prompts = random_prompts(4, 0)
    planes = record(tiny("planes"), prompts, 3, 8)
    assert planes and {(r.kind, r.draft_steps, r.branches, r.verified) for r in planes} == {("draft", 3, 1, 4)}
    ngram = record(tiny("ngram"), prompts, 3, 8)
    assert {r.kind for r in ngram} <= {"lookup", "none"} and "lookup" in {r.kind for r in ngram}
    assert all(r.draft_steps == 0 and r.verified == r.proposed + 1 for r in ngram)
    hybrid = record(tiny("hybrid"), prompts, 3, 8)  # a lookup where it matches (no step), else 3 upper steps
    assert {(r.kind, r.draft_steps, r.branches, r.verified) for r in hybrid} == {
        ("lookup", 0, 1, 4), ("draft", 3, 1, 4)}
    tree = record(tiny("hybrid", "hybrid-tree"), prompts, 3, 8)
    assert all(r.draft_steps == 3 and r.verified == r.branches * 4 for r in tree)
    assert any(r.kind == "tree" for r in tree)
    recycled = record(tiny("ngram", "recycle-tree:6"), prompts, 3, 8)  # at most 6 distinct drafts, no step
    assert all(r.draft_steps == 0 and r.nodes <= min(6, r.proposed) for r in recycled)
    assert any(r.kind == "tree" for r in recycled)
    # Sampled recordings differ from greedy ones but hold the same kinds of rounds.
    sampled = record(tiny("planes"), prompts, 3, 8, temperature=1.0)
    assert {r.kind for r in sampled} == {"draft"} and sum(r.accepted for r in sampled) >= 0


def test_recording_a_draft_model_counts_its_steps_not_its_catch_up():
    from test_draft_model import make_llm

    t = record_trace(make_llm(), "tiny", {"a": random_prompts(2, 4)}, 3, 6, log=lambda *_: None)
    assert t.rounds() and {(r.kind, r.draft_steps, r.verified) for r in t.rounds()} == {("draft", 3, 4)}
    assert t.recipe == "draft-model" and t.draft_model == "first layer" and unreplayable(t)
    path = trace_path(Path("out"), "tiny", t.recipe, t.draft, 0.0, 3, "full", t.draft_model)
    assert path == Path("out/tiny.draft-model.first layer.w4a16.g3.json")


def test_predicted_speedup_from_step_costs(tmp_path):
    """Tokens over time: a lookup round pays its verify pass, a draft round its steps too; cut to k first."""
    rounds = [Round("lookup", 5, 0, 1, 6, 2), Round("draft", 5, 5, 1, 6, 5), Round("none", 0, 0, 1, 1, 0)]
    ms = (5 + 0.5 * 5) + (4 * 5 + 5 + 0.5 * 5) + 5  # AR 5 ms, a draft step 4, a verified token past the first 0.5
    assert predicted_speedup(rounds, 5, 5.0, 4.0, 0.5) == pytest.approx((3 + 6 + 1) * 5 / ms)
    ms3 = (5 + 0.5 * 3) + (4 * 3 + 5 + 0.5 * 3) + 5
    assert predicted_speedup(rounds, 3, 5.0, 4.0, 0.5) == pytest.approx((3 + 4 + 1) * 5 / ms3)
    plain = [Round("none", 0, 0, 1, 1, 0)] * 3
    assert predicted_speedup(plain, 5, 5.0, 4.0, 0.5) == pytest.approx(1.0)
    Trace("m", "hybrid", "hybrid", "full", 5, tasks={"gsm8k": rounds}).save(tmp_path / "a.json")
    Trace("m", "draft-model", "full", "full", 5, draft_model="small", tasks={"gsm8k": rounds}).save(tmp_path / "b.json")
    table = predict([tmp_path / "a.json", tmp_path / "b.json"], [3, 5], (5.0, 4.0, 0.5))
    assert f"| a.json | 5 | - | - | {(3 + 6 + 1) * 5 / ms:.2f}x (3.33) |" in table
    assert "| b.json | skipped: its draft steps are another model's (small)" in table


def test_replay_pays_recorded_steps_and_verifies_recorded_tokens(tiny):
    """Each replayed round: its draft steps as [1, 1] draft passes, then one verify pass of its recorded shape (rows,
    tokens per row, distinct drafts); a lookup round pays no draft step. Accepted counts are the recorded ones."""
    llm = tiny("hybrid")
    chain = [Round("lookup", 3, 0, 1, 4, 2), Round("none", 0, 0, 1, 1, 0), Round("draft", 4, 4, 1, 5, 1),
             Round("lookup", 1, 0, 1, 2, 1)]
    tree = [Round("tree", 8, 4, 2, 10, 3), Round("lookup", 4, 0, 1, 5, 4), Round("tree", 6, 0, 3, 9, 0),
            Round("tree", 8, 0, 2, 10, 2, nodes=5)]  # its branches share 3 tokens: 5 nodes run
    for rounds in (chain, tree):
        log = PassLog(llm.runner)
        drafter = replay(rounds, MODES["upper"])
        out = decode_speed(log, llm.verify_mode, drafter, 4, 6, sum(r.accepted + 1 for r in rounds), warm_tokens=1)
        # The untimed run replays the first round (one is enough for its token), the timed run every round once,
        # the cursor cycling through the trace: rounds 1.., then 0.
        calls = decode_rows(log.calls)[-sum(r.draft_steps + 1 for r in rounds):]
        timed = rounds[1:] + rounds[:1]
        expected = [c for r in timed
                    for c in [(1, 1, 0)] * r.draft_steps + [(r.branches, r.verified // r.branches, r.nodes)]]
        assert calls == expected
        assert out["accepted"] == sum(r.accepted for r in rounds) and out["rounds"] == len(rounds)
    with pytest.raises(SelfspecError, match="no draft mode"):
        decode_speed(llm.runner, llm.verify_mode, replay(chain[2:], None), 4, 6, 4)


def test_draft_model_replay_runs_its_steps_on_the_draft_model(tiny):
    """Recipe draft-model's replay: a round's draft steps are [1, 1] passes of the draft model, plus one where the
    round before accepted every draft (the draft cache's catch-up); the target runs only the verify passes."""
    from test_draft_model import make_llm

    target, draft = tiny("planes"), make_llm()
    rounds = [Round("draft", 3, 3, 1, 4, 3), Round("draft", 3, 3, 1, 4, 1), Round("draft", 2, 2, 1, 3, 0)]
    log, draft_log = PassLog(target.runner), PassLog(draft.drafter.model)
    drafter = DraftModelReplay(rounds, MODES["w4a16"], draft_log, 64)
    out = decode_speed(log, target.verify_mode, drafter, 3, 6, sum(r.accepted + 1 for r in rounds), warm_tokens=1)
    # The untimed run replays round 0; the timed run rounds 1, 2 and 0 (the cursor cycles): round 1 catches up.
    assert decode_rows(draft_log.calls)[-(1 + 3 + 2 + 3):] == [(1, 1, 0)] * 9
    assert decode_rows(log.calls)[-3:] == [(1, 4, 3), (1, 3, 2), (1, 4, 3)]
    assert drafter.steps == 3 + (1 + 3) + 2 + 3 and out["accepted"] == 4 and out["rounds"] == 3


def test_tables_smoke_fills_every_table(tiny, tmp_path):
    prompts = {"a": random_prompts(2, 1), "b": random_prompts(2, 2)}
    cells = tables.Cells(tiny, "tiny", prompts, 6, None, tmp_path / "traces", log=lambda *_: None)
    recipes = ["ngram", "hybrid", "planes"]
    result = tables.run(cells, tables.llm_target(tiny, 4), recipes, 3, [0.0, 1.0], [2, 3], ["1-3", "2-4"],
                        context=8, ar_tokens=6, log=lambda *_: None)
    t = result["tables"]
    assert [(r["recipe"], r["task"]) for r in t["1"]] == [(x, task) for x in recipes for task in prompts]
    assert [(r["recipe"], r["temperature"]) for r in t["2"]] == [(x, T) for x in recipes for T in (0.0, 1.0)]
    assert [(r["recipe"], r["draft"], r["gamma"]) for r in t["3"]] == (
        [("ngram", "ngram", 2), ("ngram", "ngram", 3), ("ngram", "ngram:1-3", 3), ("ngram", "ngram:2-4", 3)]
        + [(x, x if x == "hybrid" else "upper", g) for x in recipes[1:] for g in (2, 3)])
    for r in t["1"] + t["2"] + t["3"]:
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and 1 <= r["mean_acceptance_length"] <= r["gamma"] + 1
        # A cell replays each of its rounds once: the replay's acceptance is the trace's.
        assert r["replayed_acceptance_length"] == pytest.approx(r["mean_acceptance_length"])
    # Per recipe: T=0 at gamma 3, T=1, gamma 2; ngram:2-4 (ngram:1-3 is the default ngram's trace).
    assert len(list((tmp_path / "traces").glob("*.json"))) == 3 * 3 + 1
    md = tables.markdown(result, "tiny")
    assert all(f"## Table {i}" in md for i in (1, 2, 3)) and md.count("| ngram |") == 2 + 2 + 4
    # A second run reads the traces back from the first one's directory and records nothing; other sizes record.
    def refuse(*_):
        raise AssertionError("recorded although a matching trace was there")

    again = tables.Cells(refuse, "tiny", prompts, 6, tmp_path / "traces", tmp_path / "again")
    assert again.trace("ngram", "ngram:1-3", 0.0, 3) == cells.trace("ngram", None, 0.0, 3)
    assert again.trace("planes", None, 1.0, 3) == cells.trace("planes", None, 1.0, 3)
    with pytest.raises(AssertionError, match="recorded although"):
        tables.Cells(refuse, "tiny", prompts, 7, tmp_path / "traces", tmp_path / "again").trace("planes", None, 0, 3)


def test_replayed_acceptance_gives_a_tree_round_one_count():
    """The serving benchmark's replay gives a tree round one recorded count, on its longest branch (the first of
    them), capped at that branch's length: a count per branch would make the round the best of several recorded
    rounds."""
    acc = ReplayAcceptance([2, 0, 5])
    targets = [[10, 11], [20, 21, 22], [30, 31, 32, 33]]
    assert acc.tree([[1], [2, 3], [4, 5, 6]], targets) == (2, 2, 32)
    assert acc.tree([[1, 2, 3], [4, 5, 6]], targets[2:] + targets[2:]) == (0, 0, 30)
    assert acc.tree([[7, 8]], [[40, 41, 42]]) == (0, 2, 42)  # 5, capped at the branch's 2
    assert acc.i == 3


@pytest.mark.parametrize("extra, message", [
    (["--draft-shape", "qwen2.5-0.5b"], "draft model is not split"),
    (["--shape", "qwen2.5-0.5b", "--tensor-parallel", "3"], "--tensor-parallel 3 does not evenly split"),
])
def test_bench_spec_refuses_what_tensor_parallelism_cannot_split(extra, message):
    """`bench spec --tensor-parallel N`: a draft model's replay, or a shape N does not divide, is refused before any
    GPU or process is asked for."""
    from selfspec.bench.spec import main

    args = ["--tensor-parallel", "2"] if "--tensor-parallel" not in extra else []
    with pytest.raises(SelfspecError, match=message):
        main(args + extra)
