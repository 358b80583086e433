"""Layer-skip self-drafts: the draft runs its mode with some layers skipped, the set chosen by calibration.

selfspec calibrate-skip [--model M] [--draft upper] [--verify full] [--device cpu]

1. Calibration text: chat prompts from the installed GSM8K, HumanEval and MT-Bench packages (their last items),
   each continued greedily by the verify mode (batched AR through the engine).
2. Teacher-forced: the prompts' KV is written once by the verify mode (as a real prefill is), the verify mode's
   argmax after each continuation token is taken once, then each candidate skip set runs one draft pass over the
   continuations. A round at gamma k accepts the run of positions where the draft's argmax equals the verify's
   (capped at k), then takes the verify's token. As in selfspec/bench/upper_acceptance.py, the draft reads its own
   KV at earlier continuation positions where a real round reads the verify's: the estimate is a little low.
3. Cost, measured on the device: a verify pass of k+1 tokens t_v(k) (t_v(0): an AR step) and a draft step
   without skips and with every layer skipped (embedding, norm and head); a step skipping s of L layers costs
   t_fixed + (t_draft - t_fixed) * (L - s) / L, as every layer has the same shape.
4. Expected speedup over AR in the verify mode: max over k of tokens per round * t_v(0) / (k t_d + t_v(k)).
   Greedy: from no skip, add the layer whose skipping gives the best expected speedup, a few steps past the best.
   A candidate's pass resumes at the layer it adds: the layers before it run as in the current set's pass.
5. The result is a small JSON in the cache directory, per model, stored format, draft and verify mode, group size
   and device kind; `--recipe layerskip` reads it.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from selfspec.errors import SelfspecError
from selfspec.loading.cache import cache_dir
from selfspec.model import ForwardBatch, Transformer
from selfspec.quant.modes import Mode
from selfspec.speculative.recipes import Recipe

CALIBRATION_TASKS = ("gsm8k", "humaneval", "mtbench")


def calibration_path(model: str | None, recipe: Recipe, group_size: int, device: str) -> Path:
    """Where the calibration of this model, recipe (its storage, draft and verify modes), group size and device
    kind lives. A model given as a path is named by its absolute path."""
    from selfspec.loading.named import DEFAULT_MODEL, NAMED_MODELS

    name = model or DEFAULT_MODEL
    if name not in NAMED_MODELS:
        name = str(Path(name).resolve())
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")
    kind = torch.device(device).type
    return (cache_dir() / "layer-skip" /
            f"{slug}.{recipe.storage}.{recipe.draft}-{recipe.verify}.g{group_size}.{kind}.json")


def calibrated_recipe(recipe: Recipe, model: str | None, group_size: int, device: str, n_layers: int) -> Recipe:
    """The recipe with the skipped layers its calibration chose; refuses, saying how to calibrate, without one."""
    path = calibration_path(model, recipe, group_size, device)
    if not path.is_file():
        args = f"--model {model} " if model else ""
        args += f"--draft {recipe.draft} --verify {recipe.verify} --group-size {group_size} --device {device}"
        raise SelfspecError(f"recipe '{recipe.name}' skips the layers a calibration chose, and {path} does not exist; "
                            f"calibrate first (a few minutes on a CPU): selfspec calibrate-skip {args}")
    skip = json.loads(path.read_text())["skip_layers"]
    if any(not 0 <= i < n_layers for i in skip):
        raise SelfspecError(f"{path} skips layers {skip}, but the model has {n_layers} layers; calibrate again")
    return replace(recipe, skip_layers=tuple(skip))


@dataclass
class Costs:
    """Measured seconds: verify[k] a verify pass of k+1 tokens; draft a draft step; fixed the draft step with
    every layer skipped."""
    verify: list[float]
    draft: float
    fixed: float
    n_layers: int

    def draft_step(self, skipped: int) -> float:
        return self.fixed + (self.draft - self.fixed) * (self.n_layers - skipped) / self.n_layers


@dataclass
class Candidate:
    skip_layers: list[int]
    agreement: float  # per-token: the draft's argmax equals the verify's
    gamma: int  # the drafts per round that maximise the expected speedup
    mean_accepted: float  # drafts accepted per round at that gamma
    expected_speedup: float  # over AR in the verify mode


def accepted_per_round(agree: list[bool], k: int) -> list[int]:
    """Accepted drafts per round of greedy speculation with k drafts over one sequence's agreements (agree[i]:
    the draft's token after position i is the verify's): a round starting at i accepts the run of agreements
    from i, capped at k, then commits the verify's token, so the next round starts at i + accepted + 1."""
    rounds, i = [], 0
    while i < len(agree):
        n = 0
        while n < k and i + n < len(agree) and agree[i + n]:
            n += 1
        rounds.append(n)
        i += n + 1
    return rounds


