"""The torch thread count `load` sets for CPU decoding (engine/llm.py cpu_threads)."""
import pytest
import torch

import selfspec
from conftest import tiny_model
from selfspec.engine.llm import cpu_threads
from selfspec.errors import SelfspecError


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_default_is_one_thread_unless_omp_says(monkeypatch):
    monkeypatch.delenv("SELFSPEC_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads() is None  # torch's own reading of OMP_NUM_THREADS stands
    monkeypatch.setenv("SELFSPEC_THREADS", "3")
    assert cpu_threads() == 3


@pytest.mark.parametrize("bad", ["0", "-1", "two", ""])
def test_bad_value_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv("SELFSPEC_THREADS", bad)
    with pytest.raises(SelfspecError, match="SELFSPEC_THREADS must be a whole number >= 1"):
        cpu_threads()


def test_load_sets_the_threads(monkeypatch, restore_threads):
    monkeypatch.setattr(selfspec.loading, "resolve", lambda model: (*tiny_model("llama", seed=4)[:2], None, "tiny"))
    monkeypatch.setenv("SELFSPEC_THREADS", "2")
    torch.set_num_threads(1)
    selfspec.load(group_size=32)
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("SELFSPEC_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    selfspec.load(group_size=32)
    assert torch.get_num_threads() == 1
