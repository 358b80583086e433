"""Drafters: what proposes a round's k tokens per row before the verify pass.

- `SelfDraft(mode)`: k batched model steps in a draft mode of the same stored weights (the quantized self-draft).
- `NgramDrafter(max_n, min_n)`: prompt lookup, as in vLLM / SGLang / llama.cpp: the row's last n tokens (n from
  max_n down to min_n) are looked up in its own prompt + generated text, and the tokens that followed their most
  recent earlier occurrence are proposed. No model step: its cost is a few dictionary look-ups per row.

Tree drafters propose several candidate continuations (branches) of each sequence, verified in one batched pass
as forked chains (decode.py `tree_rounds`), in solo decoding and in the serving engine (whose sequences' draft steps
run together):
- `NgramTree(branches)`: distinct continuations of several earlier occurrences (longest n first, most recent
  first);
- `SelfDraftTree(mode, branches)`: the draft mode's top-B first tokens, each continued greedily (B rows at once);
- `HybridTree(branches)`: n-gram branches when the lookup matches, plus the `upper` self-draft chain as the last
  branch; the self-draft tree when nothing matches.
- `RecycleTree(branches)`: a tree of that many tokens: the lookup's continuation where it matches, the rest grown
  from the next tokens the verify passes ranked (recycling.py): no model step.

`HybridDrafter` (recipe `hybrid`) is a chain drafter: each row's lookup where it matches, the `upper` self-draft chain
where lookups keep missing (a round with no chain pays no draft step).

A proposal of n < k tokens (none where nothing matches) is padded for the batched verify pass, which runs as far
as the longest proposal of the batch (a round where nothing matches costs a plain step), and only its n real
tokens are judged: a row with no proposal is a plain decoding step. With sampling, a lookup proposal is
drawn from a one-hot q, for which rejection sampling (verify.py) accepts d with probability p(d) and otherwise
draws from p with d removed: the output still follows the verify distribution exactly.
"""
from __future__ import annotations

import re
from collections import ChainMap
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Protocol

import torch

from selfspec.errors import SelfspecError
from selfspec.host import long_tensor
from selfspec.quant.modes import Mode, get_mode
from selfspec.speculative.policy import GammaPolicy
from selfspec.speculative.recycling import DEFAULT_WIDTH, RANK_PRIORS, SuccessorTable, grow
from selfspec.speculative.sampling import sample, to_probs

if TYPE_CHECKING:
    from selfspec.speculative.decode import Row

LOOKUP_NAME = re.compile(r"(ngram|hybrid)(?::(\d+)-(\d+))?")  # hybrid: a lookup, else the upper chain
TREE_NAME = re.compile(r"(ngram-tree|hybrid-tree|recycle-tree|tree:([\w-]+?))(?::(\d+))?")
DEFAULT_NGRAM = (1, 3)  # (min_n, max_n)
DEFAULT_BRANCHES = 4
# Rounds of up to this many sequences run a drafter's shared trees (each sequence's nodes once, over its own blocks);
# larger rounds fork a row per branch. The engine captures a graph per shape of them, each keeping the logits of
# every node it runs: ~0.9 GB of them at 8 sequences of 16 nodes for an 8B model's vocabulary of 128k.
SHARED_TREE_BATCH = 8
HYBRID_DRAFT = "upper"  # the hybrids' self-draft mode: the cheap half of the planes storage
TREE_NAMES = "ngram-tree[:B], tree:MODE[:B] (e.g. tree:upper:4), hybrid-tree[:B] or recycle-tree[:N]"
RowsView = Callable[[list[tuple[int, int]]], object]  # spans[i]: rows start..stop-1 of tree i -> one batch view


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k], past a row's count padding that is never judged: on the device, or on the host
    # where it was found (a lookup's: run_round reads it there and copies it to the device once, no round trip)
    counts: list[int]  # real proposals per row (<= k)
    q: list[torch.Tensor | None]  # sampling rows: [k, V] distributions the drafts were drawn from; None: one-hot
    prefill_s: float = 0.0  # of the time proposing, a draft model's prefill of a new row's context (not drafting)


