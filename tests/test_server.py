"""`selfspec serve` against a live uvicorn on 127.0.0.1 with SmolLM2 on the CPU: the official openai client
(completions, chat, streamed and not), batching is lossless across 32 concurrent streams, disconnects free their
KV blocks, every bad input (fuzzed too) gets its 4xx and an OpenAI error body, big bodies get 413 and long prompts
never stall the event loop, failures stay inside their request, a full queue answers 429, shutdown drains (503 to
new requests, clean errors past the timeout), and small load tests (one with injected faults and a SIGTERM) end
with the blocks back to idle."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selfspec
from selfspec.bench.prompts import PROMPTS
from selfspec.cli import build_parser, main
from selfspec.engine.engine import Engine
from selfspec.serve.app import create_app
from selfspec.serve.loadtest import inject_faults, run_load
from selfspec.serve.server import FLUSH_TIMEOUT_S, DrainingServer, build_engine

MODEL = "smollm2-135m"
TIMEOUT_S = 120

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class LiveServer:
    url: str
    engine: Engine
    server: uvicorn.Server
    thread: threading.Thread

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics").text
        m = re.search(rf"^selfspec:{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@contextmanager
def serving(engine: Engine, drain_timeout_s: float = 30.0,
            flush_timeout_s: float = FLUSH_TIMEOUT_S) -> Iterator[LiveServer]:
    """What `selfspec serve` runs, on a free port; uvicorn's log records reach pytest (log_config=None)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, MODEL)
    config = uvicorn.Config(app, log_level="warning", log_config=None, timeout_graceful_shutdown=flush_timeout_s)
    server = DrainingServer(config, app.state.runner, drain_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the server did not start")
    try:
        yield LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, server, thread)
    finally:
        server.should_exit = True
        thread.join(60)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def wait_idle(srv: LiveServer, timeout_s: float = 30) -> None:
    """Nothing waits or runs and every KV block is back in the pool."""
    wait_until(lambda: srv.metric("kv_blocks_used") == 0 and srv.metric("num_requests_running") == 0
               and srv.metric("num_requests_waiting") == 0, timeout_s, "KV blocks did not return to idle")


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2()  # what `selfspec serve` loads: the default model and recipe


@pytest.fixture(scope="module")
def srv(llm):
    with serving(Engine(llm, max_batch=32)) as live:
        yield live


# Openings a plain (non-chat) continuation goes on from: a bare question often ends at once with EOS.
OPENINGS = ["The capital of France is", "Once upon a time", "def fib(n):", "The three states of matter are",
            "Photosynthesis is", "To reverse a string in JavaScript,", "The best way to make pancakes is",
            "SELECT COUNT(*) FROM"]


def solo(llm, prompt: str, max_tokens: int, chat: bool = False) -> str:
    """What one greedy request gives through the library alone (no server, no batching)."""
    return llm.generate(prompt, selfspec.SamplingParams(max_new_tokens=max_tokens), chat=chat).text


def test_health_and_models(srv):
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    assert [m.id for m in srv.client().models.list().data] == [MODEL]


def test_completion_and_chat_match_the_library(srv, llm):
    client, question, prompt = srv.client(), PROMPTS[0], OPENINGS[0]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert done.choices[0].text and done.choices[0].text == solo(llm, prompt, 8)
    assert done.choices[0].finish_reason in ("stop", "length")
    u = done.usage
    assert (u.prompt_tokens, u.total_tokens) == (len(llm.encode(prompt)), u.prompt_tokens + u.completion_tokens)
    assert 0 <= u.accepted_tokens <= u.draft_tokens and u.mean_acceptance_length >= 1

    messages = [{"role": "user", "content": question}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].message.content == solo(llm, question, 8, chat=True)
    assert chat.usage.prompt_tokens == len(llm.encode(question, chat=True))

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    wait_idle(srv)


