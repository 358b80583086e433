"""Speculation traces: what each round of a recipe did on a real model and task, recorded once and replayed through
the real decoding loop on any model (e.g. a synthetic 8B shape on the GPU, selfspec/bench/spec.py).

python -m selfspec.bench.traces --model smollm2-135m --recipe ngram [--tasks mtbench humaneval gsm8k essay]
    [--prompts 4] [--max-new-tokens 64] [--gamma 5] [--temperature 0] [--draft ngram:2-4]
    -> selfspec/bench/traces/smollm2-135m.ngram.json

A trace (JSON, "version": 3) holds per task one row per round, `FIELDS`:
  kind         draft (k draft steps in a draft mode or of a draft model), lookup (n-gram lookup: no draft step),
               tree (several candidate branches verified in one pass), none (nothing proposed: a plain step)
  proposed     draft tokens the verify pass checked (a lookup proposes 0..k; a tree: every branch's)
  draft_steps  forward passes the drafter paid (0 for a lookup)
  branches     rows of the verify pass (1 for a chain, B for a tree)
  verified     tokens the verify pass ran: branches x (longest proposal + the pending token)
  accepted     drafts accepted (the round commits accepted + 1 tokens)
  nodes        distinct draft tokens (a tree's branches share their prefixes; a chain: proposed)
Recorded at gamma G: replayed at k <= G (Table 3 records each gamma instead), a round is cut to k drafts (greedy
drafts and lookups are deterministic: the first k of G are what drafting k would propose) and accepts
min(accepted, k). Version 2 traces (no nodes: every branch's tokens counted apart) and version 1 traces (a list of
accepted counts per task, self-draft chains) still load. A trace of
recipe draft-model names its drafter (`draft_model`): its draft steps are another model's, so it is not replayed on
one model (bench/spec.py skips it).
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import deque
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.bench.passes import PassLog, decode_rows
from selfspec.bench.prompts import essay_prompts
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.quant.modes import Mode
from selfspec.speculative.decode import GreedyAcceptance, decode
from selfspec.speculative.draft_model import DraftModel
from selfspec.speculative.drafters import Proposal, TokenHistory, TreeDrafter, draft_tokens, lookup_proposal
from selfspec.speculative.recipes import PRESETS
from selfspec.speculative.sampling import SamplingParams

TRACE_DIR = Path(__file__).parent / "traces"
VERSION = 3
FIELDS = ("kind", "proposed", "draft_steps", "branches", "verified", "accepted", "nodes")
KINDS = ("draft", "lookup", "tree", "none")
TASKS = ("mtbench", "humaneval", "gsm8k", "essay")  # essay: summarise / answer from a Paul Graham essay
DEFAULT_GAMMA = 5


@dataclass(frozen=True)
class Round:
    kind: str
    proposed: int
    draft_steps: int
    branches: int
    verified: int
    accepted: int
    nodes: int | None = None  # None: proposed (every branch's tokens distinct)

    def __post_init__(self) -> None:
        if self.nodes is None:
            object.__setattr__(self, "nodes", self.proposed)

    @property
    def width(self) -> int:
        """The longest proposal (drafts per verify row)."""
        return self.verified // self.branches - 1

    def cut(self, k: int) -> Round:
        """This round drafting at most k tokens (per branch): the first k of its proposal, k of its draft steps."""
        if self.width <= k and self.draft_steps <= k:
            return self
        width = min(self.width, k)
        return Round(self.kind, self.proposed * width // self.width, min(self.draft_steps, k), self.branches,
                     self.branches * (width + 1), min(self.accepted, k), max(width, self.nodes * width // self.width))

    def accepting(self, accepted: int) -> Round:
        """This round accepting `accepted` drafts. Built directly: dataclasses.replace took 3 us, which the serving
        replay paid for every row of every round (a real lookup costs the engine 3 us a row)."""
        return Round(self.kind, self.proposed, self.draft_steps, self.branches, self.verified, accepted, self.nodes)


@dataclass
class Trace:
    model: str
    recipe: str
    draft: str | None
    verify: str
    gamma: int
    temperature: float = 0.0
    max_new_tokens: int = 0  # tokens recorded per prompt
    prompts: int = 0  # prompts per task
    source: str = ""
    tasks: dict[str, list[Round]] = field(default_factory=dict)
    draft_model: str | None = None  # recipe draft-model: the model that drafts (its steps are that model's)
    draft_vocab: int = 0  # the draft's head read this many most frequent tokens (0: all)

    def rounds(self, task: str | None = None) -> list[Round]:
        """One task's rounds, or every task's in turn."""
        return self.tasks[task] if task is not None else [r for rs in self.tasks.values() for r in rs]

    def accepted(self, task: str | None = None) -> list[int]:
        return [r.accepted for r in self.rounds(task)]

    def label(self, task: str | None = None) -> str:
        t = f"T={self.temperature:g}" if self.temperature else "greedy"
        draft = f"{self.draft_model} {self.draft}" if self.draft_model else self.draft
        draft += f" over {self.draft_vocab} tokens" if self.draft_vocab else ""
        return f"{self.model}/{task or '+'.join(self.tasks)} ({draft}, {t}, gamma {self.gamma})"

    def to_json(self) -> dict:
        optional = ("draft_model", "draft_vocab")  # written where set
        head = {k: v for k, v in asdict(self).items() if k != "tasks" and (k not in optional or v)}
        return {"version": VERSION, **head, "fields": list(FIELDS),
                "tasks": {task: [[getattr(r, f) for f in FIELDS] for r in rs] for task, rs in self.tasks.items()}}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")


def from_json(d: dict) -> Trace:
    """A trace from its JSON: version 3 (rounds as FIELDS rows), 2 (no nodes: each round's proposed), or 1 (no
    version: accepted counts of self-draft chains at `gamma`, each round drafting gamma tokens)."""
    version = d.get("version", 1)
    if version not in (1, 2, VERSION):
        raise SelfspecError(f"trace version {version} is not one this selfspec reads (1 to {VERSION}); "
                            "record it again with python -m selfspec.bench.traces")
    head = {k: d[k] for k in ("model", "recipe", "draft", "verify", "gamma")}
    extra = {k: d[k] for k in ("temperature", "max_new_tokens", "prompts", "source", "draft_model", "draft_vocab")
             if k in d}
    if version == 1:
        g = d["gamma"]
        tasks = {task: [Round("draft", g, g, 1, g + 1, n) for n in acc] for task, acc in d["tasks"].items()}
    else:
        idx = [d["fields"].index(f) for f in FIELDS if f in d["fields"]]
        tasks = {task: [Round(*(row[i] for i in idx)) for row in rows] for task, rows in d["tasks"].items()}
    for rs in tasks.values():
        for r in rs:
            if r.kind not in KINDS or r.branches < 1 or not 0 <= r.accepted <= r.width:
                raise SelfspecError(f"malformed trace round {r}: kind one of {KINDS}, branches >= 1, "
                                    "0 <= accepted <= verified / branches - 1")
    return Trace(**head, **extra, tasks=tasks)


def load(path: Path) -> Trace:
    with open(path) as f:
        return from_json(json.load(f))


# ---------------------------------------------------------------- recording


def round_of(calls: list[tuple[int, int, int]], accepted: int) -> Round:
    """A round from the decode passes it ran (`passes.decode_rows`: the last one verifies) and the drafts it
    accepted."""
    branches, tokens, nodes = calls[-1]
    proposed, steps = branches * (tokens - 1), len(calls) - 1
    kind = "none" if proposed == 0 else "tree" if branches > 1 else "draft" if steps else "lookup"
    return Round(kind, proposed, steps, branches, branches * tokens, accepted, nodes)


def record(llm, prompts: list, gamma: int, max_new_tokens: int, temperature: float = 0.0,
           seed: int = 0) -> list[Round]:
    """Every round of the recipe's drafter over the prompts (text, chat messages or token ids), drafting gamma
    tokens a round (no gamma policy), greedy at temperature 0, else sampled (seeded per prompt)."""
    log = PassLog(llm.runner)
    draft = llm.drafter
    if isinstance(draft, DraftModel):  # its steps run on its own model: log them too
        draft = DraftModel(PassLog(draft.model, log.calls), draft.mode, draft.name)
    rounds = []
    for i, prompt in enumerate(tqdm(prompts, desc=f"trace {llm.recipe.name}", leave=False)):
        params = SamplingParams(temperature=temperature, seed=seed + i if temperature else None,
                                max_new_tokens=max_new_tokens, ignore_eos=True)
        stats, emitted = GenerationStats(), -1  # the prefill's token is not a round's
        ids = prompt_ids(llm, prompt)
        llm.fit_draft_vocab(ids)
        for tokens in decode(log, ids, llm.verify_mode, draft, gamma, params, stats):
            if emitted >= 0:
                rounds.append(round_of(decode_rows(log.calls), len(tokens) - 1))
            log.calls.clear()
            emitted += len(tokens)
            if emitted >= max_new_tokens:
                break
    return rounds


def prompt_ids(llm, prompt: str | list) -> list[int]:
    """Token ids as they are; text and chat messages through the eval's encoding."""
    if prompt and isinstance(prompt[0], int):
        return llm.encode(prompt)
    from selfspec.eval.runner import encode

    return encode(llm, prompt)


