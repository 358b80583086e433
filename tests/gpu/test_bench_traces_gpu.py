"""Speculation traces on the GPU: recorded from SmolLM2 under CUDA graphs (the passes are logged through the graphed
runner), and replayed on a graphed model paying exactly the recorded draft steps and verify shapes."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import selfspec  # noqa: E402
from selfspec.bench.spec import decode_speed  # noqa: E402
from selfspec.bench.passes import PassLog, decode_rows  # noqa: E402
from selfspec.bench.traces import Round, record, replay  # noqa: E402
from selfspec.engine.graphs import GraphedModel  # noqa: E402
from selfspec.quant.modes import MODES  # noqa: E402

PROMPTS = [[{"role": "user", "content": "Repeat after me: the cat sat on the mat. The cat sat on the mat."}],
           [{"role": "user", "content": "Write a Python function that adds two numbers."}]]


@pytest.mark.parametrize("recipe", ["ngram", "planes", "hybrid"])
def test_record_on_the_graphed_runner(recipe):
    llm = selfspec.load(None, recipe, device="cuda")
    assert isinstance(llm.runner, GraphedModel)
    rounds = record(llm, PROMPTS, 4, 16)
    assert rounds and all(r.verified == r.branches * (r.width + 1) for r in rounds)
    if recipe == "ngram":
        assert all(r.draft_steps == 0 for r in rounds) and any(r.kind == "lookup" for r in rounds)
    elif recipe == "planes":
        assert all(r.draft_steps == 4 for r in rounds)
    else:  # lookup rounds where the text repeats, draft rounds elsewhere, a plain step after a lone miss
        assert {"lookup", "draft"} <= {r.kind for r in rounds} <= {"lookup", "draft", "none"}
        assert all(r.verified == 1 for r in rounds if r.kind == "none")
        assert all(r.draft_steps == (4 if r.kind == "draft" else 0) for r in rounds)


def test_replay_on_the_graphed_runner_pays_the_recorded_passes():
    llm = selfspec.load(None, "hybrid", device="cuda")
    rounds = [Round("tree", 8, 4, 2, 10, 3), Round("lookup", 4, 0, 1, 5, 4), Round("none", 0, 0, 1, 1, 0),
              Round("draft", 4, 4, 1, 5, 2), Round("tree", 8, 0, 2, 10, 2, nodes=5)]
    log = PassLog(llm.runner)
    out = decode_speed(log, llm.verify_mode, replay(rounds, MODES["upper"]), 4, 16,
                       sum(r.accepted + 1 for r in rounds), warm_tokens=1)
    timed = rounds[1:] + rounds[:1]  # the untimed run replayed round 0
    expected = [c for r in timed
                for c in [(1, 1, 0)] * r.draft_steps + [(r.branches, r.verified // r.branches, r.nodes)]]
    assert decode_rows(log.calls)[-len(expected):] == expected
    assert out["accepted"] == sum(r.accepted for r in rounds)
