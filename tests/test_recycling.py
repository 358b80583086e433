"""Recycled drafts (speculative/recycling.py, RecycleTree): the successor table (text fills unknown tokens only, a
verify pass's ranking overwrites), `grow` (best first, within its node, leaf and depth budgets), the verify pass
hands every row's ranking of the positions it ran to the drafter, and RecycleTree's names. Greedy == AR and
sampling follow the verify distribution: test_trees.py and test_engine_trees.py, with the other tree drafters."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_model
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.model import prefill
from selfspec.quant.modes import prompt_mode
from selfspec.speculative.decode import decode
from selfspec.speculative.drafters import NgramDrafter, RecycleTree, TreeDrafter, make_drafter
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.recycling import DEFAULT_WIDTH, SuccessorTable, grow, text_successors
from selfspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_text_fills_only_tokens_no_pass_ranked():
    table = SuccessorTable(width=3)
    table.read([1, 2, 3, 1, 4])
    assert table.next == {1: (2,), 2: (3,), 3: (1,)}  # the first successor in the text stays
    table.observe([1, 5], [[7, 8, 9, 10], [6, 2, 1, 0]])
    assert table.next[1] == (7, 8, 9) and table.next[5] == (6, 2, 1)  # cut to the width
    table.read([1, 2, 5, 3], prev=4)
    assert table.next[1] == (7, 8, 9) and table.next[4] == (1,) and table.next[5] == (6, 2, 1)


def test_grow_takes_the_most_likely_nodes_first():
    nxt = {0: (1, 2), 1: (3, 4), 2: (5,), 3: (6,), 4: (7,), 6: (8,)}
    priors = (0.5, 0.25)
    # masses: 1 .5, 2 .25, 3 .25, 4 .125, 5 .125, 6 .125, 7 .0625, 8 .0625
    assert grow(nxt, 0, depth=4, leaves=4, nodes=1, priors=priors) == [[1]]
    assert grow(nxt, 0, depth=4, leaves=4, nodes=3, priors=priors) == [[2], [1, 3]]  # ties: the first found first
    tree = grow(nxt, 0, depth=4, leaves=4, nodes=8, priors=priors)
    assert sorted(tree) == [[1, 3, 6, 8], [1, 4, 7], [2, 5]]
    assert grow(nxt, 0, depth=2, leaves=4, nodes=8, priors=priors) == [[1, 3], [1, 4], [2, 5]]
    assert grow(nxt, 0, depth=4, leaves=1, nodes=8, priors=priors) == [[1, 3, 6, 8]]  # one leaf: the best chain
    assert grow(nxt, 9, depth=4, leaves=4, nodes=8) == []  # no successor known


@pytest.mark.parametrize("seed", range(4))
def test_grow_keeps_its_budgets_and_its_paths_exist(seed):
    rng = random.Random(seed)
    nxt = {t: tuple(rng.sample(range(30), rng.randint(1, 5))) for t in range(30)}
    depth, leaves, nodes = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 20)
    tree = grow(nxt, rng.randrange(30), depth, leaves, nodes)
    trie = {tuple(b[:i + 1]) for b in tree for i in range(len(b))}
    assert 0 < len(tree) <= leaves and len(trie) <= nodes and all(len(b) <= depth for b in tree)
    assert len(set(map(tuple, tree))) == len(tree)
    assert not any(a != b and b[:len(a)] == a for a in tree for b in tree)  # leaves only: no branch is a prefix
    for b in tree:  # each step is a known successor of the token before it
        assert all(b[i + 1] in nxt[b[i]] for i in range(len(b) - 1))


class Observer(TreeDrafter):
    """Fixed branches; records what the verify pass hands back."""
    ranks = 3

    def __init__(self, branches: list[list[int]]):
        self.fixed, self.branches, self.seen = branches, len(branches), []

    def propose_tree(self, model, cache, row, k: int) -> list[list[int]]:
        return [b[:k] for b in self.fixed]

    def observe(self, row, inputs: list[int], ranked: list[list[int]]) -> None:
        self.seen.append((inputs, ranked))


def test_the_verify_pass_hands_back_its_ranking_of_every_real_position():
    cfg, sd, _ = tiny_model("llama", seed=1)
    llm = build(cfg, sd, None, resolve_recipe("hybrid"), group_size=32)
    prompt, branches = [5, 9, 200, 17, 3], [[4, 8, 15], [16], [23, 42]]
    drafter = Observer(branches)
    rounds = decode(llm.model, prompt, llm.verify_mode, drafter, 3, SamplingParams(max_new_tokens=8, ignore_eos=True),
                    GenerationStats())
    (pending,) = next(rounds)
    next(rounds)
    assert [inputs for inputs, _ in drafter.seen] == [[pending] + b for b in branches]  # no padding
    for b, (inputs, ranked) in zip(branches, drafter.seen):  # each row's top-3 at its inputs, as a chain pass gives
        cache = llm.model.new_cache(16)
        prefill(llm.model, prompt, cache, prompt_mode(llm.verify_mode))
        logits = llm.model(torch.tensor([inputs]), len(prompt) + torch.arange(len(inputs)), cache, llm.verify_mode)[0]
        assert ranked == logits.topk(3, -1).indices.tolist()


def test_recycle_tree_names_and_its_lookup_branch():
    assert make_drafter("recycle-tree") == RecycleTree(15)
    assert make_drafter("recycle-tree:8") == RecycleTree(8)
    drafter = RecycleTree(6, lookup=NgramDrafter(2, 2))
    history = drafter.history([1, 2, 3, 4, 1, 2])
    history.table.observe([2], [[9, 3]])

    class Row:
        pending = 2
    Row.history = history
    branches = drafter.propose_tree(None, None, Row, 3)
    assert branches[0] == [3, 4, 1]  # the lookup's continuation of (1, 2) first
    assert [9] == branches[1][:1] and all(b[:1] != [3] or b == branches[0] for b in branches)


@pytest.mark.parametrize("seed", range(3))
def test_the_recycled_table_read_when_used_equals_one_kept_as_tokens_come(seed):
    """A row's table takes its text when it is read (rounds that draft nothing leave it to the next round that
    does): the same table, at every read, as one that read each token as it came, verify rankings interleaved."""
    rng = random.Random(seed)
    history, kept = RecycleTree(6).history([1, 2]), SuccessorTable(DEFAULT_WIDTH)
    kept.read([1, 2])
    for _ in range(40):
        if rng.random() < 0.6:
            tokens = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
            kept.read(tokens, history.tokens[-1])
            history.extend(tokens)
        else:
            inputs = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
            ranked = [[rng.randrange(6) for _ in range(2)] for _ in inputs]
            kept.observe(inputs, ranked)
            history.table.observe(inputs, ranked)
        if rng.random() < 0.3:
            assert history.table.next == kept.next


def test_tree_rounds_verify_their_nodes_or_a_row_per_branch():
    """What the gamma policy prices a tree round by: a lone sequence of a drafter that forks no rows runs its nodes
    and pending token in one row; several sequences, or a drafter that forks, a row of k + 1 per branch."""
    recycled, hybrid = RecycleTree(15), make_drafter("hybrid-tree:4")
    assert recycled.verify_tokens(1, 5) == 16 and recycled.verify_tokens(32, 1) == 32 * 15 * 2
    assert hybrid.verify_tokens(1, 3) == 4 * 4 and recycled.verify_tokens(8, 0) == hybrid.verify_tokens(8, 0) == 8


def test_text_successors_rank_by_count_and_seed_the_tree():
    base = text_successors([[1, 2, 1, 3, 1, 2], [1, 2, 4]], width=2)
    assert base == {1: (2, 3), 2: (1, 4), 3: (1,)}  # 1 -> 2 three times, -> 3 once

    class Row:
        pending = 2
    Row.history = RecycleTree(4).history([7, 2])  # 2 was never ranked, nor followed by anything in the text
    assert RecycleTree(4).propose_tree(None, None, Row, 3) == []
    seeded = RecycleTree(4, base=base).propose_tree(None, None, Row, 3)
    assert seeded and seeded[0][:2] == [1, 2]  # the text's most frequent successors, best first
    Row.history.table.observe([2], [[9]])  # a verify pass's ranking comes first
    assert RecycleTree(4, base=base).propose_tree(None, None, Row, 3)[0][0] == 9


def test_recycle_fit_replays_the_drafter_over_recorded_tokens():
    """bench/recycle_fit: the replay's rounds cover every AR token once (accepted + 1 each, the last round's next
    token past the recording); a text that repeats is drafted whole by the lookup; fitted priors fall with the
    rank."""
    from selfspec.bench.recycle_fit import fit_priors, replay

    period = [11, 12, 13, 14, 15]
    prompt, tokens = period * 3, period * 6
    ranked = [[tokens[i + 1], 99, 98] for i in range(len(tokens) - 1)]
    accepted = replay(RecycleTree(4), prompt, tokens, ranked, 3)
    assert len(tokens) - 1 <= sum(n + 1 for n in accepted) <= len(tokens)  # the last may commit one unrecorded
    assert accepted.count(3) >= len(accepted) - 1  # every round but the last, cut by the text's end, drafts 3
    data = {"repeat": [{"prompt": prompt, "tokens": tokens, "ranked": ranked}]}
    priors = fit_priors(data, {}, 3, 4)
    assert len(priors) == 8 and all(a >= b for a, b in zip(priors, priors[1:]))