def test_16_concurrent_streams_each_get_the_solo_text(srv, llm):
    # 4 distinct prompts (the solo references are the slow part on a CPU), 4 clients each: 2 chat, 2 completion
    jobs = [(PROMPTS[1 + i % 4], True) if i % 2 else (OPENINGS[i % 4], False) for i in range(16)]
    expected = {(p, chat): solo(llm, p, 10, chat) for p, chat in set(jobs)}
    assert all(expected.values())

    async def one(client: openai.AsyncOpenAI, prompt: str, chat: bool) -> str:
        if chat:
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                          max_tokens=10, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        async with client:
            return await asyncio.gather(*(one(client, p, chat) for p, chat in jobs))

    got = asyncio.run(all_at_once())
    assert got == [expected[job] for job in jobs]
    wait_idle(srv)


def test_serve_recipe_selfspec_gives_the_library_text(smollm2_resolved, monkeypatch):
    """`selfspec serve --recipe selfspec` (INT8-plane weights, hierarchical INT8 KV; groups of 16 tokens here, so
    the buffers roll over within the prompts): concurrent greedy completions equal the library's solo ones."""
    cfg, sd, tok, desc = smollm2_resolved
    weights = lambda: {k: t.clone() for k, t in sd.items()}  # noqa: E731 (load quantizes its own copy)
    monkeypatch.setattr("selfspec.loading.resolve", lambda name: (cfg, weights(), tok, desc))
    engine = build_engine(build_parser().parse_args(["serve", "--recipe", "selfspec", "--kv-group", "16", "--gamma",
                                                     "3", "--max-batch", "4"]))
    prompts = [" ".join(OPENINGS[i:] + OPENINGS[:i]) for i in range(2)]  # over 2 groups of tokens each
    assert all(len(engine.llm.encode(p)) > 32 for p in prompts)
    expected = [solo(engine.llm, p, 10) for p in prompts]
    with serving(engine) as live:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: live.client().completions.create(
                model=MODEL, prompt=p, max_tokens=10, temperature=0, extra_body={"gamma": 3}).choices[0].text, prompts))
        assert got == expected and all(expected)
        wait_idle(live)


def test_disconnect_cancels_the_sequence_and_frees_its_blocks(srv):
    aborted = srv.metric("request_success_total", '{finished_reason="abort"}')
    long = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**long, "stream": True}, timeout=TIMEOUT_S) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert srv.metric("kv_blocks_used") > 0  # the stream holds blocks while it runs
    wait_idle(srv)
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(f"{srv.url}/v1/completions", json=long, timeout=3)
    # Seen within a poll even while tokens arrive faster than the poll (400 tokens would take ~40 s to finish).
    wait_idle(srv, timeout_s=5)
    assert srv.metric("request_success_total", '{finished_reason="abort"}') == aborted + 2


GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}


def raw(body: dict, extra: str) -> str:
    """`body` as JSON text with `extra` (raw JSON members, e.g. NaN that json.dumps would not write) appended;
    a later duplicate key wins, as in Python's json."""
    return json.dumps(body)[:-1] + ", " + extra + "}"