def task_prompts(tasks: list[str], n: int) -> dict[str, list]:
    """The first n prompts of each task: GSM8K as the eval builds it (8-shot chat), HumanEval's code prompts,
    MT-Bench's first turns and the essay prompts (chat)."""
    from selfspec.bench.serve import read_prompts
    from selfspec.eval.tasks import get_task

    out = {}
    for task in tasks:
        if task not in TASKS:
            raise SelfspecError(f"unknown trace task '{task}'; choose from: {', '.join(TASKS)}")
        if task in ("gsm8k", "humaneval"):
            out[task] = [it.prompt for it in get_task(task).load_items(None, chat=True)[:n]]
        else:
            texts = read_prompts(task)[:n] if task == "mtbench" else essay_prompts(n)
            out[task] = [[{"role": "user", "content": t}] for t in texts]
    return out


def record_trace(llm, name: str, prompts: dict[str, list], gamma: int, max_new_tokens: int,
                 temperature: float = 0.0, log=print) -> Trace:
    dev = llm.model.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU"
    trace = Trace(name, llm.recipe.name, llm.recipe.draft, llm.recipe.verify, gamma, temperature, max_new_tokens,
                  max(map(len, prompts.values())), f"recorded by selfspec.bench.traces on {where}",
                  draft_model=llm.recipe.draft_model, draft_vocab=llm.recipe.draft_vocab)
    for task, texts in prompts.items():
        rs = trace.tasks[task] = record(llm, texts, gamma, max_new_tokens, temperature)
        log(f"{trace.label(task)}: {len(rs)} rounds, mean acceptance length "
            f"{1 + sum(r.accepted for r in rs) / len(rs):.2f}, draft steps {sum(r.draft_steps for r in rs)}")
    return trace