class Drafter(Protocol):
    # Whether a round of k drafts runs k forward passes (a draft mode's or a draft model's), or proposes on the host
    # alone (a lookup, recycled rankings), its time then the round's whatever k (the gamma policy prices it so).
    runs_steps: bool

    def history(self, tokens: list[int]) -> TokenHistory | None:
        """The per-row state a row keeps (and run_round extends with its committed tokens), if the drafter
        reads the row's text; `tokens`: the prompt and every emitted token, the pending one included."""

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal: ...


# ---------------------------------------------------------------- the self-draft: a draft mode


@dataclass(frozen=True)
class SelfDraft:
    mode: Mode
    runs_steps: ClassVar[bool] = True

    def history(self, tokens: list[int]) -> None:
        return None

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal:
        tokens, q = draft_tokens(model, cache, rows, pending, lengths, k, self.mode)
        return Proposal(tokens, [k] * len(rows), q)


def draft_tokens(model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                 k: int, mode: Mode) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run k batched draft-mode steps from each row's pending token ([B], on the device) at its length ([B, 1]);
    their KV lands in the cache past each row's length and is overwritten by the verify pass. Returns the drafts
    [B, k] on the device and (sampling rows) the probabilities [k, V] each was drawn from. When every row is
    greedy, each step's argmax feeds the next step on the device, with no host round trip between steps."""
    dev = model.device
    greedy = all(r.params.greedy for r in rows)
    probs = [[] for _ in rows]
    toks = pending
    steps = []
    for i in range(k):
        logits = model(toks[:, None], lengths + i, cache, mode)[:, -1]
        toks = logits.argmax(-1)
        if not greedy:
            picks = toks.tolist()
            for j, r in enumerate(rows):
                if not r.params.greedy:
                    probs[j].append(to_probs(logits[j], r.params))
                    picks[j] = sample(probs[j][-1], r.gen)
            toks = torch.tensor(picks, device=dev)
        steps.append(toks)
    return torch.stack(steps, 1), [torch.stack(p) if p else None for p in probs]


# ---------------------------------------------------------------- prompt lookup


class TokenHistory:
    """A row's tokens and an index of its n-grams (min_n <= n <= max_n) -> where the continuation of the most
    recent occurrence starts (and, with keep > 1, of the keep - 1 occurrences before it, for tree drafters).
    Appending a token costs max_n - min_n + 1 dictionary writes and a lookup as many reads, whatever the history's
    length. The index is brought up to date when it is read: a row whose rounds draft nothing (the gamma policy
    off, at large batches) pays a list append a token, not the index's ~3 us (1% of a batch-32 step, H100 8B)."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int, keep: int = 1):
        self.min_n, self.max_n, self.keep = min_n, max_n, keep
        self.tokens: list[int] = []
        self.indexed = 0  # tokens[:indexed] are in the index
        self.tail: tuple[int, ...] = ()  # the last max_n indexed tokens: its slices are the keys (cheaper than lists)
        self.index: dict[tuple[int, ...], int] = {}  # tuples of different lengths are different keys
        self.earlier: dict[tuple[int, ...], tuple[int, ...]] = {}  # keep > 1: earlier starts, most recent first
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def catch_up(self) -> None:
        """Index the tokens appended since the index was last read."""
        index, earlier, tail, sizes = self.index, self.earlier, self.tail, range(-self.min_n, -self.max_n - 1, -1)
        older = self.keep - 1
        for end in range(self.indexed, len(self.tokens)):  # the n-grams ending just before it are followed by it
            for n in sizes[:len(tail) - self.min_n + 1]:
                key = tail[n:]
                if older and key in index:
                    earlier[key] = (index[key],) + earlier.get(key, ())[:older - 1]
                index[key] = end
            t = self.tokens[end]
            tail = tail[1 - self.max_n:] + (t,) if self.max_n > 1 else (t,)
        self.tail, self.indexed = tail, len(self.tokens)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens continuing the longest suffix (max_n tokens down to min_n) seen earlier, from its most
        recent earlier occurrence; [] if none. A continuation that runs into the suffix keeps copying the text
        it proposes (the text repeats with that period), so a match always proposes k tokens."""
        self.catch_up()
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            start = self.index.get(tuple(toks[-n:]))
            if start is not None:
                return self.continuation(start, k)
        return []

    def continuations(self, k: int, branches: int) -> list[list[int]]:
        """Up to `branches` distinct continuations of up to k tokens: of the longest suffix's occurrences first,
        each n's most recent first (up to `keep` occurrences per n-gram); [] if nothing matches."""
        self.catch_up()
        toks, out = self.tokens, []
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            key = tuple(toks[-n:])
            start = self.index.get(key)
            for s in () if start is None else (start,) + self.earlier.get(key, ()):
                c = self.continuation(s, k)
                if c and c not in out:
                    out.append(c)
                if len(out) == branches:
                    return out
        return out

    def continuation(self, start: int, k: int) -> list[int]:
        """k tokens from `start`; past the end, the proposal's own text again (the text repeats with that period)."""
        toks, out = self.tokens, []
        for i in range(start, start + k):
            out.append(toks[i] if i < len(toks) else out[i - len(toks)])
        return out


