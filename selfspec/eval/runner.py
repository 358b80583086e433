"""`selfspec eval`: run each task under each mode (autoregressive) and each recipe (speculative), caching
every item's result as one JSON line in OUT/<config>/<task>.jsonl so an interrupted run resumes where it
stopped. A cached line is reused only if it was made with the same settings, by the same code (and did not fail).
Generation runs through the continuous-batching engine; each item is cached as soon as it finishes.
"""
from __future__ import annotations

import functools
import hashlib
import json
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

import selfspec
from selfspec.engine.engine import DEFAULT_PREFILL_CHUNK, Engine, RequestOutput, branch_blocks
from selfspec.engine.llm import LLM, Generation, check_gamma
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.eval.tasks import TASK_NAMES, Item, get_task
from selfspec.eval.tasks import ppl as ppl_task
from selfspec.parallel.launch import TensorParallelLLM
from selfspec.quant.modes import get_mode
from selfspec.speculative.recipes import Recipe, resolve_recipe
from selfspec.speculative.sampling import SamplingParams

DEFAULT_PPL_WINDOWS = 64
DEFAULT_BATCH_SIZE = 64
BLOCK_SIZE = 16  # tokens per KV block


@dataclass(frozen=True)
class EvalConfig:
    label: str
    recipe: str  # the recipe loaded: "ar" for a mode, else a preset (speculative, or its verify mode alone)
    verify: str
    draft: str | None  # None: autoregressive in the verify mode
    storage: str  # the stored weight format, as the recipe describes it
    reference: str | None = None  # speculative runs: the label of the AR run they must equal


def plan_configs(modes: list[str], recipes: list[str], draft_model: str | None = None) -> list[EvalConfig]:
    """Modes, then each recipe's verify mode run alone where no mode stores the same weights, then the recipes.

    A recipe's reference is an AR run of exactly its stored weights (format, rotation, ...): a mode's run
    when the recipe minus its draft equals that mode's recipe, else the recipe itself at gamma 0. Recipe
    draft-model drafts with `draft_model`."""
    configs = []
    for m in modes:
        get_mode(m)
        configs.append(EvalConfig(m, "ar", m, None, describe(resolve_recipe("ar", None, m))))
    references, spec = [], []
    for name in recipes:
        if name == "ar":
            raise SelfspecError("'ar' does not draft; put the mode it runs under --modes instead of --recipes")
        r = resolve_recipe(name, draft_model=draft_model if name == "draft-model" else None)
        alone = replace(r, name="ar", draft=None, layer_skip=False, draft_model=None)  # no draft: no layer to skip
        if alone == resolve_recipe("ar", None, r.verify):
            ref = EvalConfig(r.verify, "ar", r.verify, None, describe(r))
        else:
            ref = EvalConfig(f"{name}-ar", name, r.verify, None, describe(r))
        if ref not in configs + references:
            references.append(ref)
        draft = r.draft if r.draft_model is None else f"{r.draft_model}:{r.draft}"  # results depend on the model
        spec.append(EvalConfig(name, name, r.verify, draft, describe(r), ref.label))
    return configs + references + spec


def describe(recipe: Recipe) -> str:
    """The stored format in a few words (with the rotation or smoothing, where the recipe has one)."""
    smoothed = f"+smoothquant(alpha {recipe.smooth_alpha})" if recipe.smooth_alpha is not None else ""
    return recipe.storage + ("+hadamard" if getattr(recipe, "rotate", False) else "") + smoothed


def select(items: list[Item], limit: int | None, seed: int | None) -> list[Item]:
    """The first `limit` items, in dataset order or (with a seed) in a seeded shuffle of it."""
    if seed is not None:
        items = items[:]
        random.Random(seed).shuffle(items)
    return items[:limit] if limit else items


def encode(llm: LLM, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, str):
        return llm.encode(prompt)
    ids = llm.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return llm.encode(list(ids["input_ids"] if hasattr(ids, "keys") else ids))


