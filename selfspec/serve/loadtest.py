"""Load test against a running `selfspec serve`: many requests of mixed prompt and output lengths, completions and
chat, streamed and not, a fraction of clients disconnecting early. Passes when no request failed or hung and the
KV blocks in use return to their idle value.

    python -m selfspec.serve.loadtest --url http://127.0.0.1:8000 --requests 2000 --concurrency 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from selfspec.bench.prompts import PROMPTS


@dataclass
class LoadReport:
    requests: int = 0  # sent
    completed: int = 0  # finished normally (stop / length)
    disconnected: int = 0  # closed early by the client on purpose
    failed: int = 0  # an HTTP error, an error event, a missing [DONE] or finish_reason
    hung: int = 0  # no answer within the per-request timeout
    tokens: int = 0  # completion tokens of completed requests
    duration_s: float = 0.0
    kv_blocks_idle: float = 0.0
    kv_blocks_after: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failure messages

    @property
    def passed(self) -> bool:
        return self.failed == 0 and self.hung == 0 and self.kv_blocks_after == self.kv_blocks_idle

    def to_dict(self) -> dict:
        return {**asdict(self), "requests_per_s": self.requests / self.duration_s if self.duration_s else 0.0,
                "passed": self.passed}


@dataclass
class Job:
    path: str  # /v1/completions or /v1/chat/completions
    body: dict
    disconnect_after_s: float | None  # None: read to the end


def make_job(rng: random.Random, model: str, max_tokens: int, disconnect_rate: float) -> Job:
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
    return Job(path, body, disconnect)


async def run_job(client: httpx.AsyncClient, job: Job) -> tuple[str, int, str]:
    """-> (outcome, completion tokens, error message); outcome is completed | disconnected | failed."""
    if job.disconnect_after_s is None:
        return await read_response(client, job)
    try:
        return await asyncio.wait_for(read_response(client, job), job.disconnect_after_s)
    except TimeoutError:
        return "disconnected", 0, ""  # the cancelled read closed the connection


async def read_response(client: httpx.AsyncClient, job: Job) -> tuple[str, int, str]:
    if not job.body["stream"]:
        r = await client.post(job.path, json=job.body)
        if r.status_code != 200:
            return "failed", 0, f"HTTP {r.status_code}: {r.text[:200]}"
        data = r.json()
        if data["choices"][0]["finish_reason"] not in ("stop", "length"):
            return "failed", 0, f"finish_reason {data['choices'][0]['finish_reason']}"
        return "completed", data["usage"]["completion_tokens"], ""
    body = {**job.body, "stream_options": {"include_usage": True}}
    async with client.stream("POST", job.path, json=body) as r:
        if r.status_code != 200:
            return "failed", 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        finish, tokens, done = None, 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "failed", 0, f"error event: {event['error']['message']}"
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            finish = next((c["finish_reason"] for c in event["choices"] if c.get("finish_reason")), finish)
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
                   seed: int = 0) -> LoadReport:
    """Send up to `requests` requests (stop issuing after `duration_s`), `concurrency` at a time."""
    rng = random.Random(seed)
    report = LoadReport()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        report.kv_blocks_idle = await wait_for_idle(client, 0.0, 10.0)
        jobs = [make_job(rng, model, max_tokens, disconnect_rate) for _ in range(requests)]
        start = time.monotonic()
        pending = iter(jobs)

        async def worker() -> None:
            for job in pending:  # shared iterator: each job is taken by exactly one worker
                if time.monotonic() - start > duration_s:
                    return
                report.requests += 1
                try:
                    outcome, tokens, error = await asyncio.wait_for(run_job(client, job), timeout_s)
                except TimeoutError:
                    outcome, tokens, error = "hung", 0, f"no answer in {timeout_s} s"
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    outcome, tokens, error = "failed", 0, f"{type(e).__name__}: {e}"
                setattr(report, outcome, getattr(report, outcome) + 1)
                report.tokens += tokens
                if error and len(report.errors) < 10:
                    report.errors.append(error)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        report.duration_s = time.monotonic() - start
        report.kv_blocks_after = await wait_for_idle(client, report.kv_blocks_idle, 60.0)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.serve.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8, help="each request asks for 1..N tokens")
    p.add_argument("--disconnect-rate", type=float, default=0.1, help="fraction of clients that leave early")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--duration", type=float, default=3600.0, help="stop sending new requests after this many s")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    report = asyncio.run(run_load(a.url, a.requests, a.concurrency, a.max_tokens, a.disconnect_rate, a.timeout,
                                  a.duration, a.seed))
    print(json.dumps(report.to_dict(), indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
