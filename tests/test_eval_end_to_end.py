"""`selfspec eval` end to end on a tiny random model and 3 items per task (fixtures written here):
per-item JSON, the summary, recipe == verify item by item, resuming from the cache, HumanEval scoring."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import selfspec.loading
from conftest import tiny_model
from selfspec.cli import main
from selfspec.eval.command import default_out_dir
from selfspec.eval.tasks import Item, humaneval
from test_cli_errors import save_byte_tokenizer

GSM8K = [{"question": "Tom has 3 apples and buys 2 more. How many apples does he have?", "answer": "3 + 2 = 5\n#### 5"},
         {"question": "A box holds 4 pens. How many pens are in 3 boxes?", "answer": "4 * 3 = 12\n#### 12"},
         {"question": "Sam had 10 cards and lost 4. How many are left?", "answer": "10 - 4 = 6\n#### 6"}]
HUMANEVAL = [{"task_id": f"Test/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n",
              "entry_point": f"f{i}", "canonical_solution": f"    return x + {i}\n",
              "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"} for i in range(3)]
MATH = [{"question": "What is $2+3$?", "answer": "5", "data_source": "MATH500", "gid": 1},
        {"question": "What is $1/2+1/2$?", "answer": "1", "data_source": "MATH500", "gid": 2},
        {"question": "Not from MATH-500.", "answer": "0", "data_source": "AIME2024", "gid": 3},
        {"question": "What is $6 \\cdot 7$?", "answer": "42", "data_source": "MATH500", "gid": 4}]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama with a byte tokenizer (long context: the 8-shot prompt is ~2,300 bytes) + data files."""
    root = tmp_path_factory.mktemp("eval")
    _, _, hf = tiny_model("llama", seed=0, max_position_embeddings=4096)
    hf.save_pretrained(root / "model")
    save_byte_tokenizer(root / "model")
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    (root / "humaneval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HUMANEVAL))
    (root / "math.json").write_text(json.dumps(MATH))
    (root / "essays.json").write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 60}))
    return root


def eval_args(root, out, *extra):
    return ["eval", "--model", str(root / "model"), "--tasks", "gsm8k,humaneval,math500,ppl", "--modes", "w4a4",
            "--recipes", "qspec,planes", "--limit", "3", "--max-new-tokens", "6", "--out", str(out),
            "--data", f"gsm8k={root / 'gsm8k.jsonl'}", "--data", f"humaneval={root / 'humaneval.jsonl'}",
            "--data", f"math500={root / 'math.json'}", "--data", f"ppl={root / 'essays.json'}", *extra]


def gsm8k_args(root, out, modes: str, recipes: str, limit: int, tokens: int) -> list[str]:
    return ["eval", "--model", str(root / "model"), "--tasks", "gsm8k", "--modes", modes, "--recipes", recipes,
            "--limit", str(limit), "--max-new-tokens", str(tokens), "--out", str(out),
            "--data", f"gsm8k={root / 'gsm8k.jsonl'}"]


def test_three_items_end_to_end_and_resume(setup, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "results"
    assert main(eval_args(setup, out)) == 0
    printed = capsys.readouterr().out
    assert "| qspec (w4a4 -> w4a16, int4" in printed and "| planes |" in printed

    # Configs: the modes, the recipes' verify modes run alone (`full` for planes), then the recipes.
    summary = json.loads((out / "summary.json").read_text())
    labels = [c["label"] for c in summary["configs"]]
    assert labels[0] == "w4a4" and "full" in labels and labels[-2:] == ["qspec", "planes"]
    for label in labels:
        for task in ("gsm8k", "humaneval", "math500"):
            records = [json.loads(line) for line in (out / label / f"{task}.jsonl").read_text().splitlines()]
            assert len(records) == 3 and all(1 <= r["stats"]["new_tokens"] <= 6 for r in records)
    math_ids = [json.loads(line)["id"] for line in (out / "w4a4" / "math500.jsonl").read_text().splitlines()]
    assert math_ids == ["math500/1", "math500/2", "math500/4"]  # the AIME item is not MATH-500
    assert not (out / "qspec" / "ppl.jsonl").exists()  # a recipe's logits are its verify mode's

    assert summary["baseline"] == "w4a4"
    for recipe in ("qspec", "planes"):
        for task, check in summary["equality"][recipe].items():
            assert check == {"compared": 3, "identical": 3, "differences": [], "other_code": 0}, (recipe, task)
        assert summary["metrics"][recipe]["gsm8k"]["acceptance_rate"] is not None
    ppl = summary["metrics"]["w4a4"]["ppl"]
    assert ppl["n"] >= 3 and 1 < ppl["score"] < 10_000

    # Run again: every item is cached, so no model may be loaded, and the summary is the same.
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: pytest.fail("loaded a model despite the cache"))
    assert main(eval_args(setup, out)) == 0
    assert json.loads((out / "summary.json").read_text())["equality"] == summary["equality"]


