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