BAD_INPUTS = [  # (what, path, body (dict, or raw text), status, error param or code that must be named)
    ("malformed JSON", "completions", '{"model": "x", "prompt": ', 400, None),
    ("body is a list", "completions", "[1, 2]", 400, None),
    ("no prompt", "completions", {"model": MODEL}, 400, "prompt"),
    ("unknown model", "completions", {**GOOD, "model": "gpt-5"}, 404, "model_not_found"),
    ("unknown model (chat)", "chat/completions", {**CHAT, "model": "gpt-5"}, 404, "model_not_found"),
    ("max_tokens a string", "completions", {**GOOD, "max_tokens": "8"}, 400, "max_tokens"),
    ("max_tokens a float", "completions", {**GOOD, "max_tokens": 8.5}, 400, "max_tokens"),
    ("temperature a string", "completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("prompt a number", "completions", {**GOOD, "prompt": 5}, 400, "prompt"),
    ("stream a string", "completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("messages a string", "chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("unknown role", "chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    ("no messages", "chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("max_tokens 0", "completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "chat/completions", {**CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens beyond the context", "completions", {**GOOD, "max_tokens": 9000}, 400, "context_length_exceeded"),
    ("prompt too long", "completions", {**GOOD, "prompt": [1] * 8192}, 400, None),
    ("token id outside the vocabulary", "completions", {**GOOD, "prompt": [1, 999999]}, 400, "prompt"),
    ("empty prompt", "completions", {**GOOD, "prompt": "  "}, 400, "prompt"),
    ("negative temperature", "completions", {**GOOD, "temperature": -1}, 400, None),
    ("top_p 0", "completions", {**GOOD, "top_p": 0}, 400, None),
    ("top_p above 1", "chat/completions", {**CHAT, "top_p": 1.5}, 400, None),
    ("negative top_k", "completions", {**GOOD, "top_k": -1}, 400, None),
    ("gamma too large", "completions", {**GOOD, "gamma": 999}, 400, None),
    ("n > 1", "completions", {**GOOD, "n": 2}, 400, "n"),
    ("n > 1 (chat)", "chat/completions", {**CHAT, "n": 3}, 400, "n"),
    ("empty stop string", "completions", {**GOOD, "stop": [""]}, 400, "stop"),
    ("unknown parameter", "completions", {**GOOD, "frobnicate": 1}, 400, None),
    ("unsupported logprobs", "completions", {**GOOD, "logprobs": 5}, 400, None),
    ("batch of prompts", "completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    # Python's json reads NaN / Infinity and lone "\ud800" escapes: each must be refused before the engine
    ("temperature NaN", "completions", raw(GOOD, '"temperature": NaN'), 400, "temperature"),
    ("temperature NaN, streamed", "completions", raw(GOOD, '"temperature": NaN, "stream": true'), 400,
     "temperature"),
    ("temperature NaN (chat)", "chat/completions", raw(CHAT, '"temperature": NaN'), 400, "temperature"),
    ("temperature Infinity", "completions", raw(GOOD, '"temperature": Infinity'), 400, "temperature"),
    ("temperature 1e-45", "completions", {**GOOD, "temperature": 1e-45}, 400, "temperature"),
    ("top_p 1e-100", "completions", {**GOOD, "top_p": 1e-100}, 400, "top_p"),
    ("seed beyond 64 bits", "completions", {**GOOD, "seed": 1180591620717411303424}, 400, "seed"),
    ("seed beyond 64 bits (chat)", "chat/completions", {**CHAT, "seed": -(1 << 64)}, 400, "seed"),
    ("lone surrogate in the prompt", "completions", raw(GOOD, '"prompt": "a\\ud800b"'), 400, None),
    ("lone surrogate in chat content", "chat/completions",
     raw(CHAT, '"messages": [{"role": "user", "content": "\\udfff"}]'), 400, None),
    ("lone surrogate in the model name", "completions", raw(GOOD, '"model": "\\ud800"'), 400, None),
    ("lone surrogate in a stop string", "completions", raw(GOOD, '"stop": ["\\ud800"]'), 400, None),
    ("lone surrogate in a key", "completions", raw(GOOD, '"\\ud800": 1'), 400, None),
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(srv):
    for what, path, body, status, named in BAD_INPUTS:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(f"{srv.url}/v1/{path}", content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, (what, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (what, error)
        assert named is None or named in (error["param"], error["code"]), (what, error)
    r = httpx.get(f"{srv.url}/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert srv.metric("request_rejected_total", '{status="400"}') >= len(BAD_INPUTS) - 2
    assert srv.client().completions.create(**GOOD).choices[0].finish_reason in ("stop", "length")
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT).status_code == 200
    wait_idle(srv)


# Any JSON value, the awkward ones often: NaN / inf, ints past 64 bits, lone surrogates, nesting.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=1 << 63),
                    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-45, 1e308]),
                    st.text(max_size=8), st.sampled_from(["\ud800", "a\udfffb", "", " "]))
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
# Token budgets: refused (< 1, beyond the context) or small, so a body that passes validation generates little.
MAX_TOKENS = st.one_of(st.integers(max_value=0), st.integers(min_value=10_000), st.integers(1, 2), ANY_JSON)
TEXT = st.one_of(st.text(max_size=24), st.sampled_from(["Hello", "\ud800", "  ", "a\udc00"]))
MESSAGE = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                           "content": TEXT | st.lists(st.fixed_dictionaries(
                                               {"type": st.just("text"), "text": TEXT}), max_size=2) | ANY_JSON}),
                    ANY_JSON)
FIELDS = {  # each field: a plausible value often, any JSON value otherwise
    "model": st.just(MODEL) | TEXT | ANY_JSON,
    "temperature": st.floats(0, 2) | ANY_JSON, "top_p": st.floats(0, 1) | ANY_JSON,
    "top_k": st.integers(-2, 50) | ANY_JSON, "seed": st.integers(-(1 << 64), 1 << 64) | ANY_JSON,
    "stop": TEXT | st.lists(TEXT, max_size=3) | ANY_JSON, "n": st.integers(0, 2) | ANY_JSON,
    "stream": st.booleans() | ANY_JSON, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})
    | ANY_JSON, "gamma": st.integers(-1, 20) | ANY_JSON, "ignore_eos": st.booleans() | ANY_JSON,
    "user": ANY_JSON, "logprobs": ANY_JSON, "frobnicate": ANY_JSON,
}
ROUTES = {
    "completions": {"prompt": TEXT | st.lists(st.integers(-5, 70_000), max_size=12) | st.lists(TEXT, max_size=2)
                    | ANY_JSON, "max_tokens": MAX_TOKENS},
    "chat/completions": {"messages": st.lists(MESSAGE, max_size=3) | ANY_JSON, "max_tokens": MAX_TOKENS,
                         "max_completion_tokens": MAX_TOKENS},
}