@dataclass(frozen=True)
class NgramDrafter:
    max_n: int = DEFAULT_NGRAM[1]
    min_n: int = DEFAULT_NGRAM[0]
    runs_steps: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise SelfspecError(f"n-gram lookup needs 1 <= min_n <= max_n, got min_n {self.min_n}, max_n {self.max_n}; "
                                "write it as ngram:MIN-MAX, e.g. ngram:1-3")

    def history(self, tokens: list[int]) -> TokenHistory:
        return TokenHistory(tokens, self.min_n, self.max_n)

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal:
        return lookup_proposal([r.history.lookup(k) for r in rows], k)


def lookup_proposal(found: list[list[int]], k: int) -> Proposal:
    """Each row's looked-up tokens (0..k of them), padded to k, on the host; one-hot: no q."""
    tokens = long_tensor([t for f in found for t in f + [0] * (k - len(f))]).view(len(found), k)
    return Proposal(tokens, [len(f) for f in found], [None] * len(found))


class LookupStreak(TokenHistory):
    """A hybrid row's history, and how many of its lookups in a row found nothing."""
    misses = 0


@dataclass(frozen=True)
class HybridDrafter:
    """Lookup where it matches, the `upper` chain where it misses. A row's lookup is its proposal; a row whose lookup
    found nothing for `chain_after` rounds in a row drafts the chain, one that missed fewer times takes a plain step.
    Chaining at the first miss (chain_after 1) measured 3% faster on average than at the second (Qwen2.5-Coder-1.5B
    traces on the 8B shape, H100: docs/speculative.md). A round with no chain runs the verify pass alone.
    Otherwise k draft steps run for the whole batch (a step over several rows costs about one row's); the rows that
    do not chain draft greedily alongside, their drafts dropped, so that a sampling row draws what it draws alone
    (its solo run)."""
    mode: Mode = field(default_factory=lambda: get_mode(HYBRID_DRAFT))
    lookup: NgramDrafter = field(default_factory=NgramDrafter)
    chain_after: int = 1
    runs_steps: ClassVar[bool] = True

    def history(self, tokens: list[int]) -> LookupStreak:
        return LookupStreak(tokens, self.lookup.min_n, self.lookup.max_n)

    def propose(self, model, cache, rows: list[Row], pending: torch.Tensor, lengths: torch.Tensor,
                k: int) -> Proposal:
        found = [r.history.lookup(k) for r in rows]
        for r, f in zip(rows, found):
            r.history.misses = 0 if f else r.history.misses + 1
        chain = [r.history.misses >= self.chain_after for r in rows]
        looked = lookup_proposal(found, k)
        if not any(chain):
            return looked
        drafting = [r if c else replace(r, params=replace(r.params, temperature=0.0), gen=None)
                    for r, c in zip(rows, chain)]
        chains, q = draft_tokens(model, cache, drafting, pending, lengths, k, self.mode)
        chosen = torch.tensor(chain, device=pending.device)[:, None]
        tokens = torch.where(chosen, chains, looked.tokens.to(chains.device))
        return Proposal(tokens, [k if c else len(f) for c, f in zip(chain, found)], q)


# ---------------------------------------------------------------- trees: several branches for one sequence


