"""`selfspec serve --replicas N`: N engine replicas behind one OpenAI endpoint, on Ray Serve.

Two deployments in one Ray Serve application:
- `EngineReplica` (N replicas, one GPU each where there are GPUs, else one CPU): an Engine and its EngineRunner;
  `generate` streams a request's outputs, `check_health` fails once the engine thread has stopped (Ray Serve then
  replaces the replica).
- `Front` (one replica, no CPU reserved): app.py's routes, whose runner (ReplicaRunner) sends each request to the
  replica with the fewest requests in flight (LeastLoadedRouter). A replica takes at most --max-batch requests at
  once, so a request it has admitted is decoding; the rest wait at the front (up to --max-queue, then 429).
  A request whose replica dies before admitting it is sent to another; one whose replica dies mid-generation ends
  with an error naming the cause (a stream: an error event and [DONE]).

/metrics is the front's: the request-level series count every replica's requests, and the engine gauges and
counters are the sums over the replicas of each one's latest state (sent along with its outputs).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import ray
from fastapi import FastAPI
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from selfspec.engine.engine import Engine, EngineStats, QueueFull, RequestOutput
from selfspec.engine.llm import Generation
from selfspec.serve.app import APIError, PromptSide, openai_app
from selfspec.serve.metrics import ServerMetrics
from selfspec.serve.runner import EngineRunner, ServerShuttingDown, Stream, observe
from selfspec.serve.server import build_engine, served_model_name
from selfspec.speculative.sampling import SamplingParams

log = logging.getLogger("selfspec.serve")
APP_NAME = "selfspec"
ADMIT_TIMEOUT_S = 60.0  # how long a request may go on finding a live replica (Ray Serve replaces dead ones)
RETRY_WAIT_S = 0.1
REPLICA_LOST = "the engine replica running this request failed mid-generation; retry the request"
FRONT_MAX_ONGOING = 100_000  # the front only relays: the replicas' --max-batch and --max-queue bound the work
QUIET = {"enable_access_log": False}  # Ray Serve would log every request and every replica call


class LeastLoadedRouter(RequestRouter):
    """Every live replica is a candidate; Ray Serve's router then picks the one with the fewest requests in flight
    (its probed queue length), where its default samples two replicas and takes the less loaded of those."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return [candidate_replicas]


class EngineReplica:
    def __init__(self, args: argparse.Namespace):
        self._start(build_engine(args))

    def _start(self, engine: Engine) -> None:
        """This replica serves `engine` (its runner thread started)."""
        self.prompts = PromptSide.of(engine.llm)
        self.idle_stats = engine.stats()
        self.runner = EngineRunner(engine, ServerMetrics(lambda: self.runner.latest_stats))
        self.runner.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def prompt_side(self) -> tuple[PromptSide, EngineStats]:
        """The tokenizer and config the front needs, and an idle replica's stats (every replica's until it reports)."""
        return self.prompts, self.idle_stats

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       gamma: int | None) -> AsyncIterator[tuple[RequestOutput | None, str, EngineStats | None]]:
        """(None, replica, stats) once admitted, then (output, replica, stats) up to the finished output."""
        outputs = await self.runner.add_request(request_id, prompt_ids, params, gamma)
        try:
            yield None, self.replica_id, self.runner.latest_stats
            while True:
                out = await outputs.get()
                yield out, self.replica_id, self.runner.latest_stats
                if out.finished:
                    return
        finally:
            self.runner.abort(request_id)  # no-op once finished; frees the sequence of a cancelled request

    def check_health(self) -> None:
        if not self.runner.alive:
            raise RuntimeError("the engine thread of this replica stopped")

    def __del__(self) -> None:
        self.runner.shutdown()