@st.composite
def bodies(draw, route: str) -> object:
    """Mostly a valid request with one to three fields set to drawn values (so each odd value meets the code
    behind validation too), sometimes any JSON value."""
    if draw(st.integers(0, 9)) == 0:
        return draw(ANY_JSON)
    fields = {**FIELDS, **ROUTES[route]}
    body = dict(GOOD if route == "completions" else CHAT)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        body[name] = draw(fields[name])
    return body


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_no_body_gets_a_server_error(srv, route):
    """Whatever the client sends, it gets a 2xx or a 4xx with an OpenAI error body; a 200 stream holds no error
    event and ends with [DONE]."""
    http = httpx.Client(base_url=srv.url, timeout=TIMEOUT_S)

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(bodies(route))
    def check(body: object) -> None:
        content = json.dumps(body)  # writes NaN / Infinity and "\ud800" escapes as Python's json reads them
        with http.stream("POST", f"/v1/{route}", content=content,
                         headers={"content-type": "application/json"}) as r:
            text = r.read().decode()
        assert r.status_code < 500, (r.status_code, text)
        if r.status_code >= 400:
            error = json.loads(text)["error"]
            assert error["message"] and error["type"] == "invalid_request_error", error
        elif r.headers["content-type"].startswith("text/event-stream"):
            events = [line for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events[:-1]), text

    with http:
        check()
    wait_idle(srv)


# Sends one completion whose prompt is "hello world " * N (12 bytes each) from another process, so that building
# and sending it does not compete with the server for this process's GIL; prints the status and error code.
SEND_PROMPT = """
import httpx, json, sys
url, framing, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = json.dumps({"model": "%s", "prompt": "hello world " * repeats, "max_tokens": 1}).encode()
print("ready", flush=True)
content = body if framing == "content-length" else iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
r = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=120)
print(r.status_code, r.json()["error"]["code"], flush=True)
""" % MODEL


