"""`selfspec bench replicas` on a real local Ray cluster (2 CPUs, SmolLM2 on the CPU): one replica, then two, each
kept full through the deployment's handle; every request served, and two replicas share them."""
from __future__ import annotations

import json

import pytest
import ray

from selfspec.bench.replicas import main
from selfspec.errors import SelfspecError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_and_two_replicas_serve_every_request(tmp_path, capsys):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        main(["--device", "cpu", "--replicas", "1", "2", "--batch", "2", "--requests", "3", "--max-new-tokens", "3",
              "--prompt-tokens", "12", "--json", str(tmp_path / "r.json")])
    finally:
        ray.shutdown()
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["replicas"] for r in rows] == [1, 2]
    for r in rows:  # every request of the timed run, each its 3 tokens
        assert sum(r["requests_per_replica"]) == 3 * r["replicas"] and r["tokens"] == 9 * r["replicas"]
        assert r["tokens_per_s"] > 0
    assert len(rows[1]["requests_per_replica"]) == 2  # the router sent requests to both
    assert "| 2 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--model", "smollm2-135m", "--shape", "llama-3-8b"], "pick one"),
    (["--shape", "llama-3-8b", "--device", "cpu"], "synthetic weights on the GPU"),
])
def test_bad_arguments_are_refused_before_ray_starts(argv, message):
    with pytest.raises(SelfspecError, match=message):
        main(argv)
