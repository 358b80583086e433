"""`selfspec eval` generates through the batched engine: its records equal solo `LLM.generate` item by item,
an interrupted run resumes with only the missing items, and a failing item is recorded while the rest finish."""
from __future__ import annotations

import json

import pytest

import selfspec
from selfspec.eval import runner
from selfspec.eval.report import markdown, summarize
from selfspec.eval.runner import ResultCache, encode, plan_configs, run_eval, run_generation
from selfspec.eval.tasks import Item, get_task
from selfspec.speculative.sampling import SamplingParams
from test_eval_end_to_end import setup  # noqa: F401  (the tiny model + data files fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(setup):  # noqa: F811
    return selfspec.load(str(setup / "model"), "qspec", gamma=2)


def items(setup, task):  # noqa: F811
    path = {"gsm8k": setup / "gsm8k.jsonl", "math500": setup / "math.json"}[task]
    return get_task(task).load_items(path, chat=False)


@pytest.mark.parametrize("task", ["gsm8k", "math500"])
@pytest.mark.parametrize("gamma", [0, 2])
def test_batched_records_equal_solo_generation(llm, setup, tmp_path, task, gamma):  # noqa: F811
    """Batch of 2 over 3 items (one joins as another leaves): the same text, answer and length as solo."""
    module, todo = get_task(task), items(setup, task)
    cache = ResultCache(tmp_path / "out.jsonl", {})
    run_generation(llm, module, todo, cache, max_new_tokens=8, gamma=gamma, batch_size=2, label="test")
    params = SamplingParams(max_new_tokens=8, stop=list(module.STOP))
    for it in todo:
        solo = llm.generate(encode(llm, it.prompt), params, gamma=gamma)
        rec = cache.records[it.id]
        assert (rec["text"], rec["answer"], rec["error"]) == (solo.text, module.score(it, solo.text)[0], None)
        assert rec["stats"]["new_tokens"] == solo.stats.new_tokens
        assert (rec["stats"]["draft_proposed"] > 0) == (gamma > 0)


def test_interrupted_run_resumes_with_only_the_missing_items(setup, tmp_path, monkeypatch):  # noqa: F811
    """Killed after the first finished item: that item is in the cache, and the rerun generates the other two."""
    batched, asked = runner.generate_batched, []

    def interrupted(llm, prompts, *args):
        yield next(batched(llm, prompts, *args))
        raise KeyboardInterrupt

    def spy(llm, prompts, *args):
        asked.extend(prompts)
        return batched(llm, prompts, *args)

    out = tmp_path / "results"
    kwargs = dict(limit=3, max_new_tokens=6, data={"gsm8k": setup / "gsm8k.jsonl"}, batch_size=3)
    monkeypatch.setattr(runner, "generate_batched", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_eval(str(setup / "model"), ["gsm8k"], ["w4a4"], [], out, **kwargs)
    done = [json.loads(line)["id"] for line in (out / "w4a4" / "gsm8k.jsonl").read_text().splitlines()]
    assert len(done) == 1

    monkeypatch.setattr(runner, "generate_batched", spy)
    results = run_eval(str(setup / "model"), ["gsm8k"], ["w4a4"], [], out, **kwargs)
    assert sorted(asked) == sorted({"gsm8k/0", "gsm8k/1", "gsm8k/2"} - set(done))
    assert [r["id"] for r in results["w4a4"]["gsm8k"]] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]


def test_failing_items_are_recorded_and_the_others_finish(llm, setup, tmp_path, monkeypatch):  # noqa: F811
    """One item fails inside the engine (detokenizing), one cannot be encoded (longer than the context): both
    are cached with their error, scored wrong, listed in the report and generated again by the next run."""
    module, todo = get_task("math500"), items(setup, "math500")
    lengths = {it.id: len(encode(llm, it.prompt)) for it in todo}
    assert len(set(lengths.values())) == len(todo)  # the failure below picks out exactly one item
    append = llm.append_tokens

    def failing(out, chunk, params):
        if out.stats.prompt_tokens == lengths["math500/2"]:
            raise ValueError("cannot detokenize")
        return append(out, chunk, params)

    monkeypatch.setattr(llm, "append_tokens", failing)
    too_long = Item("math500/long", "What is 1+1? " * 400, "2")
    cache = ResultCache(tmp_path / "out.jsonl", {})
    run_generation(llm, module, todo + [too_long], cache, max_new_tokens=6, gamma=2, batch_size=4, label="test")

    recs = cache.records
    assert "cannot detokenize" in recs["math500/2"]["error"] and "context window" in recs["math500/long"]["error"]
    for bad in ("math500/2", "math500/long"):
        assert (recs[bad]["finish_reason"], recs[bad]["correct"], cache.done(bad)) == ("error", False, False)
    for good in ("math500/1", "math500/4"):
        assert recs[good]["error"] is None and recs[good]["stats"]["new_tokens"] >= 1 and cache.done(good)

    [cfg] = plan_configs(["w4a16"], [])
    summary = summarize([cfg], {"w4a16": {"math500": list(recs.values())}}, ["math500"])
    assert summary["metrics"]["w4a16"]["math500"]["errors"] == 2
    assert {f["id"] for f in summary["failures"]} == {"math500/2", "math500/long"}
    assert "cannot detokenize" in markdown(summary, ["math500"])

