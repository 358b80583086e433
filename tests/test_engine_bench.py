"""Serving benchmark pieces: the closed loop on a tiny model (tokens == solo greedy, metrics), the truncated
ShareGPT reader, percentiles."""
import pytest
import torch

from conftest import tiny_model
from selfspec.bench.serve import percentiles, read_json_array_head, run_closed_loop
from selfspec.engine.llm import build
from selfspec.spec.recipes import resolve_recipe
from selfspec.spec.sampling import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


def test_closed_loop_serves_every_prompt_as_solo_greedy_would():
    cfg, sd, _ = tiny_model("llama", seed=1, eos_token_id=None)
    llm = build(cfg, sd, None, resolve_recipe("planes", draft="w4a4"), group_size=32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (7,), generator=g)]
    refs = [llm.generate(p, SamplingParams(max_new_tokens=6), gamma=0).token_ids for p in prompts]
    for gamma in (0, None, 3):
        r = run_closed_loop(llm, prompts, batch=3, max_new_tokens=6, gamma=gamma, max_gamma=4)
        assert r["tokens"] == refs
        assert r["output_tokens"] == 7 * 6 and r["tokens_per_s"] > 0
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["itl_s"]["p50"] > 0
        if gamma is not None:
            assert r["mean_gamma"] == gamma


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
