"""Replica scaling: N engine replicas on Ray Serve, deployed as `selfspec serve --replicas N` deploys them
(serve/replicas.py: one GPU each, or one CPU, behind the least-loaded router), against one replica. Each replica is
kept full: --batch requests in flight per replica in a closed loop through the deployment's handle (Ray Serve's
router and the replicas; not the HTTP front), plain decoding (gamma 0) of random --prompt-tokens prompts, every
request --max-new-tokens long (EOS ignored).

selfspec bench replicas [--shape llama-3-8b | --model M] [--replicas 1 2] [--batch 32] [--requests 64]
                        [--max-new-tokens 128] [--prompt-tokens 512] [--device cuda] [--ray-address ADDR] [--json F]

With --shape the replicas hold synthetic weights of that shape (bench/synthetic.py; token ids in and out); else
the named model (default smollm2-135m: on the CPU, for a check that it runs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from collections import Counter

import ray
from ray import serve

from selfspec.bench.shapes import SHAPES
from selfspec.bench.synthetic import synthetic_llm
from selfspec.errors import SelfspecError
from selfspec.serve.replicas import EngineReplica, engine_deployment
from selfspec.serve.server import build_engine
from selfspec.speculative.sampling import SamplingParams

APP_NAME = "selfspec-bench-replicas"
WARM_TOKENS = 4  # each request of the untimed first wave: its prompt's prefill and a few steps


class SyntheticReplica(EngineReplica):
    """An engine replica over synthetic weights of a named shape (no tokenizer: token ids in and out)."""

    def __init__(self, args: argparse.Namespace, shape: str):
        self._start(build_engine(args, synthetic_llm(shape, args.recipe, args.gamma, args.group_size, args.device)))


def serve_args(args: argparse.Namespace, replicas: int) -> argparse.Namespace:
    """`selfspec serve`'s arguments for `replicas` replicas of the benchmarked model, each taking --batch requests."""
    from selfspec.cli import build_parser

    model = ["--model", args.model] if args.model else []
    return build_parser().parse_args(["serve", "--replicas", str(replicas), "--max-batch", str(args.batch),
                                      "--recipe", args.recipe, "--group-size", str(args.group_size),
                                      "--device", args.device, *model])


async def closed_loop(handle, prompts: list[list[int]], params: SamplingParams, in_flight: int) -> dict:
    """Every prompt sent through `handle`, `in_flight` at a time (one starts as one ends); the wall time, the tokens
    generated and how many requests each replica served."""
    todo = list(prompts)
    served: Counter[str] = Counter()
    tokens = 0

    async def one_after_another() -> None:
        nonlocal tokens
        while todo:
            ids = todo.pop()
            stream = handle.options(stream=True).generate.remote(uuid.uuid4().hex, ids, params, 0)
            async for out, replica, _ in stream:
                if out is None:
                    continue
                if out.error is not None:
                    raise SelfspecError(f"a request failed on replica {replica}: {out.error}")
                tokens += len(out.new_token_ids)
                if out.finished:
                    served[replica] += 1

    start = time.perf_counter()
    await asyncio.gather(*(one_after_another() for _ in range(in_flight)))
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "requests_per_replica": sorted(served.values())}


def measure(args: argparse.Namespace, replicas: int) -> dict:
    """One deployment of `replicas` replicas: an untimed wave (every replica's first prefills and steps), then
    --requests per replica, --batch per replica in flight."""
    gpus = 1 if args.device.startswith("cuda") else 0
    replica_args = serve_args(args, replicas)
    if args.shape:
        app = engine_deployment(replica_args, gpus, SyntheticReplica).bind(replica_args, args.shape)
    else:
        app = engine_deployment(replica_args, gpus).bind(replica_args)
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    try:
        prompt_side, _ = handle.prompt_side.remote().result()
        rng = random.Random(args.seed)
        vocab = prompt_side.cfg.vocab_size

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]

        in_flight = args.batch * replicas
        warm = SamplingParams(max_new_tokens=WARM_TOKENS, ignore_eos=True)
        asyncio.run(closed_loop(handle, prompts(in_flight), warm, in_flight))
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        run = asyncio.run(closed_loop(handle, prompts(args.requests * replicas), params, in_flight))
    finally:
        serve.delete(APP_NAME)
    return {"replicas": replicas, **run, "tokens_per_s": run["tokens"] / run["seconds"]}


def table(rows: list[dict]) -> str:
    one = next((r["tokens_per_s"] for r in rows if r["replicas"] == 1), None)
    out = ["| replicas | tok/s | x one replica | requests per replica |", "|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / one:.2f}x" if one else "-"
        out.append(f"| {r['replicas']} | {r['tokens_per_s']:.1f} | {ratio} | {r['requests_per_replica']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="named model, HF directory or .gguf file (default: smollm2-135m)")
    ap.add_argument("--shape", default=None, choices=list(SHAPES), help="instead of --model: synthetic weights")
    ap.add_argument("--recipe", default="planes", help="the recipe whose verify mode decodes (gamma 0)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=32, help="requests in flight per replica (its --max-batch)")
    ap.add_argument("--requests", type=int, default=64, help="requests per replica")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="random prompts of this many tokens")
    ap.add_argument("--group-size", type=int, default=128, help="the quantization group")
    ap.add_argument("--device", default="cuda", help="cuda (one GPU a replica) or cpu (one CPU a replica)")
    ap.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.model and args.shape:
        raise SelfspecError("--model and --shape: pick one (a named model, or synthetic weights of a shape)")
    if args.shape and not args.device.startswith("cuda"):
        raise SelfspecError("--shape builds synthetic weights on the GPU: add --device cuda, or bench --model on "
                            "the CPU")
    ray.init(address=args.ray_address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        rows = [measure(args, n) for n in args.replicas]
    finally:
        serve.shutdown()
    print(f"{args.shape or args.model or 'smollm2-135m'}, {args.device}, batch {args.batch} a replica, "
          f"{args.prompt_tokens}-token prompts, {args.max_new_tokens} new tokens, AR (gamma 0)")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "model": args.model, "device": args.device, "batch": args.batch,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