def generate_batched(llm: LLM, prompts: dict[str, list[int]], params: SamplingParams, gamma: int,
                     batch_size: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> Iterator[RequestOutput]:
    """Each prompt's final output from the continuous-batching engine, as it finishes (any order), with at
    most batch_size in flight. Greedy batched output equals solo output, so the batch size changes no result."""
    if not prompts:
        return
    batch = min(batch_size, len(prompts))
    # Every row's worst case fits at once: the longest prompt + max_new_tokens + the drafts of a round (+ a tree's
    # branch rows).
    longest = min(llm.model.cfg.max_seq_len, max(map(len, prompts.values())) + params.max_new_tokens + gamma)
    per_row = -(-longest // BLOCK_SIZE) + branch_blocks(llm.drafter, BLOCK_SIZE, gamma)
    kwargs = dict(max_batch=batch, block_size=BLOCK_SIZE, num_blocks=batch * per_row, max_queue=batch,
                  prefill_chunk=prefill_chunk, max_gamma=gamma)  # the engine caps a request's gamma
    tp = isinstance(llm, TensorParallelLLM)  # every rank runs an engine over its shard, rank 0's steps
    engine = llm.serve_engine(**kwargs) if tp else Engine(llm, **kwargs)
    pending = deque(prompts.items())
    in_flight = 0
    try:
        while pending or engine.has_work():
            while pending and in_flight < batch:
                request_id, ids = pending.popleft()
                engine.add_request(request_id, ids, params, gamma=gamma)
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    in_flight -= 1
                    yield out
    finally:
        if tp:
            llm.end_engine()


class ResultCache:
    """OUT/<config>/<task>.jsonl: one line per item; the last line for an id with matching settings wins. With
    `any_code`, lines made by other code count too (reporting what is cached: the report compares a recipe with its
    verify mode only where both items came from the same code)."""

    def __init__(self, path: Path, settings: dict, any_code: bool = False):
        self.path, self.settings = path, settings
        self.records: dict[str, dict] = {}
        key = _without_code if any_code else dict
        wanted = key(settings)
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short when a run was killed: redo that item
                    continue
                if key(rec.get("settings") or {}) == wanted:
                    self.records[rec["id"]] = rec

    def add(self, record: dict) -> None:
        record = {"id": record["id"], "settings": self.settings, **record}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.records[record["id"]] = record

    def done(self, item_id: str) -> bool:
        """Cached without an error (a failed item is tried again)."""
        return item_id in self.records and not self.records[item_id].get("error")


def _without_code(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != "code"}


def check_args(tasks: list[str], limit: int | None, gamma: int, max_new_tokens: int, batch_size: int,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
    if not tasks:
        raise SelfspecError(f"no tasks given; choose from: {', '.join(TASK_NAMES)}")
    for t in tasks:
        get_task(t)
    if limit is not None and limit < 1:
        raise SelfspecError(f"--limit must be >= 1 items per task, got {limit}")
    if max_new_tokens < 1:
        raise SelfspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise SelfspecError(f"--batch-size must be >= 1 sequences generated together, got {batch_size}")
    if prefill_chunk < 1:
        raise SelfspecError(f"--prefill-chunk must be >= 1 prompt tokens per step, got {prefill_chunk}")
    check_gamma(gamma)


def run_eval(model: str | None, tasks: list[str], modes: list[str], recipes: list[str], out_dir: Path,
             limit: int | None = None, seed: int | None = None, gamma: int = 4, max_new_tokens: int = 256,
             chat: bool = False, data: dict[str, Path] | None = None, group_size: int = 128,
             device: str = "cpu", cached_only: bool = False,
             batch_size: int = DEFAULT_BATCH_SIZE, unsafe_sandbox: bool = False,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, draft_model: str | None = None,
             tensor_parallel: int = 1) -> dict[str, dict[str, list[dict]]]:
    """Evaluate and return {config label: {task: [record per item, in item order]}} (cached items reused,
    failed ones generated again; cached_only: generate nothing, report what the cache holds;
    unsafe_sandbox: run HumanEval's code unconfined where the sandbox cannot be built; tensor_parallel N > 1: each
    config's model split across N processes, results cached apart from other sizes' (equal within one size))."""
    check_args(tasks, limit, gamma, max_new_tokens, batch_size, prefill_chunk)
    if "humaneval" in tasks and not cached_only:
        get_task("humaneval").check_scorable(unsafe_sandbox)
    configs = plan_configs(modes, recipes, draft_model)
    if not configs:
        raise SelfspecError("nothing to evaluate: give --modes and/or --recipes")
    data = data or {}
    unknown = set(data) - set(tasks)
    if unknown:
        raise SelfspecError(f"--data names task(s) not being run: {', '.join(sorted(unknown))}")
    items = {t: select(get_task(t).load_items(data.get(t), chat), limit, seed) for t in tasks if t != "ppl"}
    n_windows = min(limit or DEFAULT_PPL_WINDOWS, DEFAULT_PPL_WINDOWS)
    ppl_ids = [f"ppl/{i}" for i in range(n_windows)]
    windows: list[Item] | None = None  # tokenized on first need (needs the model's tokenizer)
    results: dict[str, dict[str, list[dict]]] = {}
    for cfg in configs:
        speculative = cfg.draft is not None
        caches = {t: ResultCache(out_dir / cfg.label / f"{t}.jsonl",
                                 settings(model, cfg, t, max_new_tokens, chat, gamma if speculative else 0,
                                          group_size, device, tensor_parallel), any_code=cached_only)
                  for t in tasks}
        # A recipe's scores are its verify mode's logits: perplexity has nothing new to measure there.
        todo = {t: [i for i in (ppl_ids if t == "ppl" else [it.id for it in items[t]]) if not caches[t].done(i)]
                for t in tasks if not (t == "ppl" and speculative)}
        if any(todo.values()) and not cached_only:
            verify = cfg.verify if cfg.recipe == "ar" else None
            llm = selfspec.load(model, cfg.recipe, verify=verify, gamma=gamma, group_size=group_size, device=device,
                                draft_model=draft_model if cfg.recipe == "draft-model" else None,
                                tensor_parallel=tensor_parallel)
            try:
                for t in todo:
                    if t == "ppl":
                        windows = windows or ppl_task.load_windows(llm.tokenizer, data.get("ppl"), n_windows)
                        run_ppl(llm, [w for w in windows if w.id in todo[t]], caches[t], cfg.label)
                    else:
                        missing = set(todo[t])
                        run_generation(llm, get_task(t), [it for it in items[t] if it.id in missing], caches[t],
                                       max_new_tokens, gamma if speculative else 0, batch_size, cfg.label,
                                       unsafe_sandbox, prefill_chunk)
            finally:
                if isinstance(llm, TensorParallelLLM):  # its worker processes end with the config
                    llm.close()
        results[cfg.label] = {}
        for t in tasks:
            ids = ppl_ids if t == "ppl" else [it.id for it in items[t]]
            results[cfg.label][t] = [caches[t].records[i] for i in ids if i in caches[t].records]
    return results


ARITHMETIC_SOURCES = ("model.py", "kernels", "quant", "cache", "loading")  # what computes a model's outputs


@functools.cache
def code_version() -> str:
    """A hash of the sources that compute a model's outputs. An item cached by other code is generated again: a
    kernel whose bits changed would otherwise leave a recipe compared with its verify mode's output from before
    (seen: two GSM8K items of `planes` against `full` items cached four days and many kernels earlier)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in ARITHMETIC_SOURCES:
        for path in sorted([root / name] if name.endswith(".py") else (root / name).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def settings(model: str | None, cfg: EvalConfig, task: str, max_new_tokens: int, chat: bool, gamma: int,
             group_size: int, device: str, tensor_parallel: int = 1) -> dict:
    """What a cached result depends on besides the item: the code too (the tensor-parallel size where above 1)."""
    s = {"model": model or "default", **asdict(cfg), "group_size": group_size, "device": device,
         "code": code_version()}
    if tensor_parallel > 1:
        s["tensor_parallel"] = tensor_parallel
    s.pop("reference")
    if task == "ppl":
        return {**s, "window": ppl_task.WINDOW}
    return {**s, "max_new_tokens": max_new_tokens, "chat": chat, "gamma": gamma}


def run_generation(llm: LLM, task, items: list[Item], cache: ResultCache, max_new_tokens: int, gamma: int,
                   batch_size: int, label: str, unsafe_sandbox: bool = False,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
    """Generate the items in batches, caching each one's record as it finishes; a failing item is cached
    with its error and the others go on."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=list(task.STOP))
    by_id = {it.id: it for it in items}
    bar = tqdm(total=len(items), desc=f"{label} {task.NAME}")
    prompts = {}
    for it in items:
        try:
            prompts[it.id] = encode(llm, it.prompt)
        except SelfspecError as e:  # e.g. longer than the context window
            cache.add(record(task, it, Generation("", [], "error", GenerationStats()), str(e), unsafe_sandbox))
            bar.update()
    for out in generate_batched(llm, prompts, params, gamma, batch_size, prefill_chunk):
        cache.add(record(task, by_id[out.request_id], out.generation, out.error, unsafe_sandbox))
        bar.update()
    bar.close()


def record(task, item: Item, gen: Generation, error: str | None, unsafe_sandbox: bool = False) -> dict:
    """An item's cached line: text, answer, correct, engine stats (a failed item scores nothing)."""
    sandboxed = {"unsafe_sandbox": unsafe_sandbox} if task.NAME == "humaneval" else {}  # runs generated code
    answer, correct = (None, False) if error else task.score(item, gen.text, **sandboxed)
    return {"id": item.id, "text": gen.text, "answer": answer, "correct": bool(correct),
            "reference": item.reference if task.NAME != "humaneval" else None,
            "finish_reason": gen.finish_reason, "error": error, "stats": gen.stats.to_dict()}


def run_ppl(llm: LLM, windows: list[Item], cache: ResultCache, label: str) -> None:
    for w in tqdm(windows, desc=f"{label} ppl"):
        t0 = time.perf_counter()
        if isinstance(llm, TensorParallelLLM):
            nll, n = llm.window_nll(w.prompt)
        else:
            nll, n = ppl_task.window_nll(llm.model, w.prompt, llm.verify_mode)
        cache.add({"id": w.id, "nll": nll, "tokens": n, "seconds": time.perf_counter() - t0})
