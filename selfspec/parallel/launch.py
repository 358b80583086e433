"""The processes of a tensor-parallel LLM, and a helper that runs a function on N ranks.

`selfspec.load(..., tensor_parallel=N)` makes the calling process rank 0: it resolves the model, checks that N
splits it (before any process starts), spawns ranks 1..N-1, joins the group with them, and each rank builds its own
shard (each worker reads the model files itself: nothing large crosses processes).

The step plan: every rank runs the same decoding loop (speculative/decode.py) on the same inputs. Rank 0 owns the
request: it tokenizes and checks the prompt, draws a sampling seed where none was given, and broadcasts (token ids,
sampling params, gamma) once per request; then every rank runs `LLM.generate` on them. Each choice the loop makes
(argmax, acceptance, how many tokens to draft, where to stop) is a function of the gathered logits, the same bits on
every rank (comm.py), so the ranks take the same path with no sync beyond each pass's own collectives, speculative
rounds of any chain drafter (self-draft, lookup) and trees included. The one choice made from something else, the
measured-cost gamma policy (it reads each rank's own clock), is off: a tensor-parallel LLM drafts gamma tokens every
round. Refused: a separate draft model (not split) and SmoothQuant calibration (its folding reads whole heads).
The serving engine (`serve_engine`, until `end_engine`): every rank runs an Engine over its shard, rank 0
broadcasting each step's inbox of requests (engine/engine.py). `selfspec eval`'s perplexity (`window_nll`) runs on
every rank the same way.
"""
from __future__ import annotations

import atexit
import io
import random
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.multiprocessing as mp

from selfspec.config import ModelConfig
from selfspec.engine.engine import Engine
from selfspec.engine.llm import LLM, check_gamma, load_rank
from selfspec.errors import SelfspecError
from selfspec.parallel.comm import TIMEOUT, TensorParallel, free_port, init_rank, leave, rank_device
from selfspec.parallel.shard import check_tensor_parallel
from selfspec.speculative.recipes import Recipe
from selfspec.speculative.sampling import SEED_RANGE, SamplingParams


def check_recipe(rec: Recipe) -> None:
    if rec.draft_model is not None:
        raise SelfspecError("recipe draft-model: the draft model is not split across ranks; drop --tensor-parallel, "
                            "or draft with the model itself (--recipe planes) or by lookup (--recipe ngram)")
    if rec.smooth_alpha is not None:
        raise SelfspecError(f"recipe {rec.name}: SmoothQuant calibration is not supported under tensor parallelism; "
                            "drop --tensor-parallel or pick another recipe")


class TensorParallelLLM:
    """Rank 0's LLM of a tensor-parallel group: the LLM API (anything not here is rank 0's LLM's), each request
    broadcast to the other ranks, which run it alongside. `rank_weight_bytes`: each rank's weight bytes."""

    def __init__(self, llm: LLM, workers: list, rank_weight_bytes: list[int]):
        self.llm = llm
        self.workers = workers
        self.rank_weight_bytes = rank_weight_bytes
        self.engine = None
        atexit.register(self.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["llm"], name)

    @property
    def tensor_parallel(self) -> int:
        return self.llm.model.tp.size

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False,
               gamma: int | None = None) -> Iterator[tuple[str, list[int], Any]]:
        """LLM.stream on every rank. Checked here first (a refused request reaches no other rank); a stream closed
        early still runs to its end here, since the other ranks run it to the end and each pass needs all ranks."""
        if not self.workers:
            raise SelfspecError("this tensor-parallel LLM is closed; load the model again")
        if self.engine is not None:
            raise SelfspecError("this tensor-parallel LLM serves an engine: send requests through the engine")
        self.check_workers()
        llm = self.llm
        params = params or SamplingParams()
        if not params.greedy and params.seed is None:  # every rank must draw the same samples
            params = replace(params, seed=random.randint(*SEED_RANGE))
        check_gamma(llm.gamma if gamma is None else gamma)
        ids = llm.encode(prompt, chat)
        llm.check_context(len(ids), params.max_new_tokens)
        llm.model.tp.broadcast(("generate", ids, params, gamma))
        steps = llm.stream(ids, params, False, gamma)
        try:
            # Not `yield from`: closing this generator would then close `steps` before the drain below.
            for step in steps:  # noqa: UP028
                yield step
        finally:
            for _ in steps:
                pass

    generate = LLM.generate

    def serve_engine(self, **kwargs: Any) -> Engine:
        """A serving engine over every rank (Engine's keyword arguments, plain values): this rank's schedules and
        takes the requests; the other ranks' follow its steps until close(). generate() is refused from then on."""
        if self.engine is not None:
            raise SelfspecError("this tensor-parallel LLM already serves an engine")
        self.check_workers()
        self.llm.model.tp.broadcast(("engine", kwargs))
        self.engine = Engine(self, **kwargs)
        return self.engine

    def end_engine(self) -> None:
        """Close the engine serve_engine started (the other ranks' follow): another may start, or generate()."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def window_nll(self, tokens: list[int]) -> tuple[float, int]:
        """eval's perplexity of one window (eval/tasks/ppl.py `window_nll`) in the verify mode, on every rank."""
        from selfspec.eval.tasks.ppl import window_nll

        if self.engine is not None:
            raise SelfspecError("this tensor-parallel LLM serves an engine: end it before scoring text")
        self.check_workers()
        self.llm.model.tp.broadcast(("nll", tokens))
        return window_nll(self.llm.model, tokens, self.llm.verify_mode)

    def check_workers(self) -> None:
        dead = [w.exitcode for w in self.workers if not w.is_alive()]
        if dead:
            raise SelfspecError(f"a tensor-parallel worker process ended (exit code {dead[0]}); see its output above, "
                                "then close() this LLM and load the model again")

    def close(self) -> None:
        """End the other ranks (their engine first) and leave the group (also at exit)."""
        if not self.workers:
            return
        try:
            if self.engine is not None:
                self.engine.close()
            self.llm.model.tp.broadcast(None)
        except RuntimeError:  # a rank is gone (the collective says so at once): end the others below
            pass
        self.llm.close()  # its graphs before the group (comm.leave)
        for w in self.workers:
            w.join(timeout=30)
            if w.is_alive():
                w.terminate()
        self.workers = []
        leave()