class ReplicaRunner:
    """The front's runner (app.py's Runner): requests go to the engine replicas through a Ray Serve handle."""

    def __init__(self, engines: DeploymentHandle, metrics: ServerMetrics, replicas: int, idle_stats: EngineStats):
        self.engines, self.metrics, self.replicas, self.idle_stats = engines, metrics, replicas, idle_stats
        self.replica_stats: dict[str, EngineStats] = {}
        self._pumps: dict[str, asyncio.Task] = {}
        self._accepting = True

    @property
    def latest_stats(self) -> EngineStats | None:
        reported = list(self.replica_stats.values())
        return sum_stats(reported + [self.idle_stats] * (self.replicas - len(reported)))  # the rest are idle

    @property
    def alive(self) -> bool:
        return True  # a replica's health is Ray Serve's check (EngineReplica.check_health)

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                          gamma: int | None = None) -> asyncio.Queue[RequestOutput]:
        if not self._accepting:
            raise ServerShuttingDown("the server is shutting down; retry on another instance")
        stream = Stream(asyncio.Queue(), asyncio.get_running_loop(), time.perf_counter())
        outputs, replica = await self._admit(request_id, prompt_ids, params, gamma)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._pumps[request_id] = asyncio.create_task(self._pump(request_id, stream, outputs, replica))
        return stream.queue

    def abort(self, request_id: str) -> None:
        pump = self._pumps.pop(request_id, None)
        if pump is not None:
            pump.cancel()
            self.metrics.finished.labels("abort").inc()

    def shutdown(self) -> None:
        self._accepting = False
        for request_id in list(self._pumps):
            self.abort(request_id)

    async def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     gamma: int | None) -> tuple[DeploymentResponseGenerator, str]:
        """Send the request to a replica until one admits it; a replica that dies first is not retried on."""
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        while True:
            outputs = self.engines.options(stream=True).generate.remote(request_id, prompt_ids, params, gamma)
            try:
                _, replica, stats = await outputs.__anext__()
            except (RayActorError, ActorUnavailableError) as e:
                if time.monotonic() > deadline:
                    raise APIError(503, f"no engine replica admitted the request in {ADMIT_TIMEOUT_S:.0f} s "
                                   f"(the last one failed: {e}); retry later", type="server_error",
                                   code="no_live_replica") from None
                log.warning("an engine replica failed before admitting %s; sending it to another", request_id)
                await asyncio.sleep(RETRY_WAIT_S)
                continue
            except asyncio.CancelledError:
                outputs.cancel()  # the client left while the request waited: it must not start later
                raise
            except BackPressureError:
                raise QueueFull("every engine replica is busy and the front's queue is full; retry later") from None
            except RayTaskError as e:
                raise e.cause from None  # the replica refused it (bad input, queue full): the client gets its error
            self.replica_stats[replica] = stats
            return outputs, replica

    async def _pump(self, request_id: str, stream: Stream, outputs: DeploymentResponseGenerator,
                    replica: str) -> None:
        try:
            async for out, replica, stats in outputs:
                self.replica_stats[replica] = stats
                observe(self.metrics, stream, out)
                if out.finished:
                    self._pumps.pop(request_id, None)
                stream.queue.put_nowait(out)
                if out.finished:
                    return
        except asyncio.CancelledError:
            outputs.cancel()  # the client left: the replica aborts the sequence
            raise
        except Exception as e:
            lost = isinstance(e, (RayActorError, ActorUnavailableError))
            if lost:
                self.replica_stats.pop(replica, None)
            log.warning("request %s failed on engine replica %s: %s", request_id, replica, e)
            self._pumps.pop(request_id, None)
            self.metrics.finished.labels("error").inc()
            message = REPLICA_LOST if lost else f"the engine replica failed: {e}"
            stream.queue.put_nowait(RequestOutput(request_id, [], "", True, "error", Generation("", [], "error"),
                                                  message))


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' engine stats added up (gamma: the largest; acceptance: unknown across replicas)."""
    total = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)
             if f.name not in ("gamma", "acceptance")}
    return EngineStats(**total, gamma=max(s.gamma for s in stats), acceptance=None)


@serve.ingress()
class Front:
    def __init__(self, engines: DeploymentHandle, replicas: int, model_name: str, max_request_bytes: int):
        self.engines, self.replicas = engines, replicas
        self.model_name, self.max_request_bytes = model_name, max_request_bytes

    async def __serve_build_asgi_app__(self) -> FastAPI:
        prompts, idle_stats = await self.engines.prompt_side.remote()
        metrics = ServerMetrics(lambda: runner.latest_stats)
        runner = ReplicaRunner(self.engines, metrics, self.replicas, idle_stats)

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            yield
            runner.shutdown()

        return openai_app(runner, prompts, self.model_name, metrics, lifespan, self.max_request_bytes)


def engine_deployment(args: argparse.Namespace, gpus_per_replica: int,
                      replica: type[EngineReplica] = EngineReplica) -> serve.Deployment:
    """args.replicas engine replicas (`replica`'s class) behind the least-loaded router, each taking at most
    --max-batch requests at once (`gpus_per_replica`: 1 on GPUs, else 0)."""
    replica_resources = {"num_gpus": 1} if gpus_per_replica else {"num_cpus": 1}
    return serve.deployment(replica).options(
        num_replicas=args.replicas, max_ongoing_requests=args.max_batch, max_queued_requests=args.max_queue,
        ray_actor_options=replica_resources, logging_config=QUIET,
        request_router_config=RequestRouterConfig(request_router_class=LeastLoadedRouter))


def build_app(args: argparse.Namespace, gpus_per_replica: int) -> serve.Application:
    """The Ray Serve application of `selfspec serve --replicas N` (`gpus_per_replica`: 1 on GPUs, else 0)."""
    engines = engine_deployment(args, gpus_per_replica)
    front = serve.deployment(Front).options(num_replicas=1, max_ongoing_requests=FRONT_MAX_ONGOING,
                                            ray_actor_options={"num_cpus": 0}, logging_config=QUIET)
    return front.bind(engines.bind(args), args.replicas, served_model_name(args), args.max_request_bytes)


def start(args: argparse.Namespace) -> str:
    """Join (or start) the Ray cluster and deploy the application; returns the endpoint's base URL."""
    ray.init(address=args.ray_address, ignore_reinit_error=True)
    gpus = 1 if args.device.startswith("cuda") else 0
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args, gpus), name=APP_NAME, route_prefix="/")
    return f"http://{args.host}:{args.port}/v1"


def serve_replicas(args: argparse.Namespace) -> None:
    url = start(args)
    print(f"selfspec: serving `{served_model_name(args)}` from {args.replicas} engine replicas on Ray Serve at "
          f"{url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    serve.shutdown()
    print("selfspec: stopped", flush=True)
