"""Acceptance of the `planes` recipe's `upper` draft, and of other ways to quantize the upper plane, estimated
teacher-forced on the CPU.

python -m selfspec.bench.upper_acceptance --model qwen2.5-coder-1.5b --prompts 10 --max-new-tokens 64 \
    [--variants floor-g128 rtn-g128 ...] [--validate-gamma 4] [--trace-out selfspec/bench/traces]

1. Continuations: each prompt's greedy continuation in the verify mode `full` (planes, g128), batched AR decoding
   by the engine. Weights are held dense as `full` dequantizes them (the same products, no per-step dequantization).
2. The prompts' KV is written once by `full` g128 (a real loop's prefill is a verify pass too). Then every weight
   config runs ONE teacher-forced pass over the continuation tokens, batched over prompts, reading that prompt KV.
3. Per continuation position: draft argmax == its verify config's argmax. That top-1 agreement is the per-token
   acceptance of a greedy draft conditioned on the verified tokens. Approximation: here the draft reads its own KV
   for every earlier continuation position; a real round reads verify KV for everything committed before the
   round and draft KV only for the round's earlier drafts (`--validate-gamma` compares with the real loop).
4. Rounds at gamma k implied by the agreement sequence (a trace, selfspec/bench/traces.py): a round accepts the
   run of agreements from its start, capped at k, then advances by accepted + 1 (the verify pass's own token).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from selfspec.bench.serve import read_prompts
from selfspec.bench.traces import TRACE_DIR
from selfspec.engine.engine import Engine
from selfspec.engine.llm import LLM, load
from selfspec.engine.stats import GenerationStats
from selfspec.loading import resolve
from selfspec.model import Linear, Transformer
from selfspec.quant.formats import (DenseWeight, Int8PlanesWeight, affine_dequant_, fit_group_size,
                                    minmax_quant)
from selfspec.quant.modes import MODES
from selfspec.speculative.policy import expected_tokens
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.layer_skip import accepted_per_round, padded
from selfspec.speculative.sampling import SamplingParams

# A weight config: float weight [N, K] and group size -> the float weight a mode computes with.
Build = Callable[[torch.Tensor, int], torch.Tensor]


def full_int8(w: torch.Tensor, g: int) -> torch.Tensor:
    """Today's verify weight: group-wise INT8, both planes."""
    return Int8PlanesWeight(w, g).dequantize(MODES["full"])


def upper_floor(w: torch.Tensor, g: int) -> torch.Tensor:
    """Today's draft weight: upper nibble = floor(q8 / 16), offset to the middle of the lower plane's range."""
    return Int8PlanesWeight(w, g).dequantize(MODES["upper"])


def upper_nearest(w: torch.Tensor, g: int) -> torch.Tensor:
    """Upper nibble = round(q8 / 16), clamped to 15, on the grid lo + 16 s u. Not representable as planes:
    q8 - 16 u spans -8..15, more than 4 bits."""
    q8, scale, lo = minmax_quant(w, 8, fit_group_size(w.shape[1], g))
    return affine_dequant_((q8.float() / 16).round().clamp(0, 15), scale * 16, lo)


def upper_rtn(w: torch.Tensor, g: int) -> torch.Tensor:
    """An independent round-to-nearest INT4 (min/max g, float32 scale and offset). Representable: it is the upper
    plane of full_widened."""
    n, k = w.shape
    g = fit_group_size(k, g)
    wg = w.float().view(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-10)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return affine_dequant_(q.view(n, k), scale, lo)


def full_widened(w: torch.Tensor, g: int) -> torch.Tensor:
    """INT8 over [lo - 7.5 s, hi + 7.5 s], s = (hi - lo) / 240: its floor(q8 / 16) is the RTN INT4 of w (up to
    ties), and the planes' upper affine (16 s, lo' + 7.5 s) is that INT4's (scale, lo). Changes the INT8 codes:
    its step is 255/240 of today's."""
    n, k = w.shape
    g = fit_group_size(k, g)
    wg = w.float().view(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 240).clamp_min(1e-10)
    lo = lo - 7.5 * scale
    q8 = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 255)
    return affine_dequant_(q8.view(n, k), scale, lo)


