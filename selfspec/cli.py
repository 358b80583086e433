"""Command line: `selfspec generate | serve | eval | bench | calibrate-skip`."""
from __future__ import annotations

import argparse
import json
import sys

from selfspec.bench.serve import add_args as add_serve_bench_args
from selfspec.engine.engine import DEFAULT_DECODE_STEPS, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_WAIT
from selfspec.errors import SelfspecError
from selfspec.eval.runner import DEFAULT_BATCH_SIZE
from selfspec.quant.kv import KV_FORMATS
from selfspec.quant.modes import MODES
from selfspec.speculative.layer_skip import add_args as add_calibrate_skip_args
from selfspec.speculative.recipes import PRESETS


def add_prefill_chunk_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="prompt tokens prefilled per engine step, shared by the prompts being prefilled; smaller "
                        "keeps the running requests' decoding steady, larger prefills faster (default: %(default)s)")


def add_prefill_wait_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-wait", type=int, default=DEFAULT_PREFILL_WAIT, metavar="STEPS",
                   help="decode steps a new prompt may wait, while others decode, for more prompts to share its "
                        "prefill pass (a pass of few tokens costs nearly as much as a full one); 0: never wait "
                        "(default: %(default)s)")


def add_decode_steps_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS, metavar="N",
                   help="plain greedy decoding steps run back to back before the host waits for their tokens (a "
                        "stream then gets up to N tokens at a time; new prompts are admitted between bursts); 1: "
                        "one step at a time (default: %(default)s)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="named model, HF directory or .gguf file (default: smollm2-135m)")
    p.add_argument("--recipe", default=None, choices=list(PRESETS),
                   help="stored format + draft + verify (default: planes)")
    p.add_argument("--draft", default=None, metavar="MODE",
                   help=f"draft mode, one of: {', '.join(MODES)}; or ngram[:MIN-MAX] (prompt lookup of the last "
                        "MAX..MIN tokens, default 3..1); or hybrid (lookup where it matches, else an upper "
                        "chain); or a tree of B candidates verified in one pass: ngram-tree[:B], tree:MODE[:B], "
                        "hybrid-tree[:B]; or recycle-tree[:N] (a tree of N tokens from the verify passes' own "
                        "rankings, no draft step)")
    p.add_argument("--verify", default=None, metavar="MODE", help="verify mode (the output's precision)")
    add_draft_model_arg(p)
    p.add_argument("--gamma", type=int, default=4, help="most drafted tokens per round (0: autoregressive)")
    p.add_argument("--group-size", type=int, default=128, help="quantization group size along K")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--kv", default=None, choices=KV_FORMATS,
                   help="KV cache format, in place of the recipe's: bf16, int8, or hier (a draft reads its upper "
                        "plane)")
    p.add_argument("--kv-group", type=int, default=None, help="tokens per KV quantization group (default 128)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="a draft mode's head reads only the N most frequent tokens (fewer bytes a draft step; "
                        "the verify pass keeps every token, so the output is unchanged)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model across N processes (one GPU each with --device cuda; gloo on the CPU)")