def trace_path(out: Path, name: str, recipe: str, draft: str | None, temperature: float, gamma: int,
               default_draft: str | None, draft_model: str | None = None, draft_vocab: int = 0) -> Path:
    """<model>.<recipe>[.<draft model>][.<draft>][.v<draft vocabulary>][.t<T>][.g<gamma>].json: the plain name where
    draft, draft vocabulary, temperature and gamma are the defaults."""
    parts = [name, recipe] + ([Path(draft_model).name] if draft_model else [])
    if draft != default_draft:
        parts.append(draft.replace(":", "-"))
    if draft_vocab:
        parts.append(f"v{draft_vocab}")
    if temperature:
        parts.append(f"t{temperature:g}")
    return out / (".".join(parts) + ("" if gamma == DEFAULT_GAMMA else f".g{gamma}") + ".json")


# ---------------------------------------------------------------- replay


class Replay:
    """Drafter and greedy acceptance in one: round i (cycling through `rounds`, each cut to the k asked) pays its
    recorded draft steps in `mode` (None: a round that pays any is refused), proposes its recorded count, and
    accepts its recorded count; the verify pass and the next token are the model's own. `steps` counts the draft
    passes paid, `verified` the tokens verify passes ran."""

    def __init__(self, rounds: list[Round], mode: Mode | None) -> None:
        if not rounds:
            raise SelfspecError("a trace with no rounds cannot be replayed; record it with more tokens or prompts")
        self.rounds, self.mode = rounds, mode
        self.runs_steps = mode is not None  # Drafter.runs_steps: a replay of lookups or recycled trees runs none
        self.i = 0
        self.current: Round | None = None
        self.steps = 0
        self.verified = 0

    def next_round(self, k: int) -> Round:
        return self.take(self.rounds[self.i % len(self.rounds)], k)

    def take(self, r: Round, k: int) -> Round:
        """Round r, cut to k, as this round's (counted in `i`, its verified tokens in `verified`)."""
        r = r.cut(k)
        self.i += 1
        self.current = r
        self.verified += r.verified
        if r.draft_steps and self.mode is None:
            raise SelfspecError("the trace's rounds pay draft steps, but the recipe replaying it has no draft mode "
                                "(a draft model's steps cannot be replayed on one model): replay a self-draft or "
                                "lookup trace")
        return r

    def history(self, tokens: list[int]) -> TokenHistory | None:
        return None

    def drafts(self, model, cache, row, r: Round) -> list[int]:
        """r.width tokens per branch: r.draft_steps of them from real draft-mode steps, the rest arbitrary
        (acceptance is replayed: the tokens' values do not matter)."""
        dev = model.device
        steps = []
        if r.draft_steps:
            toks, _ = draft_tokens(model, cache, [row], torch.tensor([row.pending], device=dev),
                                   torch.tensor([[row.length]], device=dev), r.draft_steps, self.mode)
            steps = toks[0].tolist()
            self.steps += r.draft_steps
        return (steps + [row.pending] * r.width)[:r.width]

    def accept(self, drafts: list[int], target: list[int]) -> tuple[int, int]:
        n = min(self.current.accepted, len(drafts))
        return n, target[n]

    def branches_of(self, model, cache, row, r: Round) -> list[list[int]]:
        """Round r's tree from row: its branches, the first as long as the longest (its draft steps run on cache),
        the others forking at the root with the rest of its distinct tokens (at least one each); [] if it proposed
        nothing."""
        if r.proposed == 0:
            return []
        return tree_branches(self.drafts(model, cache, row, r), r.branches, r.nodes, row.pending, model.cfg.vocab_size)


