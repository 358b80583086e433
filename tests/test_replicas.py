"""`selfspec serve --replicas 2` on a real local Ray cluster (2 CPUs, SmolLM2 on the CPU), through the official
openai client: 24 concurrent greedy requests all succeed and equal the library's solo output, /metrics sums the
replicas, and killing a replica mid-run loses no request that it had not started (only requests it was decoding
may fail, each with a clear error)."""
from __future__ import annotations

import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from ray import serve

import selfspec
from selfspec.cli import build_parser
from selfspec.serve.replicas import REPLICA_LOST, start

MODEL = "smollm2-135m"
MAX_BATCH = 4  # per replica: with 24 requests, most wait at the front when one replica is killed
N_REQUESTS = 24
# The kill test's requests: long enough that the killed replica is still decoding when it dies (6-token requests, a
# burst or two of decode steps, were sometimes all done on it by then, and no request was cut), few enough that the
# survivor serves the rest quickly; still more than both replicas' batches, so some wait at the front.
KILL_REQUESTS, KILL_TOKENS = 12, 16
OPENINGS = ["The capital of France is", "Once upon a time", "def fib(n):", "The three states of matter are",
            "Photosynthesis is", "To reverse a string in JavaScript,", "The best way to make pancakes is",
            "SELECT COUNT(*) FROM"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = build_parser().parse_args(["serve", "--replicas", "2", "--port", str(port),
                                      "--max-batch", str(MAX_BATCH)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield start(args)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2()  # what each replica loads: the default model and recipe


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    m = re.search(rf"^selfspec:{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_concurrent_requests_equal_the_library(url, llm):
    prompts = [OPENINGS[i % len(OPENINGS)] for i in range(N_REQUESTS)]
    tokens_before = metric(url, "generation_tokens_total")

    def complete(prompt: str) -> openai.types.Completion:
        return client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)

    with ThreadPoolExecutor(N_REQUESTS) as pool:
        answers = list(pool.map(complete, prompts))
    expected = {p: llm.generate(p, selfspec.SamplingParams(max_new_tokens=6)).text for p in OPENINGS}
    assert [a.choices[0].text for a in answers] == [expected[p] for p in prompts]
    generated = sum(a.usage.completion_tokens for a in answers)
    assert metric(url, "generation_tokens_total") - tokens_before == generated  # both replicas' tokens, summed
    assert metric(url, "kv_blocks_total") > 0
    assert metric(url, "kv_blocks_used") == 0  # each replica's latest state: idle again


def replica_actor_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if "EngineReplica" in a["name"] and a["namespace"] == "serve")


def test_killing_a_replica_loses_no_request_it_had_not_started(url):
    started = [threading.Event() for _ in range(KILL_REQUESTS)]

    def chat(i: int) -> tuple[str, str | None]:
        """("done", finish reason) or ("failed", message); `started[i]` is set once a replica admitted it."""
        try:
            stream = client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=KILL_TOKENS,
                temperature=0, stream=True)
            finish = None
            for chunk in stream:  # the first chunk (the role) is sent once a replica admitted the request
                started[i].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return "done", finish
        except openai.APIError as e:
            return "failed", str(e)

    names = replica_actor_names()
    assert len(names) == 2
    with ThreadPoolExecutor(KILL_REQUESTS) as pool:
        futures = [pool.submit(chat, i) for i in range(KILL_REQUESTS)]
        deadline = time.monotonic() + 60
        while sum(e.is_set() for e in started) < MAX_BATCH and time.monotonic() < deadline:
            time.sleep(0.02)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        started_at_kill = sum(e.is_set() for e in started)
        results = [f.result() for f in futures]
    assert started_at_kill < KILL_REQUESTS  # some had not started when the replica died
    failed = [(i, message) for i, (status, message) in enumerate(results) if status == "failed"]
    assert all(started[i].is_set() for i, _ in failed), "a request that had not started was lost"
    assert all(REPLICA_LOST in message for _, message in failed), failed
    assert 0 < len(failed) <= MAX_BATCH  # at most what the killed replica was decoding
    assert all(finish in ("stop", "length") for status, finish in results if status == "done")
