"""Load test against `selfspec serve`: many requests of mixed prompt and output lengths, completions and chat,
streamed and not, some clients disconnecting early, some stalling between reads. Passes when every request
completed or got a clean, explained error, none hung, and the KV blocks in use return to their idle value.

Against a running server:

    python -m selfspec.serve.loadtest --url http://127.0.0.1:8000 --requests 2000 --concurrency 32

With faults: `--launch` starts the server itself (`selfspec serve` plus SERVE_ARGS) with fault injection on:
requests drawn at --fault-rate fail inside the engine step (they must get a 500 or an error event and [DONE]).
`--sigterm` then sends the last wave of requests, SIGTERMs the server while they run, sends a few more during the
drain (JSON 503 or refused), and checks the server exits with no KV blocks in use:

    python -m selfspec.serve.loadtest --launch --serve-args "--port 8011" --url http://127.0.0.1:8011 \\
        --requests 2000 --fault-rate 0.02 --stall-rate 0.02 --sigterm
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from selfspec.bench.prompts import PROMPTS
from selfspec.engine.llm import LLM, Generation
from selfspec.speculative.sampling import SamplingParams

# The launched server fails, inside its engine step, every request with this among its stop strings.
FAULT_MARKER = "<<loadtest-fault>>"
FAULT_MESSAGE = "injected fault"
LATE_REQUESTS = 4  # sent after the SIGTERM, during the drain
OUTCOMES = ("completed", "disconnected", "faulted", "shut_down", "refused", "failed", "hung")


@dataclass
class LoadReport:
    requests: int = 0  # sent
    completed: int = 0  # finished normally (stop / length)
    disconnected: int = 0  # closed early by the client on purpose
    faulted: int = 0  # an injected fault, answered cleanly (a 500, or an error event and [DONE])
    shut_down: int = 0  # after the SIGTERM: a JSON 503, or an event stream ended with the shutdown error and [DONE]
    refused: int = 0  # after the SIGTERM: no connection (the server had exited)
    failed: int = 0  # anything else: an HTTP error, an error event, a missing [DONE] or finish_reason
    hung: int = 0  # no answer within the per-request timeout
    tokens: int = 0  # completion tokens of completed requests
    duration_s: float = 0.0
    kv_blocks_idle: float = 0.0
    kv_blocks_after: float = 0.0  # after the load, before any SIGTERM
    server_exit: dict | None = None  # with --sigterm: exit code and the KV blocks the stopped server held
    errors: list[str] = field(default_factory=list)  # the first few failure messages

    @property
    def passed(self) -> bool:
        exited_clean = self.server_exit is None or (self.server_exit["returncode"] == 0
                                                    and self.server_exit["kv_blocks_used"] == 0
                                                    and self.server_exit["tracebacks_logged"] == 0)
        return self.failed == 0 and self.hung == 0 and self.kv_blocks_after == self.kv_blocks_idle and exited_clean

    def to_dict(self) -> dict:
        return {**asdict(self), "requests_per_s": self.requests / self.duration_s if self.duration_s else 0.0,
                "passed": self.passed}


@dataclass
class Job:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict
    disconnect_after_s: float | None  # None: read to the end
    fault: bool = False  # asks the launched server to fail it inside the engine step
    stall_s: float = 0.0  # a streamed client that stops reading this long after the first event


def make_job(rng: random.Random, model: str, max_tokens: int, disconnect_rate: float, fault_rate: float = 0.0,
             stall_rate: float = 0.0) -> Job:
    """A random request: prompt of 1..6 built-in prompts (sometimes 30, to exercise chunked prefill)."""
    n = 30 if rng.random() < 0.05 else rng.randint(1, 6)
    text = " ".join(rng.choice(PROMPTS) for _ in range(n))
    body = {"model": model, "max_tokens": rng.randint(1, max_tokens), "temperature": 0.0,
            "stream": rng.random() < 0.7}
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    if rng.random() < 0.3:
        body.update(temperature=0.8, top_p=0.9, seed=rng.randint(0, 1 << 30))
    disconnect = rng.uniform(0.0, 1.0) if rng.random() < disconnect_rate else None
    fault = rng.random() < fault_rate
    if fault:
        body["stop"] = [FAULT_MARKER]
    stall = rng.uniform(0.5, 2.0) if body["stream"] and rng.random() < stall_rate else 0.0
    return Job(path, body, disconnect, fault, stall)


async def run_job(client: httpx.AsyncClient, job: Job) -> tuple[str, int, str]:
    """-> (outcome, completion tokens, error message); outcome is one of OUTCOMES but hung."""
    try:
        if job.disconnect_after_s is None:
            return await read_response(client, job)
        try:
            return await asyncio.wait_for(read_response(client, job), job.disconnect_after_s)
        except TimeoutError:
            return "disconnected", 0, ""  # the cancelled read closed the connection
    except httpx.ConnectError as e:
        return "refused", 0, f"ConnectError: {e}"


def judge_error(job: Job, status: int, error: dict) -> tuple[str, int, str]:
    """An error answer (a JSON body or an event) is explained by an injected fault or the shutdown."""
    if job.fault and status == 500 and FAULT_MESSAGE in error.get("message", ""):
        return "faulted", 0, ""
    if status == 503 and error.get("code") == "shutting_down":
        return "shut_down", 0, ""
    return "failed", 0, f"HTTP {status}: {error}"


async def read_response(client: httpx.AsyncClient, job: Job) -> tuple[str, int, str]:
    if not job.body["stream"]:
        r = await client.post(job.path, json=job.body)
        if r.status_code != 200:
            return judge_error(job, r.status_code, r.json().get("error", {}))
        data = r.json()
        if data["choices"][0]["finish_reason"] not in ("stop", "length"):
            return "failed", 0, f"finish_reason {data['choices'][0]['finish_reason']}"
        return "completed", data["usage"]["completion_tokens"], ""
    body = {**job.body, "stream_options": {"include_usage": True}}
    async with client.stream("POST", job.path, json=body) as r:
        if r.status_code != 200:
            return judge_error(job, r.status_code, json.loads(await r.aread()).get("error", {}))
        finish, tokens, done, error = None, 0, False, None
        async for line in r.aiter_lines():
            if job.stall_s:
                await asyncio.sleep(job.stall_s)  # the server's writes pile up in the socket meanwhile
                job.stall_s = 0.0
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            finish = next((c["finish_reason"] for c in event["choices"] if c.get("finish_reason")), finish)
    if error is not None:  # an event stream's errors are explained the way a JSON body's are
        status = 503 if error.get("code") == "shutting_down" else 500
        outcome = judge_error(job, status, error)
        return outcome if done else ("failed", 0, f"error event without [DONE]: {error}")
    if not done or finish not in ("stop", "length"):
        return "failed", 0, f"stream ended without [DONE] or finish_reason (done={done}, finish={finish})"
    return "completed", tokens, ""


async def scrape(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    m = re.search(rf"^selfspec:{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def wait_for_idle(client: httpx.AsyncClient, idle_blocks: float, timeout_s: float) -> float:
    """Poll /metrics until nothing runs or waits and the KV blocks are back to idle; -> blocks in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = await scrape(client, "kv_blocks_used")
        busy = await scrape(client, "num_requests_running") + await scrape(client, "num_requests_waiting")
        if (blocks == idle_blocks and busy == 0) or time.monotonic() > deadline:
            return blocks
        await asyncio.sleep(0.2)