class ChainReplay(Replay):
    """Replay of chain rounds (self-draft, lookup) through run_round."""

    def propose(self, model, cache, rows, pending: torch.Tensor, lengths: torch.Tensor, k: int) -> Proposal:
        r = self.next_round(k)
        tokens = self.drafts(model, cache, rows[0], r)
        return Proposal(torch.tensor([tokens], dtype=torch.long, device=pending.device), [len(tokens)], [None])


class TreeReplay(Replay, TreeDrafter):
    """Replay of a trace with tree rounds through tree_round: a round's branches are verified as rows of one pass
    (its draft steps run on the first row: at batch 1 a step's extra rows cost little on a GPU)."""

    def __init__(self, rounds: list[Round], mode: Mode | None) -> None:
        super().__init__(rounds, mode)
        self.branches = max(r.branches for r in rounds)
        # As the recorded drafter: its branches on rows of their own where its draft steps ran on them.
        self.forks = any(r.draft_steps for r in rounds if r.branches > 1)

    def propose_tree(self, model, cache, row, k: int) -> list[list[int]]:
        return self.branches_of(model, cache.rows(0, 1), row, self.next_round(k))


def tree_branches(first: list[int], branches: int, nodes: int, token: int, vocab: int) -> list[list[int]]:
    """A tree of `branches` branches and `nodes` distinct draft nodes whose first branch is `first` (the longest):
    the others fork at the root, branch b repeating token + b, with the rest of the nodes (at least one each)."""
    width = len(first)
    left, out = nodes - width - (branches - 1), [first]
    for b in range(1, branches):
        n = 1 + min(max(left, 0), width - 1)
        left -= n - 1
        out.append([(token + b) % vocab] * n)
    return out


def catches_up(r: Round) -> bool:
    """Whether a draft model's round leaves its cache one token behind: it accepted every draft, so the last one,
    never fed, is fed by one more step before the next round's (speculative/draft_model.py)."""
    return r.accepted == r.draft_steps > 0


class DraftModelReplay(ChainReplay):
    """Replay of recipe draft-model's rounds: their draft steps run on another model (`draft`, a GraphedModel of
    the draft model's shape, with its own cache). As speculative/draft_model.py does, a round after one that
    accepted all its drafts first feeds the last draft (its KV was never written): one more step of the draft
    model, counted in `steps`."""

    def __init__(self, rounds: list[Round], mode: Mode, draft, max_len: int) -> None:
        super().__init__(rounds, mode)
        self.draft = draft
        self.cache = draft.new_cache(max_len)
        self.behind = 0  # tokens the draft cache missed last round

    def drafts(self, model, cache, row, r: Round) -> list[int]:
        dev, behind = self.draft.device, self.behind
        toks, _ = draft_tokens(self.draft, self.cache, [row], torch.tensor([row.pending], device=dev),
                               torch.tensor([[row.length - behind]], device=dev), behind + r.draft_steps, self.mode)
        self.steps += behind + r.draft_steps
        self.behind = int(catches_up(r))
        return (toks[0, behind:].tolist() + [row.pending] * r.width)[:r.width]