def upper_lsq(w: torch.Tensor, g: int) -> torch.Tensor:
    """Today's upper codes floor(q8 / 16) (so the INT8 codes stay exact), with each group's scale and offset
    fitted by least squares: the lowest upper-plane error those codes allow (costs a second (scale, lo) per group
    in storage; the upper mode still reads one pair)."""
    n, k = w.shape
    g = fit_group_size(k, g)
    q8, scale, lo = minmax_quant(w, 8, g)
    u = (q8 >> 4).float().view(n, k // g, g)
    wg = w.float().view(n, k // g, g)
    du = u - u.mean(-1, keepdim=True)
    var = du.pow(2).sum(-1)
    fitted = (du * wg).sum(-1) / var.clamp_min(1e-20)
    s_up = torch.where(var > 0, fitted, scale * 16)  # a group of one code keeps today's scale
    lo_up = wg.mean(-1) - s_up * u.mean(-1)
    return affine_dequant_(u.view(n, k).clone(), s_up, lo_up)


# name -> (draft build, verify build, group size)
VARIANTS: dict[str, tuple[Build, Build, int]] = {
    "floor-g128": (upper_floor, full_int8, 128),
    "floor-g64": (upper_floor, full_int8, 64),
    "floor-g32": (upper_floor, full_int8, 32),
    "nearest-g128": (upper_nearest, full_int8, 128),
    "rtn-g128": (upper_rtn, full_widened, 128),
    "rtn-g64": (upper_rtn, full_widened, 64),
    "lsq-g128": (upper_lsq, full_int8, 128),
    "lsq-g64": (upper_lsq, full_int8, 64),
}
NOTES = {
    "floor-g128": "today: floor(q8/16) + 7.5 offset",
    "floor-g64": "today's rule, g64 (INT8 g64 too)",
    "floor-g32": "today's rule, g32 (INT8 g32 too)",
    "nearest-g128": "round(q8/16): not representable as planes",
    "rtn-g128": "RTN INT4 upper; INT8 range widened 7.5 codes/side (INT8 codes change)",
    "rtn-g64": "RTN INT4 upper, g64; INT8 widened (codes change)",
    "lsq-g128": "floor codes, least-squares scale+offset per group; INT8 exact",
    "lsq-g64": "floor codes, least-squares scale+offset, g64; INT8 exact",
}


def agreement(draft_logits: torch.Tensor, verify_logits: torch.Tensor) -> torch.Tensor:
    """Per position: does the draft's argmax equal the verify's? [..., vocab] -> bool [...]."""
    return draft_logits.argmax(-1) == verify_logits.argmax(-1)


def predicted_speedup(a: float, k: int, c: float) -> float:
    """Over AR in the verify mode, a verify pass of k+1 tokens costing one AR step, a draft step c of one."""
    return expected_tokens(a, k) / (1 + k * c)


def set_weights(model: Transformer, originals: dict[str, torch.Tensor], build: Build, g: int) -> None:
    """Every block linear computes with build(original weight), held dense (run the model in mode fp32)."""
    for name, lin in model.named_modules():
        if name in originals:
            lin.weight = DenseWeight(build(originals[name], g))


def continuations(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy AR continuations of all prompts, batched by the engine."""
    engine = Engine(llm, max_batch=len(prompts))
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_new_tokens=max_new_tokens), gamma=0)
    out = {}
    while engine.has_work():
        for r in engine.step():
            if r.finished:
                out[int(r.request_id)] = r.generation.token_ids
    return [out[i] for i in range(len(prompts))]


class TeacherForced:
    """Prompts prefilled once (their KV written by the current weights), then argmaxes over the continuations.
    Right padding is harmless: a query reads keys at positions <= its own only, all written by real tokens."""

    def __init__(self, model: Transformer, prompts: list[list[int]], conts: list[list[int]]):
        self.model = model
        self.starts = torch.tensor([len(p) for p in prompts])
        self.tokens = padded(conts)
        self.cache = model.new_cache(int(self.starts.max()) + self.tokens.shape[1], batch=len(prompts))
        with torch.inference_mode():
            tokens = padded(prompts)
            model.hidden(tokens, torch.arange(tokens.shape[1]), self.cache, MODES["fp32"])

    def argmax(self) -> torch.Tensor:
        """[B, T]: the argmax after each continuation token under the model's current weights."""
        pos = self.starts[:, None] + torch.arange(self.tokens.shape[1])
        with torch.inference_mode():
            h = self.model.hidden(self.tokens, pos, self.cache, MODES["fp32"])
            return self.model.logits(h, MODES["fp32"]).argmax(-1)


def agreements(tf: TeacherForced, originals: dict[str, torch.Tensor], conts: list[list[int]], names: list[str],
               loaded: tuple[Build, int] = (full_int8, 128)) -> dict[str, list[list[bool]]]:
    """Per variant, per prompt: draft argmax == verify argmax after each continuation token but the last.
    `loaded`: the config the model holds now (rebuilding 1B+ weights costs minutes on the CPU)."""
    model, verify_argmax, out = tf.model, {}, {}
    for name in names:
        draft, verify, g = VARIANTS[name]
        if (verify, g) not in verify_argmax:
            if loaded != (verify, g):
                set_weights(model, originals, verify, g)
            verify_argmax[verify, g] = tf.argmax()
        set_weights(model, originals, draft, g)
        loaded = (draft, g)
        agree = tf.argmax() == verify_argmax[verify, g]
        out[name] = [agree[i, : len(c) - 1].tolist() for i, c in enumerate(conts)]
        print(f"{name}: agreement {mean_agreement(out[name]):.3f}", flush=True)
    return out


def mean_agreement(agree: list[list[bool]]) -> float:
    flat = [x for row in agree for x in row]
    return sum(flat) / max(len(flat), 1)


def study(model_name: str | None, tasks: list[str], n_prompts: int, max_new_tokens: int,
          names: list[str]) -> tuple[dict, dict[str, list[list[int]]]]:
    """All tasks' prompts in one batch (each weight config is built once) ->
    ({task: {variant: per-prompt agreements}}, {task: continuations})."""
    cfg, sd, tokenizer, description = resolve(model_name)
    model = Transformer(cfg, sd)
    sd.clear()
    originals = {name: m.weight.weight for name, m in model.named_modules() if isinstance(m, Linear)}
    set_weights(model, originals, full_int8, 128)
    llm = LLM(model, tokenizer, resolve_recipe("ar"), description=description)
    labels = [task for task in tasks for _ in read_prompts(task)[:n_prompts]]
    prompts = [llm.encode(t, chat=True) for task in tasks for t in read_prompts(task)[:n_prompts]]
    conts = continuations(llm, prompts, max_new_tokens)
    print(f"{len(prompts)} prompts, {sum(map(len, conts))} continuation tokens", flush=True)
    agree = agreements(TeacherForced(model, prompts, conts), originals, conts, names)
    by_task = {task: {name: [a for a, label in zip(agree[name], labels) if label == task] for name in names}
               for task in tasks}
    return by_task, {task: [c for c, label in zip(conts, labels) if label == task] for task in tasks}


def validate(model_name: str | None, tasks: list[str], n_prompts: int, max_new_tokens: int, gamma: int,
             estimated: dict) -> dict:
    """The real speculative loop (planes, greedy) on the same prompts vs the estimate's implied rounds."""
    llm = load(model_name, "planes", gamma=gamma, fixed_gamma=True)
    out = {}
    for task in tasks:
        t = GenerationStats.total(llm.generate(text, SamplingParams(max_new_tokens=max_new_tokens), chat=True).stats
                                  for text in read_prompts(task)[:n_prompts])
        implied = [r for row in estimated[task]["floor-g128"] for r in accepted_per_round(row, gamma)]
        out[task] = {"real_acceptance": t.acceptance_rate, "real_mean_accepted": t.draft_accepted / max(t.rounds, 1),
                     "estimated_acceptance": sum(implied) / max(gamma * len(implied), 1),
                     "estimated_mean_accepted": sum(implied) / max(len(implied), 1),
                     "estimated_per_token": mean_agreement(estimated[task]["floor-g128"]),
                     "real_per_token": t.per_token_acceptance}
    return out


def write_trace(path: Path, model_name: str, variant: str, agree: dict, gamma: int, n_prompts: int,
                max_new_tokens: int) -> None:
    """A trace in selfspec/bench/traces.py's format, labelled as estimated teacher-forced on the CPU."""
    trace = {"model": model_name, "recipe": "planes", "draft": "upper", "verify": "full", "gamma": gamma,
             "max_new_tokens": max_new_tokens,
             "source": f"teacher-forced on CPU (selfspec.bench.upper_acceptance), upper variant {variant}, "
                       f"{n_prompts} prompts per task",
             "tasks": {task: [r for row in per[variant] for r in accepted_per_round(row, gamma)]
                       for task, per in agree.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    print(f"wrote {path}")


def table(agree: dict, names: list[str], ks=(2, 4, 8), costs=(0.5, 0.83)) -> str:
    tasks = list(agree)
    head = ["variant", *(f"a {t}" for t in tasks), *(f"tok/round k={k}" for k in ks),
            *(f"speedup k={k} c={c}" for c in costs for k in ks), "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        per_task = [mean_agreement(agree[t][name]) for t in tasks]
        a = mean_agreement([row for t in tasks for row in agree[t][name]])  # over all positions
        cells = [name, *(f"{x:.3f}" for x in per_task), *(f"{expected_tokens(a, k):.2f}" for k in ks),
                 *(f"{predicted_speedup(a, k, c):.2f}x" for c in costs for k in ks), NOTES[name]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval"])
    ap.add_argument("--prompts", type=int, default=10, help="prompts per task (the first ones)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--validate-gamma", type=int, default=0, help="also run the real loop at this gamma")
    ap.add_argument("--trace-gamma", type=int, default=8)
    ap.add_argument("--trace-out", type=Path, default=None, help=f"write traces here (e.g. {TRACE_DIR})")
    ap.add_argument("--json", type=Path, default=None, help="write all agreements here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    agree, conts = study(args.model, args.tasks, args.prompts, args.max_new_tokens, args.variants)
    print(table(agree, args.variants))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "trace_out": str(
            args.trace_out)}, "agreement": agree, "continuations": conts}))
    if args.trace_out:
        write_trace(args.trace_out / f"{args.model}.planes.teacher-forced.json", args.model, "floor-g128", agree,
                    args.trace_gamma, args.prompts, args.max_new_tokens)
    if args.validate_gamma:
        v = validate(args.model, args.tasks, args.prompts, args.max_new_tokens, args.validate_gamma, agree)
        print(f"real loop vs teacher-forced estimate (floor-g128, gamma {args.validate_gamma}):")
        print(json.dumps(v, indent=1))


if __name__ == "__main__":
    main()