def add_draft_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None, metavar="NAME_OR_PATH",
                   help="recipe draft-model: the model that drafts (same tokenizer; --draft: its mode, default the "
                        "verify mode)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, streamed to stdout; stats to stderr")
    add_model_args(g)
    g.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--fixed-gamma", action="store_true",
                   help="draft --gamma tokens every round (default: a measured-cost policy picks up to --gamma)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text + stats) instead of streaming")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bs = bench.add_parser("serve", help="closed-loop serving throughput and latency, AR vs recipes")
    add_serve_bench_args(bs)
    add_prefill_chunk_arg(bs)
    add_prefill_wait_arg(bs)
    add_decode_steps_arg(bs)
    for name, (_, help_) in GPU_BENCHES.items():  # each parses its own arguments (`selfspec bench NAME --help`)
        bench.add_parser(name, help=help_, add_help=False)
    e = sub.add_parser("eval", help="accuracy of modes and recipes (GSM8K, HumanEval, MATH-500, perplexity)")
    e.add_argument("--model", default=None, help="named model, HF directory or .gguf file (default: smollm2-135m)")
    e.add_argument("--tasks", default="gsm8k,humaneval,math500,ppl", help="comma-separated tasks")
    e.add_argument("--modes", default="bf16,w8a16,w4a16,w4a8,w4a4", help="modes run autoregressively ('' for none)")
    e.add_argument("--recipes", default="qspec,planes", help="speculative recipes ('' for none)")
    e.add_argument("--limit", type=int, default=None, help="items per task (ppl: 512-token windows, at most 64)")
    e.add_argument("--seed", type=int, default=None, help="pick the --limit items from a seeded shuffle")
    e.add_argument("--gamma", type=int, default=4, help="drafted tokens per round for the recipes")
    add_draft_model_arg(e)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--chat", action="store_true", help="GSM8K / MATH prompts in the chat template (instruct models)")
    e.add_argument("--data", action="append", default=[], metavar="TASK=PATH", help="read a task's items from PATH")
    e.add_argument("--out", default=None, help="results directory (default: eval-results/MODEL)")
    e.add_argument("--group-size", type=int, default=128, help="quantization group size along K")
    e.add_argument("--device", default="cpu", help="cpu or cuda")
    e.add_argument("--cached-only", action="store_true", help="generate nothing: report the results already in --out")
    e.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help="sequences the engine generates together (results do not depend on it)")
    add_prefill_chunk_arg(e)
    e.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split each model across N processes (one GPU each; gloo on the CPU)")
    e.add_argument("--unsafe-sandbox", action="store_true",
                   help="where Linux namespaces are unavailable, run HumanEval's generated code unconfined")
    c = sub.add_parser("calibrate-skip", help="choose the layers `--recipe layerskip` drafts without (measured)")
    add_calibrate_skip_args(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    add_model_args(s)  # here --gamma caps drafts per round (a request's gamma too); the policy picks within it
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: --model or smollm2-135m)")
    s.add_argument("--max-batch", type=int, default=32, help="sequences decoded together")
    s.add_argument("--max-queue", type=int, default=256, help="waiting requests before new ones get 429")
    s.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: max-batch x 1024 tokens)")
    s.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (divides 128 or is a multiple of 128)")
    add_prefill_chunk_arg(s)
    add_prefill_wait_arg(s)
    add_decode_steps_arg(s)
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT / SIGTERM (new ones get 503 meanwhile); "
                        "those still running then end with a 503 or a stream error event")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body accepted; bigger ones get 413 (default: 1 MiB)")
    s.add_argument("--replicas", type=int, default=1,
                   help="engine replicas behind the one endpoint, on Ray Serve (one GPU each where there are GPUs)")
    s.add_argument("--ray-address", default=None,
                   help="Ray cluster to join for the replicas (default: start a local one); implies Ray Serve")
    return parser


def read_stdin() -> str:
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as e:
        raise SelfspecError(f"stdin is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); convert it to UTF-8 "
                            "first, e.g. with iconv -f latin1 -t utf-8") from None


def cmd_generate(args: argparse.Namespace) -> None:
    import selfspec
    from selfspec.engine.llm import check_prompt
    from selfspec.speculative.sampling import SamplingParams

    prompt = args.prompt if args.prompt is not None else read_stdin()
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.max_new_tokens, args.stop)
    check_prompt(prompt)
    llm = selfspec.load(args.model, args.recipe, args.draft, args.verify, args.gamma, args.group_size, args.device,
                        fixed_gamma=args.fixed_gamma, draft_model=args.draft_model, kv=args.kv,
                        kv_group=args.kv_group, tensor_parallel=args.tensor_parallel, draft_vocab=args.draft_vocab)
    try:
        out = None
        for text, _, out in llm.stream(prompt, params, chat=args.chat):
            if not args.json:
                print(text, end="", flush=True)
    finally:
        llm.close()
    r = llm.recipe
    drafts = r.draft is not None and llm.gamma > 0  # else the run is autoregressive: no draft, no gamma
    info = {"model": llm.description, "recipe": r.name, "storage": r.storage, "draft": r.draft if drafts else None,
            "verify": r.verify, "gamma": llm.gamma if drafts else 0, "kv": r.kv,
            "draft_vocab": r.draft_vocab if drafts else 0}
    if r.draft_model is not None:
        info["draft_model"] = llm.drafter.memory()  # what drafting adds: weights and KV bytes
    if args.tensor_parallel > 1:
        info["tensor_parallel"] = {"size": args.tensor_parallel, "weight_bytes_per_rank": llm.rank_weight_bytes}
    if args.json:
        print(json.dumps({"text": out.text, "finish_reason": out.finish_reason, **info, "stats": out.stats.to_dict()}))
    else:
        print()
        skip = f" skipping layers {','.join(map(str, r.skip_layers))}" if r.skip_layers else ""
        skip += f" over {r.draft_vocab} tokens" if r.draft_vocab else ""
        how = f"draft {r.draft}{skip}, verify {r.verify}, gamma {llm.gamma}" if drafts else \
            f"verify {r.verify}, autoregressive"
        kv = "" if r.kv == "bf16" else f", {r.kv} KV (group {r.kv_group})"
        print(f"[{info['model']} | recipe {r.name}: {r.storage} weights{kv}, {how}] {out.stats.summary()}",
              file=sys.stderr)