def health_latency_while_sending(srv: LiveServer, framing: str, repeats: int) -> tuple[float, str]:
    """(slowest /health answer in seconds, the sender's "status code") while one big prompt is sent and answered."""
    sender = subprocess.Popen([sys.executable, "-c", SEND_PROMPT, srv.url, framing, str(repeats)],
                              stdout=subprocess.PIPE, text=True)
    assert sender.stdout.readline() == "ready\n"
    slowest = 0.0
    with httpx.Client(base_url=srv.url) as http:
        while sender.poll() is None:
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            slowest = max(slowest, time.perf_counter() - start)
            time.sleep(0.01)
    return slowest, sender.stdout.read().strip()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413_and_health_stays_fast(srv, framing):
    rejected = srv.metric("request_rejected_total", '{status="413"}')
    slowest, answer = health_latency_while_sending(srv, framing, 440_000)  # 5.3 MB, over the 1 MiB default
    assert answer == "413 request_too_large"
    assert slowest < 0.1, f"/health took {slowest * 1000:.0f} ms"
    assert srv.metric("request_rejected_total", '{status="413"}') == rejected + 1


def test_a_long_prompt_is_tokenized_off_the_event_loop(srv):
    slowest, answer = health_latency_while_sending(srv, "content-length", 80_000)  # 960 KB: ~0.5 s to tokenize
    assert answer.startswith("400 ")  # the prompt is longer than the context
    assert slowest < 0.1, f"/health took {slowest * 1000:.0f} ms"


def test_a_failing_request_fails_alone(srv, llm, monkeypatch):
    real_append = llm.append_tokens

    def append_or_fail(out, chunk, params):  # fails only the request that asks for it through its stop list
        if "<<fail>>" in params.stop:
            raise RuntimeError("injected failure")
        return real_append(out, chunk, params)

    expected = solo(llm, OPENINGS[5], 6)
    monkeypatch.setattr(llm, "append_tokens", append_or_fail)
    good = {"model": MODEL, "prompt": OPENINGS[5], "max_tokens": 6, "temperature": 0}
    bad = {**good, "stop": ["<<fail>>"]}
    with ThreadPoolExecutor(3) as pool:
        ok = pool.submit(httpx.post, f"{srv.url}/v1/completions", json=good, timeout=TIMEOUT_S)
        failed = pool.submit(httpx.post, f"{srv.url}/v1/completions", json=bad, timeout=TIMEOUT_S)
        failed_stream = pool.submit(httpx.post, f"{srv.url}/v1/completions", json={**bad, "stream": True},
                                    timeout=TIMEOUT_S)
    assert failed.result().status_code == 500
    assert failed.result().json()["error"]["message"] == "RuntimeError: injected failure"
    events = [line for line in failed_stream.result().text.splitlines() if line.startswith("data: ")]
    assert "injected failure" in events[-2] and events[-1] == "data: [DONE]"
    assert ok.result().json()["choices"][0]["text"] == expected

    real_step = srv.engine.step
    calls = []

    def step_fails_once():  # an engine-wide failure: the runner fails what is in flight and goes on
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(srv.engine, "step", step_fails_once)
    r = httpx.post(f"{srv.url}/v1/completions", json=good, timeout=TIMEOUT_S)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    assert httpx.post(f"{srv.url}/v1/completions", json=good, timeout=TIMEOUT_S).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200
    wait_idle(srv)


