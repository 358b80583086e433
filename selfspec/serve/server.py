"""`selfspec serve`: load the model, build the engine and app, run uvicorn until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse

from selfspec.errors import SelfspecError


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad numbers before the model is loaded (loading takes a while)."""
    if not 0 <= args.port <= 65535:
        raise SelfspecError(f"--port must be between 0 and 65535, got {args.port}")
    for flag in ("max_batch", "max_queue", "block_size"):
        if getattr(args, flag) < 1:
            raise SelfspecError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise SelfspecError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.max_request_bytes < 1:
        raise SelfspecError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.shutdown_timeout < 0:
        raise SelfspecError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    import selfspec
    from selfspec.engine.engine import Engine
    from selfspec.loading.named import DEFAULT_MODEL
    from selfspec.serve.app import create_app

    check_serve_args(args)
    llm = selfspec.load(args.model, args.recipe, args.draft, args.verify, args.gamma, args.group_size, args.device)
    engine = Engine(llm, max_batch=args.max_batch, block_size=args.block_size, num_blocks=args.num_blocks,
                    max_queue=args.max_queue, max_gamma=args.gamma)
    engine.warm_up()  # on the GPU: capture every decode pass's CUDA graph before the first request waits on one
    model_name = args.served_model_name or args.model or DEFAULT_MODEL
    print(f"selfspec: serving {llm.description} as `{model_name}` (recipe {llm.recipe.name}, up to {args.gamma} "
          f"drafts per round) on http://{args.host}:{args.port}/v1", flush=True)
    # uvicorn lets in-flight requests finish for --shutdown-timeout seconds, then cancels them (their sequences
    # are aborted and their KV blocks freed); the app's lifespan then stops the engine thread.
    uvicorn.run(create_app(engine, model_name, args.max_request_bytes), host=args.host, port=args.port,
                timeout_graceful_shutdown=args.shutdown_timeout, log_level="info")