class TreeDrafter:
    """Proposes up to `branches` candidate continuations of each sequence of a batch. A sequence's tree has a row
    per branch, each holding the sequence's committed KV (decode.py `tree_rounds` keeps them equal): the solo
    KVCache's rows or the engine's PagedTree, both with `rows` and `copy_positions`; the draft steps may write past
    the committed length of any row. A drafter that runs no draft step on its branch rows (`forks` False) may keep
    one row per sequence instead, its branches reading it (model.TreeLayout's tails: the solo KVCache's
    `shared_rows`, the engine's SharedTree, both with `move_positions`)."""
    branches: int
    forks = False  # its draft steps run on a cache row per branch
    runs_steps = False  # Drafter.runs_steps
    ranks = 0  # the top tokens of the verify pass's ranking at each node it wants (`observe`)

    def history(self, tokens: list[int]) -> TokenHistory | None:
        return None

    def observe(self, row: Row, inputs: list[int], ranked: list[list[int]]) -> None:
        """A verify pass ran `inputs` (a branch row's pending token and drafts) and ranked the next token after
        each: its top `ranks` tokens, best first."""

    def max_nodes(self, k: int) -> int:
        """The most distinct draft tokens a tree of at most k deep holds."""
        return self.branches * k

    def shares_row(self, batch: int) -> bool:
        """Whether a round over `batch` sequences runs each sequence's branches over its own one cache row (a drafter
        that forks no rows, in a round of up to SHARED_TREE_BATCH sequences: model.TreeLayout's tails), not forked
        into a row per branch."""
        return not self.forks and batch <= SHARED_TREE_BATCH

    def verify_tokens(self, batch: int, k: int) -> int:
        """The most tokens a round of k drafts over `batch` sequences verifies (the gamma policy prices rounds by
        it): sequences sharing their rows run their nodes and pending tokens; otherwise each sequence's branches
        run as rows of k + 1 (a plain round: one token a sequence)."""
        if k == 0:
            return batch
        if self.shares_row(batch):
            return batch * (self.max_nodes(k) + 1)
        return batch * self.branches * (k + 1)

    def propose_trees(self, model, trees: list, rows: list[Row], k: int, view: RowsView) -> list[list[list[int]]]:
        """Each sequence's branches (rows[i]'s, over trees[i]). `view` makes one batch view of rows of several trees,
        so that draft steps run every sequence at once; by default, each sequence's `propose_tree`."""
        return [self.propose_tree(model, tree, row, k) for tree, row in zip(trees, rows)]

    def propose_tree(self, model, cache, row: Row, k: int) -> list[list[int]]:
        """Distinct non-empty branches of at most k tokens, at most `branches` of them ([]: no candidate)."""
        raise NotImplementedError


@dataclass(frozen=True)
class NgramTree(TreeDrafter):
    branches: int = DEFAULT_BRANCHES
    max_n: int = DEFAULT_NGRAM[1]
    min_n: int = DEFAULT_NGRAM[0]

    def history(self, tokens: list[int]) -> TokenHistory:
        return TokenHistory(tokens, self.min_n, self.max_n, keep=self.branches)

    def propose_tree(self, model, cache, row: Row, k: int) -> list[list[int]]:
        return row.history.continuations(k, self.branches)


@dataclass(frozen=True)
class SelfDraftTree(TreeDrafter):
    mode: Mode
    branches: int = DEFAULT_BRANCHES
    forks = True
    runs_steps = True

    def propose_trees(self, model, trees: list, rows: list[Row], k: int, view: RowsView) -> list[list[list[int]]]:
        """One draft step from every sequence's pending token (its row 0), each one's top-B tokens as its branches'
        first tokens, then k - 1 greedy steps of every sequence's B branches at once (the pending token's draft KV
        copied to every branch row)."""
        dev, b, n = model.device, self.branches, len(rows)
        lengths = torch.tensor([[r.length] for r in rows], device=dev)
        pending = torch.tensor([[r.pending] for r in rows], device=dev)
        toks = model(pending, lengths, view([(0, 1)] * n), self.mode)[:, -1].topk(b).indices  # [n, B]
        for tree, row in zip(trees, rows):
            tree.copy_positions(0, row.length, row.length + 1)
        steps, branch_rows, pos = [toks], view([(0, b)] * n), lengths.repeat_interleave(b, 0)
        for i in range(1, k):
            toks = model(toks.reshape(-1, 1), pos + i, branch_rows, self.mode)[:, -1].argmax(-1).view(n, b)
            steps.append(toks)
        return torch.stack(steps, 2).tolist()