def test_full_queue_answers_429_and_shutdown_finishes_in_flight_requests(llm):
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 300, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with serving(Engine(llm, max_batch=1, max_queue=1)) as small, httpx.Client(timeout=TIMEOUT_S) as http:
        url = f"{small.url}/v1/completions"
        running = http.send(http.build_request("POST", url, json=body), stream=True)
        running_lines = running.iter_lines()  # kept: closing this iterator would close the connection
        next(line for line in running_lines if line.startswith("data: "))  # admitted: it has a token
        waiting = http.send(http.build_request("POST", url, json=body), stream=True)
        wait_until(lambda: small.metric("num_requests_waiting") == 1, 30, "the second request did not queue")
        r = http.post(url, json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        running.close()
        waiting.close()
        wait_idle(small)

        # 60 tokens: more than one speculative round can commit, so the request is still in flight at shutdown.
        with http.stream("POST", url, json={**body, "max_tokens": 60}) as last:
            lines = last.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            small.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
            late = http.post(url, json={**body, "stream": False, "max_tokens": 1})  # still listening: a JSON 503
            health = http.get(f"{small.url}/health")
            events = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert health.status_code == 503 and health.json() == {"status": "shutting down"}
        assert events[0]["choices"][0]["finish_reason"] is None  # shutdown began mid-stream
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        small.thread.join(60)
        assert not small.thread.is_alive()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{small.url}/health")


LONG = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def end_two_long_requests(srv: LiveServer, stop: Callable[[], None]) -> tuple[list[str], httpx.Response]:
    """Run a long stream and a long non-streamed request, call `stop` once both generate, and return the stream's
    data lines and the other's response."""
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(lambda: httpx.post(f"{srv.url}/v1/completions", json={**LONG, "stream": True},
                                                timeout=TIMEOUT_S).text)
        plain = pool.submit(httpx.post, f"{srv.url}/v1/completions", json=LONG, timeout=TIMEOUT_S)
        wait_until(lambda: srv.metric("num_requests_running") == 2 and srv.metric("generation_tokens_total") > 4,
                   60, "the two requests did not start")
        stop()
        lines = [line for line in stream.result().splitlines() if line.startswith("data: ")]
        return lines, plain.result()


def assert_ended_cleanly(lines: list[str], plain: httpx.Response, caplog: pytest.LogCaptureFixture) -> None:
    assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down" and lines[-1] == "data: [DONE]"
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR" and "ASGI" in r.getMessage()]


def test_drain_past_the_shutdown_timeout_ends_requests_cleanly(llm, caplog):
    with serving(Engine(llm, max_batch=4), drain_timeout_s=0.5) as small:
        lines, plain = end_two_long_requests(small, lambda: small.server.handle_exit(signal.SIGTERM, None))
        small.thread.join(60)
        assert not small.thread.is_alive()
    assert_ended_cleanly(lines, plain, caplog)
    assert small.engine.stats().kv_blocks_used == 0


def test_requests_the_server_cancels_end_cleanly(llm, caplog):
    """Without the drain (uvicorn alone stopping), uvicorn cancels what runs past its own graceful timeout."""
    with serving(Engine(llm, max_batch=4), flush_timeout_s=0.5) as small:
        def stop() -> None:
            small.server.should_exit = True
        lines, plain = end_two_long_requests(small, stop)
        small.thread.join(60)
        assert not small.thread.is_alive()
    assert_ended_cleanly(lines, plain, caplog)
    assert small.engine.stats().kv_blocks_used == 0


def test_small_load_with_disconnects_ends_idle(srv):
    report = asyncio.run(run_load(srv.url, requests=32, concurrency=16, max_tokens=3, disconnect_rate=0.1,
                                  timeout_s=TIMEOUT_S))
    assert report.passed, report.to_dict()
    assert report.completed + report.disconnected == report.requests == 32


def test_load_with_faults_stalls_and_a_sigterm_loses_nothing(smollm2):
    llm = inject_faults(smollm2())  # its own model: the fault hook must not reach other tests
    with serving(Engine(llm, max_batch=8)) as small:
        report = asyncio.run(run_load(small.url, requests=32, concurrency=8, max_tokens=3, disconnect_rate=0.1,
                                      timeout_s=TIMEOUT_S, seed=1, fault_rate=0.15, stall_rate=0.2,
                                      sigterm=lambda: small.server.handle_exit(signal.SIGTERM, None)))
        small.thread.join(60)
        assert not small.thread.is_alive()
    assert report.passed, report.to_dict()
    assert report.faulted > 0 and report.completed > 0
    assert report.requests == 32 + 4  # the last wave of 8 in the 32, and 4 more during the drain
    assert sum(getattr(report, o) for o in ("completed", "disconnected", "faulted", "shut_down", "refused")) == 36
    assert small.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-batch", "0"], ["--max-queue", "-1"],
                                  ["--num-blocks", "0"], ["--shutdown-timeout", "-1"],
                                  ["--max-request-bytes", "0"], ["--replicas", "0"]])
def test_serve_refuses_bad_arguments_before_loading(argv, capsys):
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.startswith("selfspec: error: --")