def replay(rounds: list[Round], mode: Mode | None) -> ChainReplay | TreeReplay:
    """The replaying drafter of a trace's rounds: tree rounds need a cache row per branch (tree_round)."""
    return TreeReplay(rounds, mode) if any(r.branches > 1 for r in rounds) else ChainReplay(rounds, mode)


class RecordedText:
    """A trace's tasks' rounds laid end to end as one text: the round at a text position, accepting what remains of
    its accepted run there, and each task's first position."""

    def __init__(self, tasks: list[list[Round]]) -> None:
        self.rounds = [r for rs in tasks for r in rs]
        self.starts = list(accumulate((r.accepted + 1 for r in self.rounds), initial=0))  # each round's first position
        self.task_starts = list(accumulate((sum(r.accepted + 1 for r in rs) for rs in tasks[:-1]), initial=0))

    def round_at(self, p: int) -> Round:
        """The round at text position p (cycling through the text)."""
        p %= self.starts[-1]
        i = bisect.bisect_right(self.starts, p) - 1
        r = self.rounds[i]
        return r.accepting(self.starts[i] + r.accepted - p)


class ServeReplay(Replay):
    """The serving benchmark's drafter over synthetic weights for a trace whose rounds ran no draft step (lookups,
    recycled or looked-up trees): on random prompts the recorded drafter would find nothing to propose, so a
    sequence's round is the recorded one at its place in the recorded text, with its recorded shape (a lookup's
    tokens; a tree's branches and nodes) and what remains of its accepted run. The k-th sequence seen reads from the
    start of task k (mod the tasks, then on through the trace, cycling), its generated token g at text position
    start + g: a plain step moves through the text as it would on the real prompt, so a stretch where drafting does
    not pay passes while the policy decodes plainly (handing out rounds in trace order made it wait for the policy
    to draft through it). It is the engine's greedy acceptance too: the engine judges a round's rows in the order
    it proposed them, so the counts follow the proposals through a queue (a plain round, which proposed nothing,
    accepts nothing)."""

    def __init__(self, tasks: list[list[Round]]) -> None:
        rounds = [r for rs in tasks for r in rs]
        if any(r.draft_steps for r in rounds):
            raise SelfspecError("a serving replay replays rounds with no draft step (lookups, recycled trees); this "
                                "trace's rounds pay draft steps: replay its accepted counts on the recipe's own "
                                "drafter (ReplayAcceptance)")
        super().__init__(rounds, None)
        self.text = RecordedText(tasks)
        self.origins: dict[int, tuple[GenerationStats, int]] = {}  # a sequence's (stats, first text position)
        self.due: deque[Round] = deque()

    def round_at(self, row) -> Round:
        """The recorded round at row's place in the text, accepting what remains of its accepted run there."""
        stats, origin = self.origins.setdefault(  # the stats object kept: its id names the sequence while it lives
            id(row.stats), (row.stats, self.text.task_starts[len(self.origins) % len(self.text.task_starts)]))
        return self.text.round_at(origin + row.length - stats.prompt_tokens)

    def next_rounds(self, rows: list, k: int) -> list[Round]:
        """Each row's round, cut to k drafts, queued for their acceptance (the last round's are all judged)."""
        self.due = deque(self.take(self.round_at(row), k) for row in rows)
        return list(self.due)

    def __call__(self, drafts: list[int], target: list[int]) -> tuple[int, int]:
        n = min(self.due.popleft().accepted, len(drafts)) if self.due else 0
        return n, target[n]

    def tree(self, branches: list[list[int]], targets: list[list[int]]) -> tuple[int, int, int]:
        return on_longest(self, branches, targets)


class ServeChainReplay(ServeReplay):
    """Lookup rounds: a row proposes its round's recorded count of tokens (their values do not matter)."""

    def propose(self, model, cache, rows, pending: torch.Tensor, lengths: torch.Tensor, k: int) -> Proposal:
        # A lookup's proposal of the recorded count of tokens (a round that proposed none: 0), on the host as one.
        return lookup_proposal([[row.pending] * r.width for row, r in zip(rows, self.next_rounds(rows, k))], k)


