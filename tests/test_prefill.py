"""Prefill on tiny random models: logits only where asked (the head runs on those rows only), bitwise equal to the
full forward's at those positions."""
import pytest
import torch

from conftest import tiny_model
from selfspec.engine.engine import Engine
from selfspec.engine.llm import build
from selfspec.spec.recipes import resolve_recipe
from selfspec.spec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=2)
    return build(cfg, sd, None, resolve_recipe("planes", draft="w4a4"), group_size=32)


def record_head_inputs(model, monkeypatch) -> list[tuple[int, ...]]:
    """Shapes of the hidden states the head is run on, one per forward."""
    shapes, logits = [], model.logits

    def recording(hidden, mode):
        shapes.append(tuple(hidden.shape))
        return logits(hidden, mode)

    monkeypatch.setattr(model, "logits", recording)
    return shapes


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["verify", "draft"])
def test_logits_at_selected_positions_equal_the_full_forward(llm, mode, monkeypatch):
    model, mode = llm.model, getattr(llm, f"{mode}_mode")
    tokens = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 5, 11])[:, None] + torch.arange(7)  # each row its own positions
    full = model(tokens, pos, model.new_cache(32, batch=3), mode)
    at = torch.tensor([6, 7 + 2, 14 + 6])  # row 0's last, row 1's third, row 2's last token
    shapes = record_head_inputs(model, monkeypatch)
    cache = model.new_cache(32, batch=3)
    picked = model(tokens, pos, cache, mode, logits_at=at)
    assert shapes == [(3, model.cfg.dim)]  # the head saw 3 rows, not 3 x 7
    assert torch.equal(picked, full.reshape(-1, full.shape[-1])[at])  # 21 rows: row by row on the CPU, as full


def test_solo_prefill_runs_the_head_on_the_last_position_only(llm, monkeypatch):
    prompt = list(range(10, 40))
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    want = llm.model(torch.tensor([prompt]), torch.arange(30), llm.model.new_cache(32), llm.verify_mode)
    shapes = record_head_inputs(llm.model, monkeypatch)
    assert llm.generate(prompt, params, gamma=0).token_ids == [int(want[0, -1].argmax())]
    assert shapes == [(1, llm.model.cfg.dim)]


def test_engine_prefill_runs_the_head_on_rows_that_draw_a_token_only(llm, monkeypatch):
    """Two short prompts complete in the first chunk; the long one is prefilled in the next two chunks and
    draws its token in the last: the head sees 2 rows, then none, then 1; the tokens are the solo greedy ones."""
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5], list(range(10, 40))]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    refs = [llm.generate(p, params, gamma=0).token_ids for p in prompts]
    engine = Engine(llm, max_batch=3, block_size=4, num_blocks=40, prefill_chunk=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, gamma=0)
    shapes = record_head_inputs(llm.model, monkeypatch)
    out = run(engine)
    assert shapes == [(2, llm.model.cfg.dim), (1, llm.model.cfg.dim)]
    assert out == {str(i): ref for i, ref in enumerate(refs)}


def run(engine) -> dict[str, list[int]]:
    tokens = {}
    while engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens
