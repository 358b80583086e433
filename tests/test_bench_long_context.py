"""The long-context benchmark on the CPU (tiny heads and contexts, torch references): its tables, JSON and plot,
the sparse draft's keys, the cache fill, the exact KV sizes and the predicted speedups."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from selfspec import kernels
from selfspec.bench import long_context as lc
from selfspec.cache.quant_kv import QuantKVCache
from selfspec.errors import SelfspecError
from selfspec.speculative.policy import expected_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_run_prints_tables_and_writes_json_and_plot(tmp_path, capsys):
    out_json, png = tmp_path / "lc.json", tmp_path / "lc.png"
    lc.main(["--tiny", "--json", str(out_json), "--plot", str(png)])
    rows = json.loads(out_json.read_text())["rows"]
    attention = {(r["context"], r["queries"], r["kernel"]) for r in rows if r["part"] == "attention"}
    for context in lc.TINY_CONTEXTS:
        assert {(context, 1, k) for k in lc.KERNELS} <= attention
        assert {(context, 5, k) for k in lc.KERNELS if k != "sparse"} <= attention  # the sparse draft: 1 query
    assert all(r["us"] > 0 for r in rows if r["part"] == "attention")
    assert {r["format"] for r in rows if r["part"] == "memory"} == {"bf16", "int8", "hier", "sparse"}
    printed = capsys.readouterr().out
    assert "## Attention" in printed and "## KV memory" in printed and "| 512 | 1 | hier-upper |" in printed
    assert png.stat().st_size > 0


def test_fill_commits_random_groups_through_the_cache():
    h = lc.TINY
    context = 5 * h.group + 3
    cache = lc.quant_cache(h, "hier", context, 5, 1, torch.device("cpu"))
    assert (cache.length, cache.quantized) == (context, 5 * h.group)
    assert (cache.pools.k_scale[0, 0, :, :5] > 0).all() and (cache.pools.v_scale[0, 0, :, :5 * h.group] > 0).all()
    assert (cache.pools.k_scale[0, 0, :, 5:] == 0).all()  # no group past the committed ones
    assert (cache.k[0, 0, :, :context + 5 - cache.start] != 0).all()  # the buffer up to the last query's key


def test_sparse_view_reads_the_sinks_and_the_recent_window():
    h, context = lc.TINY, 300
    k, v, table = lc.paged_bf16(h, context + 1, torch.device("cpu"))
    k, v = k.float(), v.float()
    sink_blocks, window_blocks = 1, 4
    sub, at = lc.sparse_view(table, context, sink_blocks, window_blocks)
    q = torch.randn(1, h.q, 1, h.dim)
    out = kernels.lookup("attention", "", "cpu")(q, k, v, sub, torch.tensor([[at]]))
    keys = [*range(lc.BLOCK_SIZE), *range((context // lc.BLOCK_SIZE - 3) * lc.BLOCK_SIZE, context + 1)]
    slots = table[0, torch.tensor(keys) // lc.BLOCK_SIZE], torch.tensor(keys) % lc.BLOCK_SIZE
    kk, vv = (pool[slots[0], :, slots[1]].transpose(0, 1)[None] for pool in (k, v))  # [1, Hkv, keys, D]
    want = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
    torch.testing.assert_close(out, want)


def test_read_bytes_and_the_sparse_budget():
    h, pos = lc.LLAMA_3_8B, 65536
    bf16, int8, full, upper = (lc.read_bytes(h, f, u, pos) for f, u in
                               (("bf16", False), ("int8", False), ("hier", False), ("hier", True)))
    assert upper < full == int8 < bf16
    assert bf16 / upper > 3.5  # half a byte a value against two, plus scales and the bf16 buffer
    sink_blocks, window_blocks = lc.sparse_blocks(h, pos, 4)
    sparse = (sink_blocks + window_blocks) * lc.BLOCK_SIZE * h.kv * h.dim * 4
    assert sink_blocks == 1 and upper - h.kv * h.dim * 4 * lc.BLOCK_SIZE < sparse <= upper


def test_memory_is_the_cache_objects_nbytes():
    rows = lc.memory_rows(lc.LLAMA_3_8B, [8192, 131072])
    ratio = {(r["context"], r["format"]): r["x_bf16"] for r in rows}
    assert ratio[(8192, "sparse")] == 1.0 and ratio[(8192, "int8")] == ratio[(8192, "hier")]
    assert ratio[(8192, "hier")] == pytest.approx(0.563, abs=5e-4)  # the figures of docs/long-context.md
    assert ratio[(131072, "hier")] == pytest.approx(0.519, abs=5e-4)
    hier = QuantKVCache(32, 1, 8, 8192, 128, torch.bfloat16, "meta", "hier", 128).nbytes()
    assert {r["bytes"] for r in rows if (r["context"], r["format"]) == (8192, "hier")} == {hier}


def test_predictions_use_measured_steps_and_label_the_acceptance(tmp_path):
    path = tmp_path / "acceptance.jsonl"
    path.write_text('{"recipe": "selfspec", "accepted": 7, "proposed": 10, "rate": 0.7}\n')
    rates = lc.acceptance_rates(None, str(path))
    assert rates["selfspec"][0] == 0.7 and rates["quantspec"] == (lc.ASSUMED_ACCEPTANCE, "ASSUMED")
    steps = [("ar", "ar", 1, 10.0), ("selfspec", "verify", 5, 11.0), ("selfspec", "draft", 1, 4.0),
             ("quantspec", "verify", 5, 12.0), ("quantspec", "draft", 1, 5.0)]
    rows = [{"part": "steps", "recipe": r, "context": 4096, "pass": p, "tokens": t, "ms": ms} for r, p, t, ms in steps]
    pred = {r["recipe"]: r for r in lc.predictions(rows, [4], rates)}
    assert pred["selfspec"]["speedup"] == pytest.approx(expected_tokens(0.7, 4) * 10 / (4 * 4 + 11))
    assert pred["quantspec"]["speedup"] == pytest.approx(expected_tokens(0.9, 4) * 10 / (4 * 5 + 12))
    assert "ASSUMED" in lc.prediction_table(list(pred.values()))
    assert lc.acceptance_rates(0.8, str(path))["selfspec"] == (0.8, "given")


def test_predictions_mark_the_best_gamma_and_check_the_end_to_end_bar():
    """Verify passes of 2 and 4 tokens cost about the same, of 5 twice that (a second tile): with drafts at a fifth
    of an AR step gamma 3 gives the most tokens per time, neither end of the range, and the bar line reads it."""
    steps = [("ar", "ar", 1, 10.0), ("selfspec", "draft", 1, 2.0), ("selfspec", "verify", 2, 6.0),
             ("selfspec", "verify", 4, 6.5), ("selfspec", "verify", 5, 12.0)]
    rows = [{"part": "steps", "recipe": r, "context": lc.E2E_CONTEXT, "pass": p, "tokens": t, "ms": ms}
            for r, p, t, ms in steps]
    pred = lc.predictions(rows, [1, 3, 4], {"selfspec": (0.9, "given")})
    speedups = {r["gamma"]: r["speedup"] for r in pred}
    assert speedups == pytest.approx({g: expected_tokens(0.9, g) * 10 / (g * 2 + v)
                                      for g, v in ((1, 6.0), (3, 6.5), (4, 12.0))})
    assert [r["gamma"] for r in pred if r["best"]] == [max(speedups, key=speedups.get)] == [3]
    line = [x for x in lc.bar_lines(pred) if "selfspec" in x]
    assert line == [f"bar: selfspec >= 2.3x bf16 AR at 128k keys (predicted, gamma 3, acceptance 0.900 given): "
                    f"met ({speedups[3]:.2f}x)"]


@pytest.mark.parametrize("argv", [["--parts", "attention,nope"], ["--gamma", "16"], ["--acceptance", "1.5"],
                                  ["--contexts", "0"]])
def test_bad_arguments_are_clear_errors(argv):
    with pytest.raises(SelfspecError):
        lc.main(["--tiny", *argv])


def test_memory_part_runs_at_real_shapes_without_a_gpu(capsys):
    lc.main(["--parts", "memory", "--contexts", "131072"])
    assert "| 131072 | hier | 8496.00 | 0.519 | - |" in capsys.readouterr().out