class ServeTreeReplay(ServeReplay, TreeDrafter):
    """Tree rounds: a row proposes its round's branches and nodes, each sequence's nodes over its own blocks."""

    def __init__(self, tasks: list[list[Round]]) -> None:
        super().__init__(tasks)
        self.branches = max(r.branches for r in self.rounds)
        self._most_nodes: dict[int, int] = {}

    def max_nodes(self, k: int) -> int:
        """The most nodes `tree_branches` builds for a round cut to k: its own, or a node per branch past the first
        (a deep tree cut short keeps its branches)."""
        if k not in self._most_nodes:
            self._most_nodes[k] = max(max(c.nodes, c.width + c.branches - 1) for c in (r.cut(k) for r in self.rounds))
        return self._most_nodes[k]

    def propose_trees(self, model, trees: list, rows: list, k: int, view) -> list[list[list[int]]]:
        return [self.branches_of(model, None, row, r) for row, r in zip(rows, self.next_rounds(rows, k))]


def serve_replay(tasks: list[list[Round]]) -> ServeChainReplay | ServeTreeReplay:
    """The serving replay of tasks' rounds with no draft step: trees where any round is one."""
    trees = any(r.branches > 1 for rs in tasks for r in rs)
    return ServeTreeReplay(tasks) if trees else ServeChainReplay(tasks)


class ReplayAcceptance:
    """Greedy acceptance of the serving engine's rounds from accepted counts: round i accepts min(trace[i], k)
    drafts (a tree round: on its longest branch); the next token is the verify pass's own argmax there. Cycles
    through the trace."""

    def __init__(self, accepted: list[int]) -> None:
        self.accepted = accepted
        self.i = 0

    def __call__(self, drafts: list[int], target: list[int]) -> tuple[int, int]:
        n = min(self.accepted[self.i % len(self.accepted)], len(drafts))
        self.i += 1
        return n, target[n]

    def tree(self, branches: list[list[int]], targets: list[list[int]]) -> tuple[int, int, int]:
        return on_longest(self, branches, targets)


def on_longest(accept: GreedyAcceptance, branches: list[list[int]], targets: list[list[int]]) -> tuple[int, int, int]:
    """A tree round judged as one recorded round (decode.py `accept_branches`): its count goes to its longest branch
    (the first of them), not one count to each branch, whose best would be the best of several rounds."""
    best = max(range(len(branches)), key=lambda i: (len(branches[i]), -i))
    return (best, *accept(branches[best], targets[best]))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    import selfspec

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="planes")
    ap.add_argument("--draft", default=None, help="the recipe's drafter overridden (e.g. ngram:2-4)")
    ap.add_argument("--draft-model", default=None, help="recipe draft-model: the model that drafts")
    ap.add_argument("--draft-vocab", type=int, default=None, help="the draft's head reads the N most frequent tokens")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per task (the first ones)")
    ap.add_argument("--gamma", type=int, default=DEFAULT_GAMMA)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled at this temperature")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None, help="the model's name in the trace (default: --model)")
    ap.add_argument("--prompts-file", type=Path, default=None,
                    help="JSON {task: [prompt, ...]} instead of the task datasets (for machines without them)")
    ap.add_argument("--out", type=Path, default=TRACE_DIR)
    args = ap.parse_args(argv)
    name = args.name or args.model
    llm = selfspec.load(args.model, args.recipe, draft=args.draft, gamma=args.gamma, device=args.device,
                        draft_model=args.draft_model, draft_vocab=args.draft_vocab)
    if args.prompts_file is None:
        prompts = task_prompts(args.tasks, args.prompts)
    else:
        prompts = {t: ps[: args.prompts] for t, ps in json.loads(args.prompts_file.read_text()).items()}
    trace = record_trace(llm, name, prompts, args.gamma, args.max_new_tokens, args.temperature)
    default_draft = llm.recipe.verify if llm.recipe.draft_model else PRESETS[llm.recipe.name].draft
    path = trace_path(args.out, name, llm.recipe.name, llm.recipe.draft, args.temperature, args.gamma, default_draft,
                      llm.recipe.draft_model, llm.recipe.draft_vocab)
    trace.save(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