def start(size: int, args: dict) -> TensorParallelLLM:
    """`load(**args, tensor_parallel=size)`: this process becomes rank 0 of `size` (module docstring)."""
    port = free_port()
    workers = []

    def join(cfg: ModelConfig, rec: Recipe) -> TensorParallel:
        check_tensor_parallel(cfg, size, args["group_size"])
        check_recipe(rec)
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            workers.append(ctx.Process(target=serve_rank, args=(rank, size, port, args), daemon=True))
            workers[-1].start()
        return init_rank(0, size, port, args["device"])

    try:
        llm = load_rank(**rank_args(args, 0), join=join)
        reports = llm.model.tp.all_gather_object(llm.model.weight_bytes())
    except BaseException:
        for w in workers:
            w.terminate()
        leave()
        raise
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        TensorParallelLLM(llm, workers, []).close()
        raise SelfspecError(f"a tensor-parallel rank failed to load: {failed[0]}")
    return TensorParallelLLM(llm, workers, reports)


def rank_args(args: dict, rank: int) -> dict:
    """`load` arguments of one rank: its own device, and gamma fixed (module docstring)."""
    return {**args, "device": rank_device(args["device"], rank), "fixed_gamma": True}


def serve_rank(rank: int, size: int, port: int, args: dict) -> None:
    """A worker rank: build its shard, report its weight bytes (or why it failed), then run each request rank 0
    broadcasts until it broadcasts None."""
    tp = None

    def join(cfg: ModelConfig, rec: Recipe) -> TensorParallel:
        nonlocal tp
        tp = init_rank(rank, size, port, args["device"])
        return tp

    try:
        llm = load_rank(**rank_args(args, rank), join=join)
        report = llm.model.weight_bytes()
    except Exception:
        if tp is None:
            raise
        tp.all_gather_object(traceback.format_exc(limit=4))
        leave()
        return
    tp.all_gather_object(report)
    while (request := tp.broadcast()) is not None:
        if request[0] == "generate":
            _, ids, params, gamma = request
            llm.generate(ids, params, gamma=gamma)
        elif request[0] == "nll":
            from selfspec.eval.tasks.ppl import window_nll

            window_nll(llm.model, request[1], llm.verify_mode)
        else:  # ("engine", kwargs): follow rank 0's engine steps until it closes the engine
            engine = Engine(llm, **request[1])
            while not engine.stopped:
                engine.step()
            engine.close()
    llm.close()  # its graphs before the group (comm.leave)
    leave()


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, device: str = "cpu") -> list[Any]:
    """fn(tp, *args) on `size` spawned processes joined in a group (rank r on rank_device(device, r)); their
    results in rank order. A rank's exception is raised here (with its traceback) and the other ranks ended. fn and
    its arguments must be picklable (fn importable by name)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_one_rank, args=(fn, rank, size, port, device, results, args), daemon=True)
             for rank in range(size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < size:
            rank, ok, payload = results.get(timeout=TIMEOUT.total_seconds())
            if not ok:
                raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(size)]


def on_ranks(fn: Callable[..., Any], size: int, *args: Any, device: str = "cuda") -> Any:
    """fn(*args) in this process alone (size 1), else fn(*args, tp=tp) on `size` spawned ranks (run_ranks): rank
    0's result. fn must be importable by name (a benchmark's `measure`)."""
    if size == 1:
        return fn(*args)
    return run_ranks(_with_tp, size, fn, *args, device=device)[0]


def _with_tp(tp: TensorParallel, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args, tp=tp)


def run_one_rank(fn: Callable[..., Any], rank: int, size: int, port: int, device: str, results, args: tuple) -> None:
    try:
        tp = init_rank(rank, size, port, device)
        buf = io.BytesIO()
        torch.save(fn(tp, *args), buf)  # bytes through the queue: no shared memory outliving this process
        results.put((rank, True, buf.getvalue()))
    except Exception:  # noqa: BLE001 (any failure goes back to the caller, with its traceback)
        results.put((rank, False, traceback.format_exc()))
    finally:
        leave()