@dataclass(frozen=True)
class HybridTree(TreeDrafter):
    branches: int = DEFAULT_BRANCHES
    mode: Mode = field(default_factory=lambda: get_mode(HYBRID_DRAFT))
    ngram: NgramTree = field(default_factory=NgramTree)
    forks = True
    runs_steps = True

    def __post_init__(self) -> None:
        if self.branches < 2:
            raise SelfspecError(f"hybrid-tree drafts n-gram branches plus a self-draft chain: it needs at least 2 "
                                f"branches, got {self.branches}; write hybrid-tree:B with B >= 2")

    def history(self, tokens: list[int]) -> TokenHistory:
        return TokenHistory(tokens, self.ngram.min_n, self.ngram.max_n, keep=self.branches - 1)

    def propose_trees(self, model, trees: list, rows: list[Row], k: int, view: RowsView) -> list[list[list[int]]]:
        """The sequences the lookup matches draft their chains together (each in the first row no n-gram branch
        takes); the others' self-draft trees run together too."""
        dev, n = model.device, len(rows)
        out = [r.history.continuations(k, self.branches - 1) for r in rows]
        hits = [i for i in range(n) if out[i]]
        misses = [i for i in range(n) if not out[i]]
        if hits:
            spans = [(len(f), len(f) + 1) if f else (0, 0) for f in out]
            chains, _ = draft_tokens(model, view(spans), [rows[i] for i in hits],
                                     torch.tensor([rows[i].pending for i in hits], device=dev),
                                     torch.tensor([[rows[i].length] for i in hits], device=dev), k, self.mode)
            for i, chain in zip(hits, chains.tolist()):
                if chain not in out[i]:
                    out[i].append(chain)
        if misses:
            drafted = SelfDraftTree(self.mode, self.branches).propose_trees(
                model, [trees[i] for i in misses], [rows[i] for i in misses], k, subset(view, misses, n))
            for i, branches in zip(misses, drafted):
                out[i] = branches
        return out