def test_recipe_difference_is_listed(setup, tmp_path, monkeypatch):
    """A speculative text that differs from the verify mode's is reported, not hidden."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "results"
    argv = gsm8k_args(setup, out, "", "qspec", 3, 6)
    assert main(argv) == 0
    path = out / "qspec" / "gsm8k.jsonl"
    first, *rest = path.read_text().splitlines()
    tampered = json.loads(first)
    tampered["text"] += " tampered"
    cut_short = json.dumps(tampered)[:40]  # as a run killed mid-write leaves it: ignored on resume
    path.write_text("\n".join(rest + [json.dumps(tampered), cut_short]) + "\n")
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    diffs = summary["equality"]["qspec"]["gsm8k"]["differences"]
    assert [d["id"] for d in diffs] == [tampered["id"]]
    assert "tampered" in (out / "summary.md").read_text()


def test_items_cached_by_other_code_are_generated_again(setup, tmp_path, monkeypatch):
    """The cache keys each item by the code that computes the outputs too: after a change to it, nothing cached is
    reused (a recipe would otherwise be compared with its verify mode's output from before the change)."""
    from selfspec.eval import runner

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "results"
    argv = gsm8k_args(setup, out, "w4a4", "", 2, 4)
    assert main(argv) == 0
    code = json.loads((out / "w4a4" / "gsm8k.jsonl").read_text().splitlines()[0])["settings"]["code"]
    assert code == runner.code_version() and len(code) == 16

    class Loaded(Exception):
        pass

    def load(*args):
        raise Loaded
    monkeypatch.setattr(selfspec.loading, "resolve", load)
    assert main(argv) == 0  # the same code: every item cached, no model loaded
    monkeypatch.setattr(runner, "code_version", lambda: "another version")
    with pytest.raises(Loaded):
        main(argv)


def test_a_recipe_is_compared_with_its_verify_mode_only_where_the_same_code_made_both(setup, tmp_path, monkeypatch):
    """--cached-only reports items whatever code made them, but a recipe's item is compared with its verify mode's
    only where the same code made both; a run that generates makes the stale side again."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "results"
    argv = gsm8k_args(setup, out, "", "qspec", 2, 4)
    assert main(argv) == 0
    path = out / "qspec-ar" / "gsm8k.jsonl"
    stale = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in stale:
        rec["settings"]["code"] = "older"
    path.write_text("".join(json.dumps(r) + "\n" for r in stale))
    assert main([*argv, "--cached-only"]) == 0
    check = json.loads((out / "summary.json").read_text())["equality"]["qspec"]["gsm8k"]
    assert (check["compared"], check["other_code"]) == (0, 2)
    assert "(2 by other code: not compared)" in (out / "summary.md").read_text()
    assert main(argv) == 0  # the verify items made again by this code
    check = json.loads((out / "summary.json").read_text())["equality"]["qspec"]["gsm8k"]
    assert (check["compared"], check["identical"], check["other_code"]) == (2, 2, 0)


def test_humaneval_scoring_runs_the_tests(monkeypatch):
    monkeypatch.setattr(humaneval, "TIMEOUT_S", 1.0)
    item = Item("Test/1", HUMANEVAL[1]["prompt"], HUMANEVAL[1]["test"], {"entry_point": "f1"})
    assert humaneval.score(item, HUMANEVAL[1]["canonical_solution"]) == ("passed", True)
    assert humaneval.score(item, "    return x\n") == ("failed", False)
    assert humaneval.score(item, "    while True:\n        pass\n")[1] is False


@pytest.mark.parametrize("args, needle", [
    (["--tasks", "gsm8k,nope"], "unknown task 'nope'"),
    (["--modes", "w5a5"], "unknown mode 'w5a5'"),
    (["--recipes", "ar"], "'ar' does not draft"),
    (["--recipes", "fast"], "unknown recipe 'fast'"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--data", "gsm8k"], "--data wants TASK=PATH"),
])
def test_bad_input_is_one_clean_error_before_loading(args, needle, capsys, monkeypatch):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: pytest.fail("loaded a model before checking"))
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_window_nll_matches_transformers():
    """The perplexity forward (through the engine's model, positions as model.forward takes them) equals HF's."""
    import torch

    from selfspec.engine.llm import build
    from selfspec.eval.tasks.ppl import window_nll
    from selfspec.speculative.recipes import resolve_recipe

    cfg, sd, hf = tiny_model("llama", seed=1)
    ids = list(range(3, 60))
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    llm = build(cfg, sd, None, resolve_recipe("ar", None, "fp32"))
    nll, n = window_nll(llm.model, ids, llm.verify_mode)
    assert n == len(ids) - 1
    assert abs(nll - float(expected)) < 1e-3 * float(expected)


def test_cached_only_reports_without_generating(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda *a: pytest.fail("--cached-only loaded a model"))
    out = tmp_path / "results"
    argv = ["eval", "--model", str(setup / "model"), "--tasks", "gsm8k", "--modes", "w4a4", "--recipes", "",
            "--out", str(out), "--data", f"gsm8k={setup / 'gsm8k.jsonl'}", "--cached-only"]
    assert main(argv) == 0
    assert json.loads((out / "summary.json").read_text())["metrics"]["w4a4"]["gsm8k"] == {"n": 0}


def test_default_output_is_ignored_and_published_results_are_elsewhere():
    """Running `selfspec eval` from the repository root writes where no committed file lives."""
    root = Path(__file__).resolve().parents[1]
    out = default_out_dir(None) / "summary.md"
    assert out == Path("eval-results/smollm2-135m/summary.md")
    assert (root / "docs/eval/smollm2-135m/summary.json").is_file()  # the published results
    if shutil.which("git") is None or not (root / ".git").exists():
        assert "/eval-results/" in (root / ".gitignore").read_text().split()
        return
    git = ["git", "-C", str(root)]
    assert subprocess.run([*git, "check-ignore", "-q", str(out)]).returncode == 0
    assert subprocess.run([*git, "ls-files", "eval-results"], capture_output=True, text=True).stdout == ""


def test_tensor_parallel_eval_keeps_its_results_apart(setup, tmp_path, capsys, monkeypatch):
    """`--tensor-parallel 2` (gloo on the CPU): the planes recipe equals its verify mode item by item, perplexity is
    TP1's up to the split sums, and the TP2 results are cached apart: a TP1 run finds none of them."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    args = ["eval", "--model", str(setup / "model"), "--tasks", "gsm8k,ppl", "--modes", "", "--recipes", "planes",
            "--limit", "2", "--max-new-tokens", "6", "--group-size", "16", "--data", f"gsm8k={setup / 'gsm8k.jsonl'}",
            "--data", f"ppl={setup / 'essays.json'}"]
    assert main([*args, "--out", str(tmp_path / "tp2"), "--tensor-parallel", "2"]) == 0
    tp2 = json.loads((tmp_path / "tp2" / "summary.json").read_text())
    assert tp2["equality"]["planes"]["gsm8k"] == {"compared": 2, "identical": 2, "differences": [], "other_code": 0}
    records = [json.loads(line) for line in (tmp_path / "tp2" / "planes" / "gsm8k.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["error"] is None and r["stats"]["new_tokens"] >= 1 for r in records)
    assert main([*args, "--out", str(tmp_path / "tp1")]) == 0
    tp1 = json.loads((tmp_path / "tp1" / "summary.json").read_text())
    assert tp2["metrics"]["full"]["ppl"]["score"] == pytest.approx(tp1["metrics"]["full"]["ppl"]["score"], rel=1e-3)
    shutil.copytree(tmp_path / "tp2", tmp_path / "mixed")
    assert main([*args, "--out", str(tmp_path / "mixed"), "--cached-only"]) == 0
    mixed = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    assert mixed["equality"]["planes"]["gsm8k"]["compared"] == 0
