"""The bridge between asyncio handlers and the engine: one background thread loops `engine.step()` and hands each
RequestOutput to its request's asyncio.Queue (via `loop.call_soon_threadsafe`).

Only this thread calls `step`, `abort` and `stats`; handlers call `add_request` (the engine's thread-safe inbox)
and queue aborts here, so the engine never sees two threads at once outside its inbox.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from selfspec.engine.engine import Engine, EngineStats, RequestOutput
from selfspec.engine.llm import Generation
from selfspec.errors import SelfspecError
from selfspec.serve.metrics import ServerMetrics
from selfspec.speculative.sampling import SamplingParams

log = logging.getLogger("selfspec.serve")
IDLE_WAIT_S = 0.05  # how long the thread sleeps when idle before re-checking (a new request wakes it at once)
SHUTDOWN = "shutdown"  # finish reason of a request the server ended because it is shutting down


class ServerShuttingDown(SelfspecError):
    """New requests are refused while the server drains."""


@dataclass
class Stream:
    """One in-flight request as the runner sees it."""
    queue: asyncio.Queue[RequestOutput]
    loop: asyncio.AbstractEventLoop
    arrival: float
    last_token_at: float | None = None


class Runner(Protocol):
    """What the routes use: an EngineRunner here, or the front of engine replicas (serve/replicas.py)."""
    latest_stats: EngineStats | None

    @property
    def alive(self) -> bool: ...

    @property
    def accepting(self) -> bool: ...

    async def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          gamma: int | None = None) -> asyncio.Queue[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


class EngineRunner:
    def __init__(self, engine: Engine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.latest_stats: EngineStats | None = None  # refreshed by the engine thread; read by /metrics
        self._streams: dict[str, Stream] = {}
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="selfspec-engine", daemon=True)

    def start(self) -> None:
        self.latest_stats = self.engine.stats()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        return len(self._streams)

    def stop_accepting(self) -> None:
        """From now on add_request raises ServerShuttingDown; what is in flight goes on."""
        self._accepting = False

    def end_in_flight(self) -> None:
        """End every request still in flight with finish reason SHUTDOWN (their KV blocks are freed)."""
        for request_id in list(self._streams):
            self._fail(request_id, SHUTDOWN, "the server shut down before this request finished")

    async def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          gamma: int | None = None) -> asyncio.Queue[RequestOutput]:
        """Admit a request; raises SelfspecError (bad input), QueueFull, or ServerShuttingDown."""
        if not self._accepting:
            raise ServerShuttingDown("the server is shutting down; retry on another instance")
        stream = Stream(asyncio.Queue(), asyncio.get_running_loop(), time.perf_counter())
        self._streams[request_id] = stream  # registered first: the engine thread may answer before we return
        try:
            self.engine.add_request(request_id, prompt_ids, params, gamma=gamma)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wakeup.set()
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Cancel a request whose client is gone; idempotent. Its KV blocks are freed on the engine thread."""
        if self._cancel(request_id) is not None:
            self.metrics.finished.labels("abort").inc()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, end what is still in flight (the server has already let it drain), stop the thread."""
        self.stop_accepting()
        self.end_in_flight()
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wakeup.clear()
            self._apply_aborts()
            if not self.engine.has_work():
                self._wakeup.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # the engine should isolate per-request failures; this is the last resort
                log.exception("engine step failed; failing every in-flight request")
                for request_id in list(self._streams):
                    self._fail(request_id, "error", f"engine failure: {e}")
                continue
            self.latest_stats = self.engine.stats()  # before the outputs: a finished one carries its aftermath
            for out in outputs:
                self._dispatch(out)
        self._apply_aborts()
        if self.engine.has_work():  # every request was ended: this step only applies their aborts (frees blocks)
            self.engine.step()
        self.latest_stats = self.engine.stats()

    def _apply_aborts(self) -> None:
        aborted = False
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                break
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting request %s failed", request_id)
            aborted = True
        if aborted:
            self.latest_stats = self.engine.stats()

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:  # aborted while this step ran
            return
        observe(self.metrics, stream, out)
        if out.finished:
            self._streams.pop(out.request_id, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail(self, request_id: str, reason: str, message: str) -> None:
        """Finish a request from the runner's side: abort it in the engine and tell its handler why."""
        stream = self._cancel(request_id)
        if stream is None:
            return
        self.metrics.finished.labels(reason).inc()
        out = RequestOutput(request_id, [], "", True, reason, Generation("", [], reason), message)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _cancel(self, request_id: str) -> Stream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._aborts.put(request_id)
            self._wakeup.set()
        return stream


def observe(m: ServerMetrics, stream: Stream, out: RequestOutput) -> None:
    """Record a request's output in the request-level series (tokens, TTFT, ITL, end-to-end, finish reason)."""
    now, n = time.perf_counter(), len(out.new_token_ids)
    if n:
        if stream.last_token_at is None:
            m.ttft.observe(now - stream.arrival)
        else:
            m.itl.observe((now - stream.last_token_at) / n)
        stream.last_token_at = now
        m.generation_tokens.inc(n)
    if out.finished:
        m.finished.labels(out.finish_reason or "unknown").inc()
        m.e2e.observe(now - stream.arrival)