class RecycledHistory(TokenHistory):
    """A row's text, indexed for lookups, and its successor table (recycling.py), which the text fills first; both
    brought up to date when read."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int, width: int):
        self._table = SuccessorTable(width)
        super().__init__(tokens, min_n, max_n)

    def catch_up(self) -> None:
        fresh = self.tokens[self.indexed:]
        if fresh:
            self._table.read(fresh, self.tokens[self.indexed - 1] if self.indexed else None)
        super().catch_up()

    @property
    def table(self) -> SuccessorTable:
        self.catch_up()  # the text read before a verify pass's ranking overrides it, as it came
        return self._table


@dataclass(frozen=True)
class RecycleTree(TreeDrafter):
    """A tree of at most `branches` tokens (so at most that many branches): the lookup's continuation where it
    matches, the rest grown from the successor table, best first. The verify pass hands back its ranking
    (`observe`). 15 tokens: with the pending token, a 16-token pass, the most a graphed pass runs."""
    branches: int = 15
    width: int = DEFAULT_WIDTH
    lookup: NgramDrafter = field(default_factory=NgramDrafter)
    base: Mapping[int, tuple[int, ...]] = field(default_factory=dict, compare=False)  # text_successors, where known
    priors: tuple[float, ...] = RANK_PRIORS  # grow's weight of each rank

    def history(self, tokens: list[int]) -> RecycledHistory:
        return RecycledHistory(tokens, self.lookup.min_n, self.lookup.max_n, self.width)

    def max_nodes(self, k: int) -> int:
        return max(self.branches, k)  # a lookup's continuation alone may be k deep

    @property
    def ranks(self) -> int:
        return self.width

    def propose_tree(self, model, cache, row: Row, k: int) -> list[list[int]]:
        found = row.history.lookup(k)
        lookups = [found] if found else []
        left = self.branches - len(lookups)
        nodes = self.branches - len(found)
        grown = grow(self.successors(row), row.pending, k, left, nodes, self.priors) if nodes > 0 else []
        return lookups + [b for b in grown if not any(f[:len(b)] == b for f in lookups)]

    def successors(self, row: Row) -> Mapping[int, tuple[int, ...]]:
        """token -> its next tokens, best first: the row's table, else the text's (`base`)."""
        return ChainMap(row.history.table.next, self.base)

    def observe(self, row: Row, inputs: list[int], ranked: list[list[int]]) -> None:
        row.history.table.observe(inputs, ranked)


def subset(view: RowsView, picked: list[int], n: int) -> RowsView:
    """`view` over the trees `picked` (ascending) of n: the others give no rows."""
    def of(spans: list[tuple[int, int]]):
        full = [(0, 0)] * n
        for i, span in zip(picked, spans):
            full[i] = span
        return view(full)
    return of


# ---------------------------------------------------------------- names


def draft_modes(name: str) -> list[str]:
    """The draft modes a --draft name runs (none for a lookup)."""
    lookup = LOOKUP_NAME.fullmatch(name)
    if lookup is not None:
        return [HYBRID_DRAFT] if lookup.group(1) == "hybrid" else []
    if name.startswith("ngram"):
        return []
    m = TREE_NAME.fullmatch(name)
    if m is None:
        return [name]
    return [HYBRID_DRAFT] if m.group(1) == "hybrid-tree" else [m.group(2)] if m.group(2) else []


def gamma_policy(drafter: Drafter | TreeDrafter | None, max_gamma: int) -> GammaPolicy:
    """The gamma policy that picks `drafter`'s drafts per round (none without a drafter), pricing a round by the
    tokens its verify pass runs (a tree's by TreeDrafter.verify_tokens, a chain's B(k + 1)) and by its draft steps:
    k, or one proposing a round for a drafter that runs none. Priced per draft, a recycled tree's 0.5 ms of host
    time read as 2.5 ms at k = 5 (bench/policy_replay.py: 1.37-1.41x its AR against 1.53x drafting k = 5 always)."""
    return GammaPolicy(max_gamma if drafter is not None else 0,
                       pass_tokens=drafter.verify_tokens if isinstance(drafter, TreeDrafter) else None,
                       draft_steps=None if drafter is None or drafter.runs_steps else lambda k: 1)


def make_drafter(name: str) -> Drafter | TreeDrafter:
    """A draft mode name -> its self-draft; 'ngram' or 'ngram:MIN-MAX' (n-gram sizes tried, longest first) ->
    prompt lookup; 'hybrid' or 'hybrid:MIN-MAX' -> that lookup, else the `upper` chain; tree names (TREE_NAMES,
    B branches, default DEFAULT_BRANCHES) -> a tree drafter. One branch is the chain drafter itself (ngram-tree:1
    is ngram, tree:MODE:1 is MODE)."""
    tree = TREE_NAME.fullmatch(name)
    if tree is not None:
        return make_tree(tree)
    m = LOOKUP_NAME.fullmatch(name)
    if m is not None:
        lookup = NgramDrafter() if m.group(2) is None else NgramDrafter(max_n=int(m.group(3)), min_n=int(m.group(2)))
        return lookup if m.group(1) == "ngram" else HybridDrafter(lookup=lookup)
    if name.startswith(("ngram", "hybrid", "tree")):
        raise SelfspecError(f"unknown drafter '{name}'; write ngram or hybrid (n-grams of {DEFAULT_NGRAM[0]} to "
                            f"{DEFAULT_NGRAM[1]} tokens looked up; hybrid drafts an upper chain where none matches), "
                            f"ngram:MIN-MAX or hybrid:MIN-MAX, e.g. ngram:2-4, or a tree: {TREE_NAMES}")
    return SelfDraft(get_mode(name))


def make_tree(m: re.Match) -> Drafter | TreeDrafter:
    kind, mode, branches = m.group(1), m.group(2), int(m.group(3) or DEFAULT_BRANCHES)
    if branches < 1:
        raise SelfspecError(f"a tree drafter needs at least 1 branch, got {branches}; write {TREE_NAMES}")
    if kind == "hybrid-tree":
        return HybridTree(branches)
    if kind == "recycle-tree":
        return RecycleTree(int(m.group(3) or RecycleTree.branches))
    if mode is not None:
        return SelfDraft(get_mode(mode)) if branches == 1 else SelfDraftTree(get_mode(mode), branches)
    return NgramDrafter() if branches == 1 else NgramTree(branches)


def as_drafter(draft: Drafter | Mode | None) -> Drafter | None:
    """A draft mode stands for its self-draft."""
    return SelfDraft(draft) if isinstance(draft, Mode) else draft