async def run_load(url: str, requests: int, concurrency: int = 32, max_tokens: int = 8,
                   disconnect_rate: float = 0.1, timeout_s: float = 300.0, duration_s: float = 3600.0,
                   seed: int = 0, fault_rate: float = 0.0, stall_rate: float = 0.0,
                   sigterm: Callable[[], None] | None = None) -> LoadReport:
    """Send up to `requests` requests (stop issuing after `duration_s`), `concurrency` at a time. With `sigterm`
    (what SIGTERMs the server), the last wave is sent, `sigterm` is called while it runs, and a few more requests
    follow during the drain."""
    rng = random.Random(seed)
    report = LoadReport()
    limits = httpx.Limits(max_connections=concurrency + LATE_REQUESTS + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        report.kv_blocks_idle = await wait_for_idle(client, 0.0, 10.0)
        jobs = [make_job(rng, model, max_tokens, disconnect_rate, fault_rate, stall_rate) for _ in range(requests)]
        last_wave = jobs[-concurrency:] if sigterm is not None else []
        start = time.monotonic()
        sigterm_sent = False

        async def run(job: Job) -> None:
            report.requests += 1
            try:
                outcome, tokens, error = await asyncio.wait_for(run_job(client, job), timeout_s)
            except TimeoutError:
                outcome, tokens, error = "hung", 0, f"no answer in {timeout_s} s"
            except (httpx.HTTPError, ValueError, KeyError) as e:
                outcome, tokens, error = "failed", 0, f"{type(e).__name__}: {e}"
            if outcome in ("shut_down", "refused") and not sigterm_sent:
                outcome, error = "failed", f"{outcome} before any SIGTERM: {error}"
            elif outcome in ("shut_down", "refused"):
                error = ""
            setattr(report, outcome, getattr(report, outcome) + 1)
            report.tokens += tokens
            if error and len(report.errors) < 10:
                report.errors.append(error)

        pending = iter(jobs[:len(jobs) - len(last_wave)])

        async def worker() -> None:
            for job in pending:  # shared iterator: each job is taken by exactly one worker
                if time.monotonic() - start > duration_s:
                    return
                await run(job)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.kv_blocks_after = await wait_for_idle(client, report.kv_blocks_idle, 60.0)
        if sigterm is not None:
            wave = [asyncio.create_task(run(job)) for job in last_wave]
            deadline = time.monotonic() + 30
            while await scrape(client, "num_requests_running") == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            sigterm_sent = True
            sigterm()
            late = [make_job(rng, model, max_tokens, 0.0) for _ in range(LATE_REQUESTS)]
            await asyncio.gather(*wave, *(run(job) for job in late))
        report.duration_s = time.monotonic() - start
    return report


def launch_server(serve_args: list[str], url: str, log: tempfile.TemporaryFile,
                  timeout_s: float = 600.0) -> subprocess.Popen:
    """`python -m selfspec.serve.loadtest serve SERVE_ARGS` (fault injection on, output to `log`), once /health
    answers."""
    proc = subprocess.Popen([sys.executable, "-m", "selfspec.serve.loadtest", "serve", *serve_args],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}:\n{read_log(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not answer /health within {timeout_s} s")
        time.sleep(0.5)


def read_log(log: tempfile.TemporaryFile) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def stopped_server(proc: subprocess.Popen, log: tempfile.TemporaryFile, timeout_s: float = 120.0) -> dict:
    """Wait for the SIGTERMed server to exit -> its exit code, the KV blocks it reported when it stopped and the
    tracebacks it logged."""
    proc.wait(timeout_s)
    out = read_log(log)
    m = re.search(r"stopped with (\d+) KV blocks in use", out)
    return {"returncode": proc.returncode, "kv_blocks_used": int(m.group(1)) if m else None,
            "tracebacks_logged": out.count("Traceback")}


def inject_faults(llm: LLM) -> LLM:
    """Make `llm` fail, inside the engine step, every request that has FAULT_MARKER among its stop strings (the
    engine's per-request isolation must then answer it cleanly)."""
    real_append = llm.append_tokens

    def append_or_fail(out: Generation, tokens: list[int], params: SamplingParams):
        if FAULT_MARKER in params.stop:
            raise RuntimeError(FAULT_MESSAGE)
        return real_append(out, tokens, params)

    llm.append_tokens = append_or_fail
    return llm


def serve_with_faults(serve_args: list[str]) -> int:
    """`selfspec serve SERVE_ARGS` with inject_faults on its model."""
    import selfspec
    from selfspec.cli import main

    real_load = selfspec.load
    selfspec.load = lambda *args, **kwargs: inject_faults(real_load(*args, **kwargs))
    return main(["serve", *serve_args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_with_faults(argv[1:])
    p = argparse.ArgumentParser(prog="python -m selfspec.serve.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8, help="each request asks for 1..N tokens")
    p.add_argument("--disconnect-rate", type=float, default=0.1, help="fraction of clients that leave early")
    p.add_argument("--stall-rate", type=float, default=0.0,
                   help="fraction of streamed clients that stop reading for 0.5-2 s after the first event")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--duration", type=float, default=3600.0, help="stop sending new requests after this many s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launch", action="store_true", help="start the server (fault injection on), stop it after")
    p.add_argument("--serve-args", default="", help="with --launch: `selfspec serve` arguments (give --port)")
    p.add_argument("--fault-rate", type=float, default=0.0,
                   help="with --launch: fraction of requests that fail inside the engine step")
    p.add_argument("--sigterm", action="store_true",
                   help="with --launch: SIGTERM the server during the last wave and check its drain")
    a = p.parse_args(argv)
    if (a.fault_rate or a.sigterm) and not a.launch:
        p.error("--fault-rate and --sigterm need --launch (the server must run with fault injection)")
    log = tempfile.TemporaryFile()
    server = launch_server(shlex.split(a.serve_args), a.url, log) if a.launch else None
    try:
        sigterm = (lambda: server.send_signal(signal.SIGTERM)) if a.sigterm else None
        report = asyncio.run(run_load(a.url, a.requests, a.concurrency, a.max_tokens, a.disconnect_rate, a.timeout,
                                      a.duration, a.seed, a.fault_rate, a.stall_rate, sigterm))
        if server is not None:
            if not a.sigterm:
                server.send_signal(signal.SIGTERM)
            report.server_exit = stopped_server(server, log)
    finally:
        if server is not None and server.poll() is None:
            server.kill()
    print(json.dumps(report.to_dict(), indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
