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
    for name in ("CHUNK_KEYS", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "MAX_REGISTERS"):  # the run sets them: restored
        monkeypatch.setattr(tqa, name, getattr(tqa, name))
    path = tmp_path / "qa.json"
    qa.main(["--tiny", "--contexts", "256", "--queries", "1", "3", "--chunk-keys", "128", "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["quant_kernel"] == {"chunk_keys": 128, "block_n": tqa.BLOCK_N, "warps": tqa.NUM_WARPS,
                                   "stages": tqa.NUM_STAGES, "max_registers": tqa.MAX_REGISTERS}
    assert tqa.CHUNK_KEYS == 128
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
