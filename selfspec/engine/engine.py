"""Serving engine: continuous batching over a paged KV cache, with batched speculative rounds.

One `step()`: drain the inbox (new requests, aborts), plan the step (`_schedule`), then run it (`_execute`): one
prefill chunk (a budget of prefill_chunk context tokens shared FCFS by the sequences still prefilling, packed into
one forward without padding, so every GEMM runs on real tokens only), then one batched round over every sequence
past prefill: k draft steps and one verify pass, each row accepting its own number of tokens and rolling its own
cache back. A round that drafts nothing may run up to decode_steps plain steps back to back, the host waiting once
for all their tokens (`_burst`, speculative/decode.py `run_steps`). k comes from the gamma policy
(speculative/policy.py) unless a request asks for its own, which is capped at the engine's max_gamma (the server's
--gamma); rows are grouped by k and each group runs its own batched passes. In a round the policy drafts only to
measure (GammaPolicy.measuring), its greedy rows emit one token each, so that they stay in lockstep (`_round`). With
a tree drafter, a round with drafts verifies every branch of the group in one pass (speculative/decode.py
`tree_rounds`): a drafter that forks no rows (lookups, recycled rankings), in a round of up to SHARED_TREE_BATCH
sequences, stores each sequence's nodes once past its length in its own blocks (cache/paged.py `SharedTree`); else
each sequence is forked into a row per branch over its blocks (`PagedTree`), whose blocks are budgeted with the
round's and freed after it.

KV blocks follow current need, as in vLLM's scheduler: each step gives every running sequence, oldest first, the
blocks its passes will write (its prefill chunk; k + 1 positions of its round). When the pool runs short, the
newest running sequence is preempted: its blocks go back to the pool and it waits at the head of the queue, to
be prefilled again (prompt + the tokens it generated, the pending one aside) once blocks free up; its output is
unchanged. Newcomers are admitted FCFS after that, and only while one block per running sequence stays free for
the next round's growth. Blocks are freed on rollback as well. A request is refused only if its worst case
(prompt + max_new_tokens + drafts) exceeds the whole pool, so the oldest sequence always makes progress.
Threads: add_request/abort only touch a locked inbox; step() (one thread) drains it.
On CUDA the rounds' passes (AR and draft steps, verify passes) replay CUDA graphs, batches padded to power-of-two
buckets, and so do prompt passes, tokens and rows padded to theirs (engine/graphs.py `PagedGraphedModel`); a resumed
sequence's generated tokens are prefilled eagerly.
A recipe with a quantized KV cache (int8, hier) keeps the quantized groups in the pool's blocks and each running
sequence's recent tokens in a full-precision buffer of its own (cache/paged_quant.py); its decode passes replay
graphs too (its prompt passes run eagerly), and a pass writes at most a KV group of tokens per sequence (prefill
chunks are cut to it, and gamma stays below it).
Under tensor parallelism (docs/parallel.md) every rank holds an Engine over its shard; rank 0 takes the requests and
each step broadcasts its inbox (and the policy's gamma and whether it only measures: rank 0's clock), so every rank
plans and runs the same step: the rest of the scheduling is a function of that and of the gathered logits, the same
on every rank.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from selfspec.bench.device import time_ms
from selfspec.cache.paged import PagedKVCache, PagedTree, SharedTree, tree_view
from selfspec.cache.paged_quant import PagedQuantKVCache
from selfspec.engine.graphs import MAX_GRAPHED_TOKENS, PagedGraphedModel, bucket, node_bucket, trash_view
from selfspec.engine.llm import LLM, Generation, check_gamma
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.host import long_tensor, packed_positions
from selfspec.model import Packed, Runner, TreeLayout
from selfspec.quant.modes import prompt_mode
from selfspec.speculative.decode import (GreedyAcceptance, Row, RoundResult, make_generator, pick, run_round,
                                         run_steps, tree_rounds)
from selfspec.speculative.draft_model import DraftModel
from selfspec.speculative.drafters import SHARED_TREE_BATCH, TokenHistory, TreeDrafter, gamma_policy
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.sampling import SEED_RANGE, SamplingParams
from selfspec.speculative.verify import accept_greedy

DEFAULT_TOKENS_PER_SEQ = 1024  # default pool: max_batch sequences of this many tokens
# Context tokens prefilled per step (serve, bench serve and eval: --prefill-chunk). Every prompt pass dequantizes
# each integer weight once (Mode.prompt), which small chunks pay again and again. H100, 8B shape, `full`, 64 requests
# of 512-token prompts at batch 32, one lease, decode steps 4 (docs/gpu.md): 4096 gave 2,514 tok/s, TTFT p99
# 0.57 s and ITL p99 55 ms against 2,417, 0.65 s and 79 ms for 2048 (half as many prompt passes stall decoding).
DEFAULT_PREFILL_CHUNK = 4096
# Decode steps a newcomer's prompt may wait, while other sequences decode, for more prompts to share its prefill
# pass. A prompt pass costs far more than its tokens' share when it carries few: on the H100 (8B shape, `full`, CUDA
# graphs) one 512-token prompt takes 26 ms alone, two 38 ms and four 65 ms in one pass (every integer weight is
# dequantized once per pass); eager, before the graphs, 70 and 74 ms (docs/gpu.md, "Serving"). W8A8's share little
# (11, 20 and 38 ms: no dequantization; docs/speculative.md, session 18).
DEFAULT_PREFILL_WAIT = 8
# Plain decoding steps a round may run back to back (`_burst`, speculative/decode.py `run_steps`): the host queues
# them all and waits once, where one step at a time it waited (and scheduled, and emitted) every step.
DEFAULT_DECODE_STEPS = 4
# The memory, in decode steps, of the rate at which rows finish (`finish_rate`): company for a held prompt.
FINISH_RATE_STEPS = 32


def finish_rate(rate: float, finished: int, steps: int) -> float:
    """The rows finishing per decode step, an exponential moving average over about FINISH_RATE_STEPS steps, after
    a step of `steps` decode steps in which `finished` rows finished."""
    keep = (1 - 1 / FINISH_RATE_STEPS) ** steps
    return keep * rate + (1 - keep) * finished / steps


# From this many policy rows, rounds leave rows in step alone where more than this share of them are (`in_step`).
IN_STEP_ROWS = 8
IN_STEP_SHARE = 0.75


def in_step(dues: list[int]) -> bool:
    """Whether a round drafts nothing to keep the policy's rows in step, `dues` the tokens each may still make: at
    IN_STEP_ROWS rows or more, more than IN_STEP_SHARE of them each due as many as another row (requests started
    together, which finish and are replaced together, their successors sharing one prompt pass). One drafting round
    moves them apart for the rest of their run and their successors then come one or two a prompt pass (`full`: one
    512-token prompt 24.6 ms a pass against 14.5 ms a prompt among eight), which at batch 8-32 cost more than the
    drafts saved: with one output length ngram ran 0.95x AR at batch 8 and quasar 0.97-0.99x at 32 on the GPU
    (docs/speculative.md, sessions 19-21); the batch replay, 0.95x and 0.98x at batch 8, 0.99-1.01x at 32, gives
    1.00x with this rule, and outputs of their own lengths (rows due counts of their own) draft as before. Below 8
    rows trees in step pay (recycle 1.02-1.10x at batch 2-4)."""
    paired = sum(n for n in Counter(dues).values() if n > 1)
    return len(dues) >= IN_STEP_ROWS and paired > IN_STEP_SHARE * len(dues)


def prefill_warm_sizes(max_tokens: int) -> list[int]:
    """Token counts of the prefill passes warm_up runs: one in each tile bucket of the GEMMs (kernels/linear_tiles.py
    MANY_TOKENS: up to 16, 64, 256 rows, then tile shapes chosen per size) up to max_tokens, and max_tokens."""
    return sorted({min(t, max_tokens) for t in (1, 17, 65, 257, 512, 1024, 2048, max_tokens)})


def check_quant_kv(llm: LLM, max_gamma: int) -> None:
    """A quantized KV cache takes passes of at most a group of tokens (the buffer's room past the committed length),
    and a draft model keeps its own cache laid out like a bf16 pool."""
    group = llm.recipe.kv_group
    if llm.drafter is not None and max_gamma + 1 > group:
        raise SelfspecError(f"a verify pass of {max_gamma} drafts writes {max_gamma + 1} tokens, more than the KV "
                            f"group of {group} a quantized KV cache takes in one pass: serve with --gamma "
                            f"{group - 1} or less, or a larger --kv-group")
    if isinstance(llm.drafter, DraftModel):
        raise SelfspecError("a draft model mirrors the blocks of a bf16 KV cache; the serving engine runs recipe "
                            "draft-model with --kv bf16 only")


def branch_blocks(drafter, block_size: int, k: int | None, length: int | None = None) -> int:
    """KV blocks a tree drafter's round of k drafts at `length` takes beyond the k + 1 positions of a chain's
    (length None: the worst case): as forked rows, the blocks of positions length..length+k for each branch but
    the first (PagedTree); a drafter that forks no rows may instead store its nodes past position length+k in the
    sequence's own blocks (SharedTree, in a round of up to SHARED_TREE_BATCH sequences), so the more of the two. 0
    for other drafters: what a pool sized per request adds for trees."""
    if not isinstance(drafter, TreeDrafter) or not k:
        return 0
    offset = block_size - 1 if length is None else length % block_size
    chain = -(-(offset + k + 1) // block_size)
    forked = (drafter.branches - 1) * chain
    return forked if drafter.forks else max(forked, -(-(offset + drafter.max_nodes(k) + 1) // block_size) - chain)


def _even_branches(drafts: int, branches: int, k: int) -> list[list[int]]:
    """`drafts` distinct tokens as up to `branches` branches of at most k tokens, as even as they go: a tree of that
    many nodes, for timing its pass."""
    n = min(branches, drafts)
    sizes = [drafts // n + (i < drafts % n) for i in range(n)] if n else []
    if any(size > k for size in sizes):
        raise SelfspecError(f"{drafts} drafts do not fit {branches} branches of {k} tokens")
    tokens = iter(range(1, drafts + 1))
    return [[next(tokens) for _ in range(size)] for size in sizes]


class QueueFull(SelfspecError):
    """The waiting queue is at max_queue; retry later."""


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str  # detokenized delta, stop strings applied
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    generation: Generation  # running text, token ids, stats
    error: str | None = None


@dataclass
class EngineStats:
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_row_rounds: int  # rows x rounds (plain decoding steps included): mean gamma = num_draft_tokens / this
    num_drafts: int  # rows that drafted, summed over rounds
    num_draft_tokens: int  # proposed (a lookup may propose fewer than the round's k, or none)
    num_accepted_tokens: int  # by verify: a measuring round's included, though its lockstep rows emit none of them
    num_lockstep_rows: int  # greedy rows of measuring rounds, summed over rounds: one token emitted, drafts measured
    num_preemptions: int  # sequences sent back to the queue to free KV blocks (recomputed on resume)
    gamma: int  # last chosen by the policy
    acceptance: float | None  # the policy's per-token acceptance estimate


@dataclass(eq=False)  # a request is itself: membership tests (`in running`) compare identities, not fields
class Sequence:
    id: str
    prompt: list[int]
    params: SamplingParams
    gamma: int | None  # None: the policy's
    gen: torch.Generator | None
    arrival: float
    out: Generation
    queued_step: int = 0  # the decode step (Engine.steps) at which it last joined the waiting queue
    prefilled: int = 0  # positions of the context in the cache
    row: Row | None = None  # set once the context is prefilled (and, the first time, the first token drawn)
    history: TokenHistory | None = None  # while preempted, its row's lookup index (and the hybrid's streak)

    @property
    def context(self) -> list[int]:
        """What the cache holds before decoding: the prompt, and on resume after a preemption every generated
        token but the last one (the row's pending token, which the next round writes)."""
        return self.prompt + self.out.token_ids[:-1]

    @property
    def context_len(self) -> int:
        return len(self.prompt) + max(0, len(self.out.token_ids) - 1)

    @property
    def in_prompt(self) -> bool:
        """Whether the next context token to prefill is a prompt token (Mode.prompt's arithmetic) rather than a
        generated one recomputed after a preemption (the arithmetic it was generated with)."""
        return self.prefilled < len(self.prompt)

    @property
    def tokens_due(self) -> int:
        """Tokens it may still make (fewer at an EOS or a stop): a newcomer's prefill makes its first; a resumed
        sequence's pending token was drawn before."""
        return self.params.max_new_tokens - len(self.out.token_ids) - (self.row is None and not self.out.token_ids)

    @property
    def region_left(self) -> int:
        """Context tokens to prefill before the kind of token changes: a chunk never mixes prompt and generated."""
        return (len(self.prompt) if self.in_prompt else self.context_len) - self.prefilled


@dataclass
class StepPlan:
    """One step's passes: a batched prefill chunk (`chunks`: each sequence's context tokens in it, within the
    prefill budget), then one batched round per draft count k. `measuring`: the policy's drafts only measure
    (GammaPolicy.measuring), so the rounds keep its greedy rows in lockstep. `steps`: the plain decoding steps the
    k = 0 round runs back to back (Engine._burst), their blocks reserved with the rest. `held`: the waiting prompts
    wait this step for more to share their prefill pass (Engine._hold_prefill)."""
    prefill: list[Sequence]
    chunks: dict[str, int]
    rounds: dict[int, list[Sequence]]
    measuring: bool = False
    steps: int = 1
    held: bool = False

    @property
    def prefill_tokens(self) -> int:
        return sum(self.chunks.values())


@dataclass
class _Counters:
    num_row_rounds: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_lockstep_rows: int = 0
    num_preemptions: int = 0


class Engine:
    def __init__(self, llm: LLM, max_batch: int = 32, block_size: int = 16, num_blocks: int | None = None,
                 max_queue: int = 256, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 prefill_wait: int = DEFAULT_PREFILL_WAIT, max_gamma: int = 8,
                 policy: GammaPolicy | None = None, accept: GreedyAcceptance = accept_greedy,
                 decode_steps: int = DEFAULT_DECODE_STEPS):
        """`accept` judges greedy rows' drafts (benchmarks replay recorded acceptance through it)."""
        for name, value in (("max_batch", max_batch), ("block_size", block_size), ("max_queue", max_queue),
                            ("prefill_chunk", prefill_chunk), ("decode_steps", decode_steps)):
            if value < 1:
                raise SelfspecError(f"{name} must be >= 1, got {value}")
        if prefill_wait < 0:
            raise SelfspecError(f"prefill_wait must be >= 0 decode steps, got {prefill_wait}")
        check_gamma(max_gamma)
        tree = llm.drafter if isinstance(llm.drafter, TreeDrafter) else None
        if tree is not None and llm.recipe.kv != "bf16":
            raise SelfspecError(f"token trees fork a sequence's blocks of the bf16 KV cache; recipe "
                                f"'{llm.recipe.name}' (KV cache {llm.recipe.kv}) drafts in chains: serve it with a "
                                "chain drafter (--draft upper) or drop the quantized KV cache")
        cfg = llm.model.cfg
        quant_kv = llm.recipe.kv != "bf16"
        if quant_kv:
            check_quant_kv(llm, max_gamma)
            block_size = -(-block_size // llm.recipe.kv_group) * llm.recipe.kv_group  # whole groups a block
        self.llm = llm
        self.tree = tree
        self.tp = llm.model.tp
        self.stopped = False  # a tensor-parallel follower rank whose rank 0 closed its engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.prefill_wait = prefill_wait
        self.decode_steps = decode_steps
        self.max_len = cfg.max_seq_len
        if num_blocks is None:
            num_blocks = max_batch * -(-min(cfg.max_seq_len, DEFAULT_TOKENS_PER_SEQ) // block_size)
        # Under tensor parallelism this rank's KV heads only.
        shape = (cfg.n_layers, num_blocks, cfg.n_kv_heads // self.tp.size, block_size, cfg.head_dim, llm.model.dtype,
                 llm.model.device)
        self.cache = (PagedQuantKVCache(*shape, llm.recipe.kv, llm.recipe.kv_group, max_batch) if quant_kv
                      else PagedKVCache(*shape))
        if isinstance(llm.drafter, DraftModel):  # its pool mirrors this one's blocks: allocated up front too
            llm.drafter.store_for(self.cache)
        self.policy = policy or gamma_policy(llm.drafter, max_gamma)
        self.accept = accept
        # Under tensor parallelism no graphs (engine/graphs.py), so no warm-up pass only rank 0 would run.
        on_gpu = llm.model.device.type == "cuda" and self.tp.size == 1
        self.runner: Runner = PagedGraphedModel(llm.model, self.cache, self.max_len) if on_gpu else llm.model
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission (FCFS: arrival) order; the newest is preempted first
        self.counters = _Counters()
        self.steps = 0  # decode steps run: a burst counts each of its steps (the prefill wait counts these)
        self.finish_rate = 0.0  # rows finishing a decode step (`finish_rate`), any way (EOS, length, abort, error)
        self._finished = 0  # rows finished this step
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, object]] = []
        self._live: set[str] = set()  # ids added and not yet finished
        self._queued = 0  # requests in the inbox or waiting

    # ---------------------------------------------------------------- thread-safe entry points

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, chat: bool = False,
                    gamma: int | None = None) -> None:
        """Queue a request. `gamma` (drafted tokens per round; None: the policy's) is capped at the engine's
        max_gamma."""
        if not isinstance(request_id, str) or not request_id:
            raise SelfspecError("request_id must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise SelfspecError(f"params must be a SamplingParams, got {type(params).__name__}")
        if gamma is not None:
            check_gamma(gamma)
            gamma = min(gamma, self.policy.max_gamma)  # graphs and the policy's timings stop at max_gamma
        ids = self.llm.encode(prompt, chat)
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.max_len - len(ids)))
        if self.tp.size > 1 and not params.greedy and params.seed is None:  # every rank draws the same samples
            params = replace(params, seed=random.randint(*SEED_RANGE))
        drafts = 0 if self.llm.drafter is None else self.policy.max_gamma if gamma is None else gamma
        branches = branch_blocks(self.tree, self.cache.block_size, drafts)  # a tree's worst case, during a round
        blocks = self.cache.blocks_for(min(self.max_len, len(ids) + params.max_new_tokens + drafts)) + branches
        if blocks > self.cache.num_blocks:  # it could not finish even alone
            tree = f" + {branches} for the tree's branch rows" if branches else ""
            raise SelfspecError(f"the request needs up to {blocks} KV blocks (prompt {len(ids)} + max_new_tokens "
                                f"{params.max_new_tokens} + {drafts} drafts{tree}); the pool has "
                                f"{self.cache.num_blocks}")
        seq = self._sequence(request_id, ids, params, gamma)
        with self._lock:
            if request_id in self._live:
                raise SelfspecError(f"request id '{request_id}' is already in use")
            if self._queued >= self.max_queue:
                raise QueueFull(f"the waiting queue is full ({self.max_queue} requests); retry later")
            self._live.add(request_id)
            self._queued += 1
            self._inbox.append(("add", seq))

    def _sequence(self, request_id: str, ids: list[int], params: SamplingParams, gamma: int | None) -> Sequence:
        return Sequence(request_id, ids, params, gamma, make_generator(params, self.llm.model.device),
                        time.perf_counter(), Generation("", [], "length", GenerationStats(prompt_tokens=len(ids))))

    def abort(self, request_id: str) -> None:
        """Finish the request with reason "abort" and free its blocks at the next step; unknown ids are fine."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self.waiting or self.running)

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(self._queued, len(self.running), self.cache.num_blocks, self.cache.blocks_used,
                           c.num_row_rounds, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                           c.num_lockstep_rows, c.num_preemptions, self.policy.last_gamma, self.policy.acceptance)

    def warm_up(self) -> None:
        """Capture the CUDA graph of every decode pass the engine can replay (each batch bucket up to max_batch, times
        the branches of a tree: AR and verify passes of up to max_gamma drafts, draft steps), and compile the
        prefill kernels of every size bucket a prefill chunk can fall in (`prefill_warm_sizes`; their one-prompt
        graphs are captured too), so that no request waits on a compile, nor on a decode capture. The passes run on
        padding rows (trash blocks only). Nothing to do on CPU."""
        if not isinstance(self.runner, PagedGraphedModel):
            return
        dev = self.llm.model.device
        passes = [(self.llm.verify_mode, t) for t in range(1, min(self.policy.max_gamma + 1, MAX_GRAPHED_TOKENS) + 1)]
        draft = self.llm.draft_mode or getattr(self.tree, "mode", None)  # a self-draft tree's steps too
        if draft is not None:
            passes.append((draft, 1))
        most = self.max_batch * (1 if self.tree is None else self.tree.branches)  # a tree verifies a row per branch
        rows, verify_s, draft_s = 1, {}, {}
        while rows <= bucket(most):
            trash = trash_view(self.cache, rows, 1)
            for mode, t in passes:
                zeros = torch.zeros(rows, t, dtype=torch.long, device=dev)
                self.runner(zeros, zeros, trash, mode)  # captured
                seconds = time_ms(lambda: self.runner(zeros, zeros, trash, mode), warmup=0, reps=1) / 1e3
                if mode == self.llm.verify_mode:
                    verify_s[rows * t] = seconds
                else:
                    draft_s[rows] = seconds
            rows *= 2
        if self.tree is not None and not self.tree.forks:
            verify_s |= self._warm_up_shared_trees()  # a tree round priced by its own pass, not a chain's
        self.seed_policy(verify_s, draft_s)
        with torch.inference_mode():
            for t in prefill_warm_sizes(min(self.prefill_chunk, self.max_len, self.cache.max_pass)):
                trash = trash_view(self.cache, 1, max(1, self.cache.blocks_for(t)))
                pos = torch.arange(t, device=dev)[None]
                self.runner(torch.zeros_like(pos), pos, trash, prompt_mode(self.llm.verify_mode),
                            logits_at=torch.tensor([t - 1], device=dev), packed=Packed.of([t], [t], dev))

    def seed_policy(self, verify_s: dict[int, float], draft_s: dict[int, float]) -> None:
        """Hand the gamma policy the warm-up's timings (padding rows over a short context, so a little optimistic):
        verify passes by tokens, draft steps by rows. Where drafting would lose even if every draft were accepted
        (a tree's rows per branch at large batches), it then explores no sooner than a probe's cost allows."""
        for tokens, seconds in sorted(verify_s.items()):
            self.policy.observe_round(tokens, 0, 0.0, seconds)
        for rows, seconds in sorted(draft_s.items()):
            self.policy.observe_draft_step(rows, seconds)

    def _warm_up_shared_trees(self) -> dict[int, float]:
        """Capture the node-packed tree passes of rounds whose sequences read their own rows (`_shares_rows`, up to
        SHARED_TREE_BATCH sequences): each rows bucket up to their branches, each nodes bucket (from 16, at least
        the rows) up to their most nodes at max_gamma, at the one width `_tree_width`, on padding rows. Returns
        their times (`_time_shared_trees`)."""
        dev = self.llm.model.device
        gamma = self._tree_width() - 1
        most = min(self.max_batch, SHARED_TREE_BATCH)
        most_nodes = node_bucket(most * (self.tree.max_nodes(gamma) + 1))
        rows = 1
        while rows <= bucket(most * self.tree.branches):
            nodes = node_bucket(rows)
            while nodes <= most_nodes:
                tokens = torch.zeros(1, nodes, dtype=torch.long, device=dev)
                layout = TreeLayout(*(torch.zeros(shape, dtype=torch.long, device=dev)
                                      for shape in ((rows, gamma + 1), nodes, (rows, gamma + 1), 2)))
                self.runner(tokens, tokens, trash_view(self.cache, rows, 1), self.llm.verify_mode, tree=layout)
                nodes *= 2
            rows *= 2
        return self._time_shared_trees(gamma, most)

    def _time_shared_trees(self, gamma: int, most: int) -> dict[int, float]:
        """Seconds of a shared tree round of b sequences (1..most) at k drafts (1..gamma), keyed as the policy
        prices it (tree.verify_tokens(b, k)): its captured pass over `context` keys (trash blocks), each sequence's
        nodes as branches of up to k tokens. Chain passes on padding rows at position 0 priced a tree round at
        batch 4-8 2-4x too cheap (its attention over the context), so its first rounds lost."""
        width = self._tree_width()
        context = min(1024, self.max_len // 2)
        seconds = {}
        for b in range(1, most + 1):
            for k in range(1, gamma + 1):
                nodes = self.tree.verify_tokens(b, k)
                branches = _even_branches(nodes // b - 1, self.tree.branches, k)
                layout, tokens, pos = TreeLayout.of([(0, context, branches)] * b, self.llm.model.device, True, width)
                view = trash_view(self.cache, len(layout.host_rows), self.cache.blocks_for(context + nodes // b))
                run = lambda: self.runner(tokens[None], pos[None], view, self.llm.verify_mode, tree=layout)  # noqa: E731
                seconds[nodes] = time_ms(run, warmup=1, reps=3) / 1e3
        return seconds

    def _tree_width(self) -> int:
        """The width of a shared tree pass's rows: the deepest round's (max_gamma drafts and the pending token), so
        that one width of graphs serves every round."""
        return min(self.policy.max_gamma, MAX_GRAPHED_TOKENS - 1) + 1

    # ---------------------------------------------------------------- the scheduler

    def step(self) -> list[RequestOutput]:
        """One iteration: plan (blocks, preemptions, admissions), one prefill chunk, one batched round per k."""
        outputs: list[RequestOutput] = []
        inbox = self._take_inbox()
        if inbox is None:
            self.stopped = True
            return outputs
        self._drain(inbox, outputs)
        plan = self._schedule()
        self._execute(plan, outputs)
        self.steps += plan.steps
        self.finish_rate, self._finished = finish_rate(self.finish_rate, self._finished, plan.steps), 0
        return outputs

    def close(self) -> None:
        """Release the decode passes' CUDA graphs; under tensor parallelism, on rank 0, first end the other ranks'
        engines (their step loops, which close theirs)."""
        if self.tp.size > 1 and self.tp.rank == 0:
            self.tp.broadcast(None)
        if isinstance(self.runner, PagedGraphedModel):
            self.runner.release()

    def _take_inbox(self) -> list[tuple[str, object]] | None:
        """The requests and aborts this step applies: rank 0's, broadcast to every rank under tensor parallelism
        (None: rank 0 closed its engine)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        if self.tp.size == 1:
            return inbox
        if self.tp.rank == 0:
            self.tp.broadcast([(k, (s.id, s.prompt, s.params, s.gamma) if k == "add" else s) for k, s in inbox])
            return inbox
        shared = self.tp.broadcast()
        if shared is None:
            return None
        inbox = [(k, self._sequence(*item) if k == "add" else item) for k, item in shared]
        with self._lock:
            self._queued += sum(k == "add" for k, _ in inbox)
            self._live.update(item.id for k, item in inbox if k == "add")
        return inbox

    def _choose(self, seqs: list[Sequence]) -> tuple[int, bool]:
        """The policy's drafts per row for its rows `seqs` and whether they only measure (none while the rows are to
        stay in step: `in_step`): rank 0's under tensor parallelism (its timings), broadcast."""
        def choice() -> tuple[int, bool]:
            if in_step([s.tokens_due for s in seqs]):
                return 0, False
            return self.policy.choose(len(seqs)), self.policy.measuring

        if self.tp.size == 1:
            return choice()
        return self.tp.broadcast(choice() if self.tp.rank == 0 else None)

    def _drain(self, inbox: list[tuple[str, object]], outputs: list[RequestOutput]) -> None:
        for kind, item in inbox:
            if kind == "add":
                item.queued_step = self.steps
                self.waiting.append(item)
                continue
            seq = next((s for s in [*self.waiting, *self.running] if s.id == item), None)
            if seq is not None:
                self._finish(seq, "abort", outputs)

    def _schedule(self) -> StepPlan:
        """Running sequences first, oldest first: each gets the blocks its passes write, the newest being
        preempted while the pool is short; then newcomers, unless someone was preempted (vLLM's schedule())."""
        chunks, budget = {}, self.prefill_chunk
        for s in self.running:
            if s.row is None and budget:  # FCFS: each takes what it needs of the budget left
                chunks[s.id] = min(s.region_left, budget, self.cache.max_pass)
                budget -= chunks[s.id]
        auto = [s for s in self.running
                if s.gamma is None and (s.row is not None or s.prefilled + chunks.get(s.id, 0) == s.context_len)]
        k_auto, measuring = self._choose(auto) if auto else (0, False)
        plan, spare, preempted = StepPlan([], {}, {}, measuring), len(self.cache.free_blocks), False
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            chunk = chunks.get(seq.id, 0)
            k = self._passes(seq, chunk, k_auto)
            need = self.cache.blocks_needed(seq.id, chunk + (0 if k is None else k + 1))
            need += branch_blocks(self.tree, self.cache.block_size, k, self._round_length(seq, chunk))
            while need > spare and queue:
                spare += self._preempt(queue.pop())
                preempted = True
            if need > spare:  # only older sequences hold blocks: this one waits for them
                self._preempt(seq)
                preempted = True
                continue
            spare -= need
            self._plan(plan, seq, chunk, k)
        if not preempted:
            spare = self._admit(plan, spare, k_auto)
        plan.steps = self._burst(plan, spare)
        return plan

    def _admit(self, plan: StepPlan, spare: int, k_auto: int) -> int:
        """Waiting sequences FCFS into this step's prefill chunk while the batch, the chunk's token budget and the
        pool allow; one block per running sequence stays spare, so that the next round's growth does not at once
        preempt what was just prefilled. -> the blocks still spare."""
        plan.held = self._hold_prefill(plan)
        if plan.held:
            return spare
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            chunk = min(seq.region_left, self.prefill_chunk - plan.prefill_tokens, self.cache.max_pass)
            if not chunk:
                break
            k = self._passes(seq, chunk, k_auto)
            need = self.cache.blocks_for(chunk + (0 if k is None else k + 1))
            need += branch_blocks(self.tree, self.cache.block_size, k, self._round_length(seq, chunk))
            if need + len(self.running) > spare:
                break  # FCFS: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            with self._lock:
                self._queued -= 1
            self.cache.allocate(seq.id)
            self.running.append(seq)  # the newest: a preempted sequence resumes only after every older one
            spare -= need
            self._plan(plan, seq, chunk, k)
        return spare

    def _hold_prefill(self, plan: StepPlan) -> bool:
        """Whether the waiting prompts wait for more to share their prefill pass (DEFAULT_PREFILL_WAIT): only
        while others decode, no prefill pass runs this step anyway, the waiting ones fill less than half the
        budget, the oldest has waited fewer than prefill_wait steps, and company may come within the steps left: a
        free row past the waiting ones (an arrival), a row whose tokens due end within them, or rows finishing often
        enough that one is expected to (`finish_rate`: EOS ends rows before their due count), each freeing a row for
        its successor. Else the wait would only leave the row empty: where rows stop finishing together (drafting
        rounds, outputs of their own lengths) at batch 8 a finished row's successor waited the whole wait for company
        that could not come."""
        decoding = [s for s in self.running if s.row is not None]
        if not self.waiting or plan.prefill or not decoding:
            return False
        left = self._wait_left()
        tokens = sum(s.region_left for s in self.waiting)
        if tokens >= self.prefill_chunk // 2 or left <= 0:
            return False
        if len(self.waiting) < self.max_batch - len(self.running) or self.finish_rate * left >= 1:
            return True
        return min(min(s.tokens_due, self.max_len - s.row.length) for s in decoding) <= left

    def _wait_left(self) -> int:
        """Decode steps the oldest waiting prompt may still wait for company (prefill_wait)."""
        return self.prefill_wait - (self.steps - self.waiting[0].queued_step)

    def _preempt(self, seq: Sequence) -> int:
        """Send a running sequence back to the head of the queue and free its blocks; it is prefilled again
        (recomputed) on resume. -> the blocks freed."""
        used = self.cache.blocks_used
        self.running.remove(seq)
        self.cache.free(seq.id)
        # A lookup index (with the hybrid's streak) stays the text's; a draft model's state names cache positions
        # freed with the blocks, so it is built again. Preempted again while its resume still prefills (no row
        # yet), it keeps the history kept the first time.
        if seq.row is not None:
            history = seq.row.history
            seq.history = history if isinstance(history, TokenHistory) else None
        seq.prefilled, seq.row = 0, None
        seq.queued_step = self.steps
        self.waiting.appendleft(seq)
        with self._lock:
            self._queued += 1
        self.counters.num_preemptions += 1
        return used - self.cache.blocks_used

    def _passes(self, seq: Sequence, chunk: int, k_auto: int) -> int | None:
        """The drafts of seq's round this step, after its prefill chunk of `chunk` tokens (None: no round; a
        sequence whose chunk completes its context joins this step's round)."""
        if seq.row is None and seq.prefilled + chunk < seq.context_len:
            return None
        if self.llm.drafter is None:
            return 0
        length = self._round_length(seq, chunk)
        k = min(k_auto if seq.gamma is None else seq.gamma, self.max_len - length - 1)
        if self.tree is not None and not self.tree.forks and length + self.tree.max_nodes(k) + 1 > self.max_len:
            return 0  # no room for a shared tree's nodes past the sequence's end
        return k

    @staticmethod
    def _round_length(seq: Sequence, chunk: int) -> int:
        """seq's length at its round this step, after its prefill chunk of `chunk` tokens."""
        return seq.prefilled + chunk if seq.row is None else seq.row.length

    @staticmethod
    def _plan(plan: StepPlan, seq: Sequence, chunk: int, k: int | None) -> None:
        if chunk:
            plan.prefill.append(seq)
            plan.chunks[seq.id] = chunk
        if k is not None:
            plan.rounds.setdefault(k, []).append(seq)

    def _execute(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        kinds = [[s for s in plan.prefill if s.in_prompt], [s for s in plan.prefill if not s.in_prompt]]
        for seqs in kinds:  # prompt tokens, then generated ones recomputed (a resume): each kind its own pass
            if seqs:
                self._isolated(seqs, lambda group, outs: self._prefill_chunk(
                    group, [plan.chunks[s.id] for s in group], outs), outputs)
        for k, seqs in sorted(plan.rounds.items()):
            seqs = [s for s in seqs if s in self.running]  # its prefill may have ended it (error, EOS, length)
            if seqs:
                self._isolated(seqs, lambda group, outs, k=k: self._round(
                    group, k, plan.measuring, outs, plan.steps if k == 0 else 1), outputs)

    def _finish(self, seq: Sequence, reason: str, outputs: list[RequestOutput], error: str | None = None) -> None:
        """End a request that did not end by its own tokens (abort, error)."""
        seq.out.finish_reason = reason
        self._release(seq)
        outputs.append(RequestOutput(seq.id, [], "", True, reason, seq.out, error))

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.id)
            self._finished += 1
        else:
            self.waiting.remove(seq)
            with self._lock:
                self._queued -= 1
        seq.out.stats.total_s = time.perf_counter() - seq.arrival
        with self._lock:
            self._live.discard(seq.id)

    def _isolated(self, seqs: list[Sequence], fn, outputs: list[RequestOutput]) -> None:
        """Run fn over seqs as one batch; if it raises, run each alone, so only a failing request ends with
        an error. fn must leave its sequences untouched when it raises."""
        try:
            fn(seqs, outputs)
        except Exception as e:  # noqa: BLE001 (a request's failure must not take the engine down)
            if len(seqs) > 1:
                for s in seqs:
                    self._isolated([s], fn, outputs)
            else:
                self._finish(seqs[0], "error", outputs, f"{type(e).__name__}: {e}")

    def _emit(self, seq: Sequence, tokens: list[int], outputs: list[RequestOutput]) -> None:
        """Hand a row's committed tokens to its request (detokenize, stop strings, EOS, length)."""
        try:
            self.cache.truncate(seq.id, seq.row.length)  # commit the accepted tokens, roll back the rest
            text, kept, finished = self.llm.append_tokens(seq.out, tokens, seq.params)
        except Exception as e:  # noqa: BLE001
            self._finish(seq, "error", outputs, f"{type(e).__name__}: {e}")
            return
        if finished:
            self._release(seq)
        outputs.append(RequestOutput(seq.id, kept, text, finished, seq.out.finish_reason if finished else None,
                                     seq.out))

    # ---------------------------------------------------------------- prefill and rounds

    @torch.inference_mode()
    def _prefill_chunk(self, seqs: list[Sequence], sizes: list[int], outputs: list[RequestOutput]) -> None:
        """Prefill sizes[i] more context tokens of each seqs[i], packed into one pass without padding."""
        dev = self.llm.model.device
        contexts = [s.context for s in seqs]
        resumed = [bool(s.out.token_ids) for s in seqs]  # preempted: the pending token is drawn already
        for s, n in zip(seqs, sizes):
            self.cache.extend(s.id, n)
        toks, pos = packed_positions([(c, s.prefilled, s.prefilled + n) for s, c, n in zip(seqs, contexts, sizes)], dev)
        ends = list(accumulate(sizes))  # each row's last token in the packed order, + 1
        done = [s.prefilled + n == len(c) for s, c, n in zip(seqs, contexts, sizes)]
        drawing = [i for i, (d, r) in enumerate(zip(done, resumed)) if d and not r]  # rows whose first token is due
        packed = Packed.of(sizes, [s.prefilled + n for s, n in zip(seqs, sizes)], dev)
        mode = prompt_mode(self.llm.verify_mode) if seqs[0].in_prompt else self.llm.verify_mode
        last = self.runner(toks, pos, self.cache.view([s.id for s in seqs]), mode,
                           logits_at=long_tensor([ends[i] - 1 for i in drawing], dev), packed=packed)
        top = last.argmax(-1).tolist()  # greedy rows' first tokens: one pass and one copy, not one per row
        first = [None] * len(seqs)
        for j, i in enumerate(drawing):
            s = seqs[i]
            first[i] = top[j] if s.params.greedy else pick(last[j], s.params, s.gen)
        now = time.perf_counter()
        for s, n, d, r, tok in zip(seqs, sizes, done, resumed, first):
            s.prefilled += n
            self.cache.truncate(s.id, s.prefilled)
            if d and r:
                s.row = Row(s.out.token_ids[-1], s.prefilled, s.params, s.gen, s.out.stats,
                            self._resumed_history(s))
            elif d:
                s.out.stats.prefill_s = now - s.arrival  # time to first token, queueing included
                s.row = Row(tok, s.prefilled, s.params, s.gen, s.out.stats, self._history(s.prompt + [tok]))
        for s, d, r in zip(seqs, done, resumed):
            if d and not r:
                self._emit(s, [s.row.pending], outputs)

    def _history(self, tokens: list[int]) -> TokenHistory | None:
        return self.llm.drafter.history(tokens) if self.llm.drafter is not None else None

    def _resumed_history(self, seq: Sequence) -> TokenHistory | None:
        """A resumed sequence's history: the one its row had (so a drafter's state carries on as in a solo run),
        where it holds the sequence's text; else built again."""
        tokens = seq.prompt + seq.out.token_ids
        kept, seq.history = seq.history, None
        return kept if kept is not None and kept.tokens == tokens else self._history(tokens)

    def _round(self, seqs: list[Sequence], k: int, measuring: bool, outputs: list[RequestOutput],
               steps: int = 1) -> None:
        """One batched round of k drafts, or (k = 0) of `steps` plain decoding steps back to back (`_burst`). In a
        measuring round, the policy's greedy rows in step with another (`_lockstep`) emit one token each: drafts
        they accepted would move them ahead of the others, and requests started together would stop finishing
        together, their successors then prefilled one by one (docs/gpu.md)."""
        shared = k and self._shares_rows(seqs)
        for s in seqs:  # a tree sharing its sequence's row stores its nodes in the sequence's own blocks
            self.cache.extend(s.id, self.tree.max_nodes(k) + 1 if shared else max(k + 1, steps))
        rows = [s.row for s in seqs]
        lockstep = self._lockstep(seqs) if measuring and k else [False] * len(seqs)
        if steps > 1:
            result = run_steps(self.runner, self.cache.view([s.id for s in seqs]), rows, self.llm.verify_mode, steps)
        elif self.tree is not None and k:
            result = self._tree_round(seqs, k, lockstep)
        else:
            result = run_round(self.runner, self.cache.view([s.id for s in seqs]), rows, k, self.llm.drafter,
                               self.llm.verify_mode, self.accept, lockstep)
        self.policy.observe_round(len(rows), result.k, result.draft_s, result.verify_s / steps, steps)
        self.policy.observe_acceptance(k, result.accepted)
        c = self.counters
        c.num_row_rounds += len(rows) * steps
        c.num_lockstep_rows += sum(lockstep)
        if k:
            c.num_drafts += len(rows)
            c.num_draft_tokens += sum(result.proposed)
            c.num_accepted_tokens += sum(result.accepted)
        for s, toks in zip(seqs, result.tokens):
            self._emit(s, toks, outputs)

    @staticmethod
    def _lockstep(seqs: list[Sequence]) -> list[bool]:
        """The rows a measuring round keeps in step (`_round`): the policy's greedy rows due as many tokens as another
        such row (requests that would finish, and be replaced, together). A row due its own count is out of step
        already and commits what it accepts."""
        policy = [s.gamma is None and s.params.greedy for s in seqs]
        due = Counter(s.tokens_due for s, p in zip(seqs, policy) if p)
        return [p and due[s.tokens_due] > 1 for s, p in zip(seqs, policy)]

    def _burst(self, plan: StepPlan, spare: int) -> int:
        """Plain decoding steps the planned step's round runs back to back: up to decode_steps where the step has one
        round, it drafts nothing, every row is greedy (a sampling row draws on the host), the cache is the bf16 one
        (a quantized cache settles its buffer between passes), no prompt waits for a free row (it would wait for the
        whole burst) unless it is held for company (then up to the steps its wait has left: rows out of step hold a
        successor often, and one step at a time each step paid the host time four share) and the `spare` blocks
        cover the steps past the first; else 1. A row whose prefill ends this step joins the burst after its first
        token (the prefill's): where requests stop finishing together (drafting rounds, outputs of their own
        lengths) rows join often, and a join that stopped the burst cost the step the host time four steps share.
        No row goes past the longest output still due, nor past the model's length; a row stopping inside the burst
        (EOS, length, a stop string) drops the tokens after its stop."""
        seqs = plan.rounds.get(0, [])
        waits = self.waiting and len(self.running) < self.max_batch
        if (self.decode_steps == 1 or len(plan.rounds) != 1 or not seqs or isinstance(self.cache, PagedQuantKVCache)
                or (waits and not plan.held) or any(not s.params.greedy for s in seqs)):
            return 1
        wait_left = self._wait_left() if waits else self.decode_steps
        chunk = {s.id: plan.chunks.get(s.id, 0) for s in seqs}
        steps = min(self.decode_steps, wait_left, max(s.tokens_due for s in seqs),
                    *(self.max_len - self._round_length(s, chunk[s.id]) - 1 for s in seqs))
        more = sum(self.cache.blocks_needed(s.id, chunk[s.id] + steps) - self.cache.blocks_needed(s.id, chunk[s.id] + 1)
                   for s in seqs)
        return steps if steps > 1 and more <= spare else 1

    def _shares_rows(self, seqs: list[Sequence]) -> bool:
        """Whether a tree round of `seqs` reads each sequence's own row (SharedTree, a node-packed pass): for a
        drafter that forks no rows, in a round of up to SHARED_TREE_BATCH sequences, whose pass shapes warm_up
        captures (larger rounds verify forked rows)."""
        return self.tree is not None and self.tree.shares_row(len(seqs))

    def _tree_round(self, seqs: list[Sequence], k: int, lockstep: list[bool]) -> RoundResult:
        """A tree drafter's round, every branch verified in one pass: each sequence's branches reading its own
        blocks (SharedTree, each node run once; `_shares_rows`), or each sequence forked into its branch rows
        (PagedTree), the winner's committed KV copied into the sequence's own blocks, the branch blocks given
        back."""
        trees = []
        shared = self._shares_rows(seqs)
        try:
            for s in seqs:
                trees.append(SharedTree(self.cache, s.id) if shared
                             else PagedTree(self.cache, s.id, self.tree.branches))
            return tree_rounds(self.runner, trees, [s.row for s in seqs], k, self.tree, self.llm.verify_mode,
                               lambda spans: tree_view(trees, spans), self.accept, "shared" if shared else "forked",
                               self._tree_width() if shared else 0, lockstep)
        finally:
            for t in trees:
                t.release()
