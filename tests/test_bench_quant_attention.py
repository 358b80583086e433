"""The quantized attention benchmark on the CPU (tiny heads, torch references): its rows, table and JSON, the
tuning constants it sets, and clear errors for bad arguments."""
from __future__ import annotations

import json

import pytest

from selfspec.errors import SelfspecError

pytestmark = pytest.mark.usefixtures("one_thread")


# Imported when a test runs, not at collection: tests/test_triton_kernels.py sets TRITON_INTERPRET=1 as it is
# collected, and kernels defined before that would be compiled ones, which a CPU cannot launch.
@pytest.fixture
def qa():
    from selfspec.bench import quant_attention
    return quant_attention


@pytest.fixture
def tqa():
    from selfspec.kernels import triton_quant_attention
    return triton_quant_attention


def test_tiny_run_times_decode_and_verify_of_every_format(qa, tqa, tmp_path, capsys, monkeypatch):
    seen = {}
    rows_for = qa.rows_for

    def spy(*args):
        seen.update(chunk=tqa.CHUNK_KEYS, registers=tqa.MAX_REGISTERS)
        return rows_for(*args)

    monkeypatch.setattr(qa, "rows_for", spy)
    before = tqa.CHUNK_KEYS, tqa.BLOCK_N, tqa.NUM_WARPS, tqa.NUM_STAGES, tqa.MAX_REGISTERS
    path = tmp_path / "qa.json"
    qa.main(["--tiny", "--contexts", "256", "--queries", "1", "3", "--chunk-keys", "128", "--max-registers", "0",
             "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["quant_kernel"] == {"chunk_keys": 128, "block_n": tqa.BLOCK_N, "warps": tqa.NUM_WARPS,
                                   "stages": tqa.NUM_STAGES, "max_registers": None}
    assert seen == {"chunk": 128, "registers": None}  # the run's constants in effect while it times ...
    assert (tqa.CHUNK_KEYS, tqa.BLOCK_N, tqa.NUM_WARPS, tqa.NUM_STAGES, tqa.MAX_REGISTERS) == before  # ... only
    rows = out["rows"]
    assert {(r["queries"], r["kernel"]) for r in rows} == {(t, k) for t in (1, 3) for k in qa.KERNELS}
    assert all(r["us"] > 0 and r["x_bf16"] > 0 for r in rows)
    assert {r["x_decode"] for r in rows if r["queries"] == 1} == {1.0}
    verify = {r["kernel"]: r for r in rows if r["queries"] == 3}
    decode = {r["kernel"]: r for r in rows if r["queries"] == 1}
    assert all(verify[k]["x_decode"] == verify[k]["us"] / decode[k]["us"] for k in qa.KERNELS)
    printed = capsys.readouterr().out
    assert "| 256 | 3 | hier-upper |" in printed and "time / decode query" in printed


@pytest.mark.parametrize("argv", [["--queries", "16"], ["--block-n", "24"], ["--warps", "3"], ["--contexts", "0"]])
def test_bad_arguments_are_clear_errors(qa, argv):
    with pytest.raises(SelfspecError):
        qa.main(["--tiny", *argv])


def test_needs_a_gpu_but_tiny(qa):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SelfspecError, match="CUDA GPU"):
        qa.main(["--contexts", "16384"])
