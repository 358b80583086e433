"""`selfspec bench all` on the CPU with its GPU measurements stubbed: parts measured in separate calls fill one
results.json and one report (each part headed with its device), with a figure per part; the serving part's
requests follow the batch size."""
import json

import pytest
import torch

from conftest import tiny_model
from selfspec.bench import suite
from selfspec.bench.serve import bench_recipe
from selfspec.engine.llm import build
from selfspec.errors import SelfspecError
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def serve_rows():
    """Real rows of the serving benchmark: a tiny planes model, batch 1 and 2, 4 new tokens."""
    cfg, sd, _ = tiny_model("llama", seed=2, eos_token_id=None)
    llm = build(cfg, sd, None, resolve_recipe("planes", draft="w4a4"), group_size=32)
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(3, 200, (6,), generator=g).tolist() for _ in range(12)]
    return bench_recipe(llm, pool, [1, 2], SamplingParams(max_new_tokens=4, ignore_eos=True), 2, None,
                        requests_per_row=5)


def gemm_rows():
    rows = []
    for m in (1, 256):
        for mode, ms in (("full", 0.05 * m ** 0.5), ("cublas-bf16", 0.04 * m ** 0.5)):
            rows.append({"gemm": "gate/up", "n": 256, "k": 64, "storage": "planes", "mode": mode, "m": m, "ms": ms,
                         "gb_per_s": 1000.0})
    return rows


def test_parts_measured_apart_fill_one_report(tmp_path, monkeypatch, serve_rows):
    assert [r["requests"] for r in serve_rows] == [8, 10]  # max(8, 5 x batch) of the pool's 12
    devices = iter(["GPU A", "GPU B"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: next(devices))
    monkeypatch.setattr(suite, "copy_bandwidth", lambda: 3000.0)
    canned = {"gemm": gemm_rows(),
              "serve": {"model": "tiny (SYNTHETIC)", "synthetic": True, "device": "cuda", "requests": 12,
                        "requests_per_row": 5, "max_new_tokens": 4, "prompt_tokens": 6,
                        "acceptance_replayed_from": {"planes": "a trace"}, "rows": serve_rows}}
    asked = []

    def measure(part, args):
        asked.append((part, args.serve_batch_sizes))
        return canned[part]

    monkeypatch.setattr(suite, "measure", measure)
    suite.main(["--parts", "gemm", "--out", str(tmp_path)])
    suite.main(["--parts", "serve", "--out", str(tmp_path)])
    assert asked == [("gemm", [1, 8, 16, 32, 64]), ("serve", [1, 8, 16, 32, 64])]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["gemm"] == canned["gemm"] and results["serve"]["rows"] == json.loads(json.dumps(serve_rows))
    assert results["part_devices"] == {"gemm": "GPU A", "serve": "GPU B"}
    text = (tmp_path / "results.md").read_text()
    assert "## GEMM time vs M" in text and "(GPU A)" in text
    assert "## Serving" in text and "max(8, 5 x batch) of 12 requests" in text and "(GPU B)" in text
    assert "## AR decoding" not in text  # not measured, not reported
    for png in ("gemm_time_vs_m.png", "serve_vs_batch.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    assert not (tmp_path / "tokens_per_s_vs_batch.png").exists()
    with pytest.raises(SelfspecError, match="give another --out"):
        suite.main(["--parts", "gemm", "--shape", "llama-3-70b", "--out", str(tmp_path)])


def test_the_draft_model_peer_part_reports_each_recipes_mean_and_a_figure(tmp_path, monkeypatch):
    """Part draft-peer: the self-drafts and recipe draft-model replayed at the Qwen pair's shapes (stubbed here), a
    table of each recipe's mean over the tasks, the rows, and a bar figure."""
    def row(recipe, draft, task, tok_s, ar):
        return {"shape": "qwen2.5-1.5b", "recipe": recipe, "draft": draft, "verify": "full", "gamma": 5,
                "trace": f"qwen2.5-coder-1.5b/{task} ({draft}, greedy, gamma 5)", "acceptance_rate": 0.5,
                "mean_acceptance_length": 2.0, "draft_ms": 1.0, "verify_ms": 2.0, "ar_tokens_per_s": ar,
                "predicted_tokens_per_s": tok_s, "tokens_per_s": tok_s}
    rows = [row("ngram", "recycle-tree", "gsm8k", 900.0, 500.0), row("ngram", "recycle-tree", "essay", 700.0, 500.0),
            row("draft-model", "full", "gsm8k", 480.0, 480.0), row("draft-model", "full", "essay", 360.0, 480.0)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU A")
    monkeypatch.setattr(suite, "copy_bandwidth", lambda: 3000.0)
    monkeypatch.setattr(suite, "measure", lambda part, args: rows)
    suite.main(["--parts", "draft-peer", "--out", str(tmp_path)])
    text = (tmp_path / "results.md").read_text()
    assert "## Self-drafts against a draft model (qwen2.5-1.5b verifying, qwen2.5-0.5b drafting)" in text
    assert "| ngram (recycle-tree -> full) | 5 | 2 | 800.0 | 1.60x |" in text
    assert "| draft-model (full -> full) | 5 | 2 | 420.0 | 0.88x |" in text
    assert (tmp_path / "self_drafts_vs_draft_model.png").stat().st_size > 10_000
