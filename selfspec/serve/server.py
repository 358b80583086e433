"""`selfspec serve`: load the model, build the engine and app, run uvicorn until SIGINT/SIGTERM, then drain."""
from __future__ import annotations

import argparse
import asyncio
import socket
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from selfspec.errors import SelfspecError
from selfspec.serve.runner import EngineRunner

if TYPE_CHECKING:
    from selfspec.engine.engine import Engine
    from selfspec.engine.llm import LLM

DRAIN_POLL_S = 0.05
# After the drain, how long uvicorn lets the last answers reach their clients before it cancels what is left
# (a client that stopped reading); the app answers a cancelled request cleanly.
FLUSH_TIMEOUT_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGINT / SIGTERM first drains the app while it still listens: new requests get a JSON 503,
    in-flight ones get `drain_timeout_s` to finish, and those still running then end with a clean error (a JSON
    503, or an error event and [DONE]). Only then does uvicorn's own shutdown run. A second signal skips the wait."""

    def __init__(self, config: uvicorn.Config, runner: EngineRunner, drain_timeout_s: float):
        super().__init__(config)
        self.runner, self.drain_timeout_s = runner, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (callable from any thread)."""
        if self._loop is None or not self.runner.accepting:  # not serving yet, or a second signal
            return super().handle_exit(sig, frame)
        self.runner.stop_accepting()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.runner.in_flight and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(DRAIN_POLL_S)
        self.runner.end_in_flight()
        self.should_exit = True


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad numbers before the model is loaded (loading takes a while)."""
    if not 0 <= args.port <= 65535:
        raise SelfspecError(f"--port must be between 0 and 65535, got {args.port}")
    for flag in ("max_batch", "max_queue", "block_size", "prefill_chunk", "decode_steps"):
        if getattr(args, flag) < 1:
            raise SelfspecError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise SelfspecError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.prefill_wait < 0:
        raise SelfspecError(f"--prefill-wait must be >= 0 decode steps, got {args.prefill_wait}")
    if args.max_request_bytes < 1:
        raise SelfspecError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.replicas < 1:
        raise SelfspecError(f"--replicas must be >= 1, got {args.replicas}")
    if args.tensor_parallel > 1 and (args.replicas > 1 or args.ray_address is not None):
        raise SelfspecError("--tensor-parallel and --replicas (Ray Serve) do not combine yet; pick one")
    if args.shutdown_timeout < 0:
        raise SelfspecError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")


def build_engine(args: argparse.Namespace, llm: LLM | None = None) -> Engine:
    """The model loaded as `selfspec serve` asks (or `llm`, already built), in an engine warmed up for its first
    request."""
    import selfspec
    from selfspec.engine.engine import Engine

    if llm is None:
        llm = selfspec.load(args.model, args.recipe, args.draft, args.verify, args.gamma, args.group_size,
                            args.device, draft_model=args.draft_model, kv=args.kv, kv_group=args.kv_group,
                            tensor_parallel=args.tensor_parallel, draft_vocab=args.draft_vocab)
    kwargs = dict(max_batch=args.max_batch, block_size=args.block_size, num_blocks=args.num_blocks,
                  max_queue=args.max_queue, prefill_chunk=args.prefill_chunk, prefill_wait=args.prefill_wait,
                  max_gamma=args.gamma, decode_steps=args.decode_steps)
    # Tensor parallel: rank 0's engine, the other ranks following its steps (parallel/launch.py).
    engine = llm.serve_engine(**kwargs) if args.tensor_parallel > 1 else Engine(llm, **kwargs)
    engine.warm_up()  # on the GPU: capture every decode pass's CUDA graph before the first request waits on one
    return engine


def served_model_name(args: argparse.Namespace) -> str:
    from selfspec.loading.named import DEFAULT_MODEL

    return args.served_model_name or args.model or DEFAULT_MODEL


def serve(args: argparse.Namespace) -> None:
    from selfspec.serve.app import create_app

    check_serve_args(args)
    if args.replicas > 1 or args.ray_address is not None:
        from selfspec.serve.replicas import serve_replicas
        return serve_replicas(args)
    engine = build_engine(args)
    llm, model_name = engine.llm, served_model_name(args)
    print(f"selfspec: serving {llm.description} as `{model_name}` (recipe {llm.recipe.name}, up to {args.gamma} "
          f"drafts per round) on http://{args.host}:{args.port}/v1", flush=True)
    app = create_app(engine, model_name, args.max_request_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
                            log_level="info")
    DrainingServer(config, app.state.runner, args.shutdown_timeout).run()
    llm.close()
    s = engine.stats()
    print(f"selfspec: stopped with {s.kv_blocks_used} KV blocks in use, {s.running} requests running and "
          f"{s.waiting} waiting", flush=True)