# `selfspec bench NAME` -> selfspec.bench.MODULE.main(arguments); all on the GPU but CPU_BENCHES.
GPU_BENCHES = {
    "all": ("suite", "every GPU measurement in one run: JSON, markdown report and PNG plots"),
    "steps": ("steps", "AR tokens/s per mode and batch, draft / verify pass times (CUDA graphs)"),
    "gemm": ("gemm", "per-layer GEMM time vs M for every mode, vs cuBLAS"),
    "prefill": ("prefill", "prefill tokens/s vs a cuBLAS + SDPA peer on the same weights and HF transformers"),
    "spec": ("spec", "speculative tokens/s with acceptance replayed from recorded traces"),
    "peer": ("peer", "HF transformers generate on the same shape"),
    "trace": ("traces", "record acceptance traces on a real model"),
    "tune": ("tune_linear", "search the linear kernel's tile configs"),
    "lookup": ("lookup", "host cost of the n-gram lookup drafter per round (batch x history length)"),
    "trees": ("trees", "accepted drafts per round of chain vs tree drafters on a real model (CPU or GPU)"),
    "draft_vocab": ("draft_vocab", "acceptance of a draft over the N most frequent tokens (CPU or GPU)"),
    "resources": ("kernel_resources", "registers, spills, MMA of linear and quantized-attention tiles (sm_90, no GPU)"),
    "long_context": ("long_context", "quantized KV cache at 4k-128k context: attention time, KV memory, step times"),
    "quant_attention": ("quant_attention", "quantized KV attention vs bf16 at 16k-128k, decode and verify queries"),
    "ab": ("ab", "a benchmark (steps, gemm) from an old source tree and from this one in turn: each row's new / old"),
    "policy": ("policy_replay", "the gamma policy through a trace's recorded texts at given pass costs (no model)"),
    "replicas": ("replicas", "tokens/s of N engine replicas on Ray Serve against one (GPU, or CPU with --model)"),
}
# spec: --tables --device cpu; replicas: --device cpu --model M
CPU_BENCHES = ("trace", "lookup", "trees", "draft_vocab", "resources", "spec", "policy", "replicas")


def cmd_bench(args: argparse.Namespace) -> None:
    if args.bench == "serve":
        from selfspec.bench.serve import run

        run(args)
        return
    import importlib

    import torch

    wants_help = {"-h", "--help"} & set(args.args)
    if args.bench not in CPU_BENCHES and not wants_help and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise SelfspecError(f"`selfspec bench {args.bench}` needs a CUDA GPU ({why}); "
                            "`selfspec bench serve`, `trace`, `lookup`, `trees`, `draft_vocab`, `policy`, `spec "
                            "--tables --device cpu` and `replicas --device cpu` run on the CPU")
    module = importlib.import_module(f"selfspec.bench.{GPU_BENCHES[args.bench][0]}")
    module.main(args.args, prog=f"selfspec bench {args.bench}")


def cmd_eval(args: argparse.Namespace) -> None:
    from selfspec.eval.command import run_command

    run_command(args)


def cmd_calibrate_skip(args: argparse.Namespace) -> None:
    from selfspec.speculative.layer_skip import run

    run(args, log=lambda line: print(line, file=sys.stderr, flush=True))


def cmd_serve(args: argparse.Namespace) -> None:
    from selfspec.serve.server import serve

    serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench" and args.bench in GPU_BENCHES:
        args.args = rest  # the benchmark module parses them
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        commands = {"generate": cmd_generate, "eval": cmd_eval, "bench": cmd_bench, "serve": cmd_serve,
                    "calibrate-skip": cmd_calibrate_skip}
        commands[args.command](args)
    except SelfspecError as e:
        print(f"selfspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