def score(skip: list[int], agree: list[list[bool]], costs: Costs) -> Candidate:
    """The gamma with the best expected speedup for this skip set, from its agreements and the costs."""
    best = None
    for k in range(1, len(costs.verify)):
        rounds = [n for row in agree for n in accepted_per_round(row, k)]
        accepted = sum(rounds) / len(rounds)
        speedup = (1 + accepted) * costs.verify[0] / (k * costs.draft_step(len(skip)) + costs.verify[k])
        if best is None or speedup > best.expected_speedup:
            best = Candidate(sorted(skip), 0.0, k, accepted, speedup)
    flat = [a for row in agree for a in row]
    best.agreement = sum(flat) / len(flat)
    return best


def padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows of any lengths as one [B, longest] tensor, right-padded with token 0."""
    t = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        t[i, : len(r)] = torch.tensor(r)
    return t


class TeacherForced:
    """The continuations' draft argmaxes under candidate skip sets, against the verify mode's (module docstring).
    Right padding is harmless: a query reads keys at positions <= its own only, all written by real tokens."""

    def __init__(self, model: Transformer, prompts: list[list[int]], conts: list[list[int]], verify: Mode,
                 draft: Mode):
        self.model, self.draft = model, draft
        dev = model.device
        starts = torch.tensor([len(p) for p in prompts], device=dev)
        self.tokens = padded(conts).to(dev)
        self.lengths = [len(c) for c in conts]
        self.cache = model.new_cache(int(starts.max()) + self.tokens.shape[1], batch=len(prompts))
        self.pos = starts[:, None] + torch.arange(self.tokens.shape[1], device=dev)
        with torch.inference_mode():
            prompt_tokens = padded(prompts).to(dev)
            model.hidden(prompt_tokens, torch.arange(prompt_tokens.shape[1], device=dev), self.cache, verify)
            self.target = self.run(verify, 0, model.embed[self.tokens])[0]
            argmax, self.inputs = self.run(draft, 0, model.embed[self.tokens])
        self.base = self.rows(argmax)  # the agreements of the draft as given

    def run(self, mode: Mode, start: int, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """From layer `start` with its input x: (argmax [B, T], each layer's input from `start` on)."""
        m = self.model
        fb = ForwardBatch(mode, self.pos, m.cos[self.pos], m.sin[self.pos], self.cache.slots(self.pos), self.cache)
        inputs = []
        for i in range(start, len(m.layers)):
            inputs.append(x)
            if i not in mode.skip_layers:
                x = m.layers[i](x, fb, i)
        return m.logits(m.norm(x), mode).argmax(-1), inputs

    @torch.inference_mode()
    def agreement(self, skip: frozenset[int]) -> tuple[list[list[bool]], list[torch.Tensor]]:
        """Per sequence, per continuation position: draft argmax == verify argmax with `skip` skipped; and every
        layer's input in that pass. `skip` must be the current set (the last pass's) plus one layer."""
        start = min(skip - self.draft.skip_layers, default=len(self.model.layers))
        argmax, tail = self.run(replace(self.draft, skip_layers=skip), start, self.inputs[start])
        return self.rows(argmax), self.inputs[:start] + tail

    def rows(self, argmax: torch.Tensor) -> list[list[bool]]:
        agree = (argmax == self.target).tolist()
        return [row[:n] for row, n in zip(agree, self.lengths)]

    def accept(self, skip: frozenset[int], inputs: list[torch.Tensor]) -> None:
        """Make `skip` the current set, whose pass gave these layer inputs."""
        self.draft, self.inputs = replace(self.draft, skip_layers=skip), inputs


def time_pass(runner, cache, mode: Mode, tokens: int, context: int, reps: int) -> float:
    """Median seconds of a batch-1 pass of `tokens` tokens at position `context` (then its cache is rolled back)."""
    dev = runner.device
    toks = torch.zeros(1, tokens, dtype=torch.long, device=dev)
    pos = context + torch.arange(tokens, device=dev)
    times = []
    with torch.inference_mode():
        for _ in range(reps + 2):  # two warmup passes (kernel compilation, graph capture)
            t0 = time.perf_counter()
            runner(toks, pos, cache, mode)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def measure_costs(llm, draft: Mode, max_gamma: int, context: int, reps: int) -> Costs:
    """Step costs on the LLM's device at batch 1 after `context` tokens of context (written by the verify mode)."""
    runner, model = llm.runner, llm.model
    cache = runner.new_cache(context + max_gamma + 1)
    dev = model.device
    with torch.inference_mode():
        runner(torch.zeros(1, context, dtype=torch.long, device=dev), torch.arange(context, device=dev), cache,
               llm.verify_mode, torch.tensor([context - 1], device=dev))
    verify = [time_pass(runner, cache, llm.verify_mode, k + 1, context, reps) for k in range(max_gamma + 1)]
    every = frozenset(range(model.cfg.n_layers))
    return Costs(verify, time_pass(runner, cache, draft, 1, context, reps),
                 time_pass(runner, cache, replace(draft, skip_layers=every), 1, context, reps), model.cfg.n_layers)


def choose_skip(tf: TeacherForced, costs: Costs, patience: int = 2, log=print) -> tuple[Candidate, list[Candidate]]:
    """Greedy: add the layer whose skipping gives the best expected speedup, going on `patience` steps past the
    best set so far (one more layer can cost more acceptance than it saves while two pay). Returns the best set
    and the greedy path (no skip first)."""
    top = score(sorted(tf.draft.skip_layers), tf.base, costs)
    best, path, stale = top, [top], 0
    log(f"skip {top.skip_layers}: agreement {top.agreement:.3f}, gamma {top.gamma}, "
        f"expected speedup {top.expected_speedup:.3f}")
    while len(top.skip_layers) < costs.n_layers - 1 and stale < patience:
        skip, top, top_inputs = tf.draft.skip_layers, None, None
        for layer in sorted(set(range(costs.n_layers)) - skip):
            agree, inputs = tf.agreement(skip | {layer})
            c = score(list(skip | {layer}), agree, costs)
            if top is None or c.expected_speedup > top.expected_speedup:
                top, top_inputs = c, inputs
        log(f"skip {top.skip_layers}: agreement {top.agreement:.3f}, gamma {top.gamma}, "
            f"expected speedup {top.expected_speedup:.3f}")
        tf.accept(frozenset(top.skip_layers), top_inputs)
        path.append(top)
        best, stale = (top, 0) if top.expected_speedup > best.expected_speedup else (best, stale + 1)
    return best, path


def chat_available(tokenizer) -> bool:
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def calibration_prompts(llm, n: int) -> list[list[int]]:
    """n prompts, round-robin over the calibration tasks, from the end of each file (benchmarks read the start)."""
    from selfspec.bench.serve import read_prompts

    per_task = [read_prompts(task)[::-1] for task in CALIBRATION_TASKS]
    texts = [per_task[i % len(per_task)][i // len(per_task)] for i in range(n)]
    return [llm.encode(t, chat=chat_available(llm.tokenizer)) for t in texts]


def calibrate(llm, model_name: str | None, prompts: list[list[int]], max_new_tokens: int, max_gamma: int,
              reps: int = 10, log=print) -> dict:
    """Choose the draft's skipped layers for `llm` (a speculative recipe, no skip) on these prompts; return the
    calibration record (what `calibrated_recipe` reads, and how it was chosen)."""
    from selfspec.bench.upper_acceptance import continuations
    from selfspec.loading.named import DEFAULT_MODEL

    if llm.draft_mode is None:
        raise SelfspecError("layer-skip calibration needs a speculative recipe (one with a draft mode)")
    t0 = time.perf_counter()
    conts = continuations(llm, prompts, max_new_tokens)
    keep = [i for i, c in enumerate(conts) if c]
    prompts, conts = [prompts[i] for i in keep], [conts[i] for i in keep]
    log(f"{len(prompts)} prompts, {sum(map(len, conts))} continuation tokens ({time.perf_counter() - t0:.1f} s)")
    context = max(1, sum(map(len, prompts)) // len(prompts) + max_new_tokens // 2)
    costs = measure_costs(llm, llm.draft_mode, max_gamma, context, reps)
    log(f"costs (ms): AR step {1e3 * costs.verify[0]:.2f}, verify of {max_gamma + 1} {1e3 * costs.verify[-1]:.2f}, "
        f"draft step {1e3 * costs.draft:.2f}, of which embedding/norm/head {1e3 * costs.fixed:.2f}")
    tf = TeacherForced(llm.model, prompts, conts, llm.verify_mode, llm.draft_mode)
    best, path = choose_skip(tf, costs, log=log)
    r = llm.recipe
    return {"model": model_name or DEFAULT_MODEL, "storage": r.storage, "draft": r.draft, "verify": r.verify,
            "device": llm.model.device.type, "n_layers": costs.n_layers, "skip_layers": best.skip_layers,
            "chosen": asdict(best), "path": [asdict(c) for c in path],
            "costs_ms": {"verify": [1e3 * t for t in costs.verify], "draft": 1e3 * costs.draft,
                         "fixed": 1e3 * costs.fixed, "context": context},
            "prompts": len(prompts), "continuation_tokens": sum(map(len, conts)),
            "seconds": time.perf_counter() - t0}


def save_calibration(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="named model, HF directory or .gguf file (default: smollm2-135m)")
    p.add_argument("--draft", default=None, metavar="MODE", help="the mode the draft skips layers of (default: upper)")
    p.add_argument("--verify", default=None, metavar="MODE", help="the verify mode (default: full)")
    p.add_argument("--group-size", type=int, default=128, help="quantization group size along K")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the costs are measured there")
    p.add_argument("--prompts", type=int, default=12, help="calibration prompts (GSM8K, HumanEval, MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="greedy continuation tokens per prompt")
    p.add_argument("--max-gamma", type=int, default=8, help="most drafts per round the speedup is computed for")


def run(args: argparse.Namespace, log=print) -> Path:
    """`selfspec calibrate-skip`: calibrate, write the JSON `--recipe layerskip` reads, return its path."""
    from selfspec.engine.llm import check_gamma, load

    for name, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--max-gamma", args.max_gamma)):
        if value < 1:
            raise SelfspecError(f"{name} must be >= 1, got {value}")
    check_gamma(args.max_gamma)
    llm = load(args.model, "planes", args.draft, args.verify, args.max_gamma,
               args.group_size, args.device)
    record = calibrate(llm, args.model, calibration_prompts(llm, args.prompts), args.max_new_tokens, args.max_gamma,
                       log=log)
    path = calibration_path(args.model, llm.recipe, args.group_size, args.device)
    save_calibration({**record, "group_size": args.group_size}, path)
    c = record["chosen"]
    log(f"skip layers {c['skip_layers']}: agreement {c['agreement']:.3f}, {c['mean_accepted']:.2f} accepted per "
        f"round at gamma {c['gamma']}, expected speedup {c['expected_speedup']:.2f}x over AR "
        f"({record['seconds']:.0f} s); wrote {path}")
    return path
