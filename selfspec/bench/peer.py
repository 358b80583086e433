"""The peer: HF transformers `generate` on the same shape (synthetic weights, its own random init), batch 1,
greedy, from a random prompt of `context` tokens: eager, and with a static cache + torch.compile.

python -m selfspec.bench.peer [--shape llama-3-8b] [--compile]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from selfspec.bench.shapes import SHAPES


def hf_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    c = SHAPES[shape]
    cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if c.arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cls(hidden_size=c.dim, intermediate_size=c.hidden_dim, num_hidden_layers=c.n_layers,
              num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, vocab_size=c.vocab_size,
              rms_norm_eps=c.norm_eps, max_position_embeddings=c.max_seq_len, head_dim=c.head_dim)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_cls(cfg).eval()  # its own init: normal(0, 0.02) weights, never zeros
    torch.set_default_dtype(torch.float32)
    return model


def decode_tokens_per_s(model, context: int, new_tokens: int) -> float:
    """(new_tokens - 1) / (time of new_tokens - time of 1): decode speed, prefill excluded."""
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(new_tokens)  # warm-up (and, compiled, the compilation)
    return (new_tokens - 1) / (run(new_tokens) - run(1))


def measure(shape: str, context: int, new_tokens: int, compiled: bool) -> list[dict]:
    model = hf_model(shape)
    rows = [{"peer": "transformers eager", "shape": shape, "synthetic": True, "batch": 1, "context": context,
             "tokens_per_s": decode_tokens_per_s(model, context, new_tokens)}]
    if compiled:
        # A static cache makes `generate` compile the decoding forward itself (CUDA graphs, "reduce-overhead");
        # compiling `forward` by hand instead overwrote the graphs' cache outputs between calls (transformers 5.17).
        model.generation_config.cache_implementation = "static"
        rows.append({**rows[0], "peer": "transformers static cache + torch.compile",
                     "tokens_per_s": decode_tokens_per_s(model, context, new_tokens)})
    for r in rows:
        print(f"{r['peer']}: {r['tokens_per_s']:.1f} tok/s ({shape}, synthetic, batch 1, context {context})",
              flush=True)
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.shape, args.context, args.new_tokens, args.compile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
