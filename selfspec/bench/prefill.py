"""Prefill tokens/s: our model against a cuBLAS + SDPA eager peer on the same weights, and HF transformers (sdpa).

python -m selfspec.bench.prefill [--shape llama-3-8b] [--sizes 1x512 1x2048 1x8192 8x512] [--modes bf16 full w4a16]

Both run a whole prompt from position 0 and compute the logits of each row's last position only. The peer is
plain torch on our dense model's own bf16 tensors: F.linear (cuBLAS) for every projection,
F.scaled_dot_product_attention (causal, GQA) for attention, torch ops for norms, RoPE and SwiGLU. Synthetic
weights (randn * 0.02), labelled so.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from selfspec.bench.device import time_ms
from selfspec.bench.synthetic import synthetic_model
from selfspec.kernels import reference
from selfspec.model import Transformer
from selfspec.quant.modes import MODES, prompt_mode

STORAGE = {"bf16": "dense", "w8a16": "int8", "w8a8": "int8", "w4a16": "int4", "upper": "planes", "full": "planes"}


def peer_prefill(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Last-position logits [B, vocab] of a dense bf16 model, from torch ops alone (no KV cache kept)."""
    cfg = model.cfg
    b, t = tokens.shape
    cos, sin = model.cos[:t][None], model.sin[:t][None]
    x = model.embed[tokens]
    for layer in model.layers:
        att = layer.attention
        h = reference.rms_norm(x, layer.attention_norm.weight, cfg.norm_eps)
        q, k, v = F.linear(h, att.wqkv.weight.weight, att.wqkv.bias).split(att.sizes, dim=-1)
        q, k, v = (z.view(b, t, -1, cfg.head_dim).transpose(1, 2) for z in (q, k, v))
        q, k = reference.rope(q, cos, sin), reference.rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), att.wo.weight.weight)
        h = reference.rms_norm(x, layer.ffn_norm.weight, cfg.norm_eps)
        gate, up = F.linear(h, layer.feed_forward.gate_up.weight.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.feed_forward.down.weight.weight)
    x = reference.rms_norm(x[:, -1], model.norm.weight, cfg.norm_eps)
    return F.linear(x, model.lm_head.weight).float()


def our_prefill(model: Transformer, tokens: torch.Tensor, mode_name: str) -> torch.Tensor:
    """Last-position logits [B, vocab], the prompt's KV written into a fresh cache (as a serving prefill does)."""
    b, t = tokens.shape
    cache = model.new_cache(t, b)
    mode = prompt_mode(MODES[mode_name])
    hidden = model.hidden(tokens, torch.arange(t, device=tokens.device), cache, mode)
    return model.logits(hidden[:, -1], mode)


def hf_prefill_tokens_per_s(shape: str, sizes: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    from selfspec.bench.peer import hf_model

    model = hf_model(shape)
    model.config._attn_implementation = "sdpa"
    out = {}
    for b, t in sizes:
        tokens = torch.randint(0, model.config.vocab_size, (b, t), device="cuda")
        with torch.inference_mode():
            ms = time_ms(lambda m=model, x=tokens: m(x, logits_to_keep=1, use_cache=False), warmup=2, reps=5)
        out[(b, t)] = b * t / ms * 1000
    del model
    torch.cuda.empty_cache()
    return out


def measure(shape: str, sizes: list[tuple[int, int]], modes: list[str], hf: bool) -> list[dict]:
    rows = []
    models: dict[str, Transformer] = {}
    dense = synthetic_model(shape, "dense")
    vocab = dense.cfg.vocab_size
    prompts = {s: torch.randint(0, vocab, s, device="cuda") for s in sizes}
    with torch.inference_mode():
        peer = {s: time_ms(lambda s=s: peer_prefill(dense, prompts[s]), warmup=2, reps=5) for s in sizes}
        check = {s: (peer_prefill(dense, prompts[s]) - our_prefill(dense, prompts[s], "bf16")).abs().max().item()
                 for s in sizes[:1]}
    print(f"peer vs ours (bf16) max |logit diff| at {sizes[0]}: {check[sizes[0]]:.3g} (a sanity check of the peer)")
    hf_tps = hf_prefill_tokens_per_s(shape, sizes) if hf else {}
    for mode in modes:
        storage = STORAGE[mode]
        if storage not in models:
            models.clear()
            torch.cuda.empty_cache()
            models[storage] = dense if storage == "dense" else synthetic_model(shape, storage)
        model = models[storage]
        for b, t in sizes:
            with torch.inference_mode():
                ms = time_ms(lambda: our_prefill(model, prompts[(b, t)], mode), warmup=2, reps=5)
            row = {"shape": shape, "synthetic": True, "mode": mode, "batch": b, "tokens": t, "ms": ms,
                   "tokens_per_s": b * t / ms * 1000, "peer_ms": peer[(b, t)],
                   "peer_tokens_per_s": b * t / peer[(b, t)] * 1000, "hf_tokens_per_s": hf_tps.get((b, t))}
            row["vs_peer"] = row["tokens_per_s"] / row["peer_tokens_per_s"]
            rows.append(row)
            hf_txt = f", HF sdpa {row['hf_tokens_per_s']:,.0f}" if hf else ""
            print(f"{mode:6s} B={b} T={t:5d}: {row['tokens_per_s']:9,.0f} tok/s, peer {row['peer_tokens_per_s']:9,.0f}"
                  f" ({row['vs_peer']:.2f}x){hf_txt}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| mode | B x T | tok/s | cuBLAS + SDPA peer tok/s | x peer | HF sdpa tok/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        hf = f"{r['hf_tokens_per_s']:,.0f}" if r.get("hf_tokens_per_s") else "-"
        out.append(f"| {r['mode']} | {r['batch']} x {r['tokens']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['peer_tokens_per_s']:,.0f} | {r['vs_peer']:.2f} | {hf} |")
    return "\n".join(out)


def size(text: str) -> tuple[int, int]:
    b, _, t = text.partition("x")
    if not (b.isdigit() and t.isdigit()) or int(b) < 1 or int(t) < 1:
        raise argparse.ArgumentTypeError(f"a size is BATCHxTOKENS, e.g. 8x512; got '{text}'")
    return int(b), int(t)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--sizes", type=size, nargs="+", default=[(1, 512), (1, 2048), (1, 8192), (8, 512)])
    ap.add_argument("--modes", nargs="+", default=["bf16", "full", "w4a16"], choices=list(STORAGE))
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers (it builds a second bf16 model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = measure(args.shape, args.sizes, args.modes, not args.no_hf)
    print(f"\n{torch.cuda.get_device_name()}, {args.shape} (synthetic weights), prefill from position 0\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
