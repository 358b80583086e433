"""Token trees (forked chains): greedy output of every tree drafter == AR of the verify mode (tiny model, several
branch counts and gammas; SmolLM2 on a few prompts), the branch rows' committed KV == the AR cache's bit for bit,
n-gram tree proposals (distinct continuations, == a brute-force rescan), names, recipe hybrid, sampling with trees
follows the verify distribution. The serving engine's trees: test_engine_trees.py."""
from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import RecordedPasses, tiny_model
from selfspec.engine.llm import build
from selfspec.engine.stats import GenerationStats
from selfspec.errors import SelfspecError
from selfspec.model import TreeLayout, prefill
from selfspec.quant.modes import get_mode, prompt_mode
from selfspec.speculative.decode import decode
from selfspec.speculative.drafters import (HybridDrafter, HybridTree, NgramDrafter, NgramTree, SelfDraft, SelfDraftTree,
                                           TokenHistory, TreeDrafter, make_drafter)
from selfspec.speculative.recipes import resolve_recipe
from selfspec.speculative.sampling import SamplingParams
from test_speculative import SAMPLING, VOCAB, check_against_verify, draw, next_probs

pytestmark = pytest.mark.usefixtures("one_thread")

REPETITIVE = [[5, 9, 200, 17, 3, 5, 9, 200, 17, 3, 5, 9], [40, 41, 42, 43, 40, 41, 50, 40, 41, 42, 60, 40, 41],
              [7] * 6, [11, 250, 3, 99, 64]]


@pytest.fixture(scope="module")
def llm():
    cfg, sd, _ = tiny_model("llama", seed=1)
    return build(cfg, sd, None, resolve_recipe("hybrid"), group_size=32)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run(model, prompt, verify, drafter, gamma, n, cache=None) -> tuple[list[int], GenerationStats]:
    """Decode until n tokens are emitted (the last round may emit past n)."""
    stats, out = GenerationStats(), []
    for chunk in decode(model, prompt, verify, drafter, gamma, greedy(n), stats, cache):
        out += chunk
        if len(out) >= n:
            break
    return out, stats


# ---------------------------------------------------------------- greedy trees == AR


@pytest.mark.parametrize("name", ["ngram-tree:2", "ngram-tree:4", "tree:upper:2", "tree:upper:4", "hybrid-tree:2",
                                  "hybrid-tree:3", "recycle-tree:6"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_tree_equals_ar(llm, name, gamma):
    drafter, verify = make_drafter(name), llm.verify_mode
    accepted = proposed = 0
    model = RecordedPasses(llm.model)
    for p in REPETITIVE:
        ref, _ = run(llm.model, p, verify, None, 0, 30)
        out, stats = run(model, p, verify, drafter, gamma, 30)
        assert out[:30] == ref[:30], (name, gamma, p)
        accepted, proposed = accepted + stats.draft_accepted, proposed + stats.draft_proposed
    assert 0 < accepted  # drafts were accepted: the branches' tokens were emitted, not only the verify's
    if gamma > 1:  # (one-token continuations of these random texts mostly coincide)
        assert max(rows for rows, _ in model.shapes) > 1  # several branches were verified in one pass


def test_a_recycled_tree_smaller_than_its_lookup_stays_lossless(llm):
    """recycle-tree:2 at gamma 5: a matched lookup proposes 5 tokens, more nodes than the tree's budget; its nodes
    still fit past the committed length (max_nodes), and the tokens are AR's."""
    drafter, verify = make_drafter("recycle-tree:2"), llm.verify_mode
    assert drafter.max_nodes(5) == 5
    for p in REPETITIVE[:2]:
        out, stats = run(llm.model, p, verify, drafter, 5, 24)
        assert out[:24] == run(llm.model, p, verify, None, 0, 24)[0][:24]
        assert stats.draft_accepted > 2


class FixedBranches(TreeDrafter):
    """Proposes the given branches (cut to k) every round."""

    def __init__(self, branches: list[list[int]]):
        self.fixed, self.branches = branches, len(branches)

    def propose_tree(self, model, cache, row, k: int) -> list[list[int]]:
        return [b[:k] for b in self.fixed]


def test_the_longest_accepted_branch_wins(llm):
    prompt, verify = REPETITIVE[3], llm.verify_mode
    ref, _ = run(llm.model, prompt, verify, None, 0, 8)
    wrong = lambda t: (t + 1) % llm.model.cfg.vocab_size  # noqa: E731
    branches = [[wrong(ref[1])] + ref[2:4], ref[1:3] + [wrong(ref[3])], ref[1:4], [ref[1], wrong(ref[2]), ref[3]]]
    stats = GenerationStats()
    rounds = decode(llm.model, prompt, verify, FixedBranches(branches), 3, greedy(8), stats)
    assert next(rounds) == ref[:1]  # the prefill's token
    assert next(rounds) == ref[1:5]  # branch 2's three drafts and the verify's next token
    assert stats.draft_accepted == 3


def test_branch_rows_hold_the_ar_cache_bitwise(llm):
    """After several tree rounds, every branch row's KV of the committed positions equals the KV that AR decoding
    of the same tokens wrote: the winner's is the verify pass's, the others were copied from it. Drafters whose
    branch rows share the sequence's row (no forks): that row, its accepted drafts moved from their tails."""
    prompt, verify = REPETITIVE[0], llm.verify_mode
    for name in ("ngram-tree:3", "tree:upper:3", "hybrid-tree:3", "recycle-tree:6"):
        drafter = make_drafter(name)
        tree_cache = llm.model.new_cache(64, drafter.branches)
        out, stats = run(llm.model, prompt, verify, drafter, 4, 20, tree_cache)
        assert stats.draft_accepted > 0
        ar_cache = llm.model.new_cache(64)
        ref, _ = run(llm.model, prompt, verify, None, 0, len(out), ar_cache)
        assert ref == out and ar_cache.length == tree_cache.length
        n = tree_cache.length
        for b in range(drafter.branches if drafter.forks else 1):
            assert torch.equal(tree_cache.k[:, b, :, :n], ar_cache.k[:, 0, :, :n]), (name, b)
            assert torch.equal(tree_cache.v[:, b, :, :n], ar_cache.v[:, 0, :, :n]), (name, b)


def test_copy_positions_copies_one_row_to_the_others_exactly(llm):
    cache = llm.model.new_cache(32, 3)
    cache.k.normal_(), cache.v.normal_()
    before = cache.k.clone()
    cache.copy_positions(1, 4, 9)
    for b in (0, 2):
        assert torch.equal(cache.k[:, b, :, 4:9], before[:, 1, :, 4:9])
        assert torch.equal(cache.k[:, b, :, :4], before[:, b, :, :4])  # other positions untouched
        assert torch.equal(cache.k[:, b, :, 9:], before[:, b, :, 9:])
        assert torch.equal(cache.v[:, b, :, 4:9], cache.v[:, 1, :, 4:9])
    assert torch.equal(cache.k[:, 1], before[:, 1])
    assert cache.rows(1, 3) is cache.rows(1, 3)  # one view per range (CUDA graphs are bound to it)


# ---------------------------------------------------------------- n-gram tree proposals


def brute_force_continuations(tokens: list[int], k: int, branches: int, keep: int, min_n: int,
                              max_n: int) -> list[list[int]]:
    """By rescanning: for n = max_n .. min_n, the keep most recent earlier occurrences of the last n tokens, most
    recent first, each proposing its continuation (periodic past the end); distinct ones, up to `branches`."""
    out = []
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        starts = [s + n for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]][::-1][:keep]
        for start in starts:
            text = list(tokens)
            while len(text) < start + k:
                text.append(text[len(text) - (len(tokens) - start)])
            c = text[start:start + k]
            if c and c not in out:
                out.append(c)
            if len(out) == branches:
                return out
    return out


@pytest.mark.parametrize("seed", range(6))
def test_ngram_tree_continuations_equal_a_rescan(seed):
    rng = random.Random(seed)
    vocab, min_n, max_n, keep = rng.choice([3, 5, 8]), rng.randint(1, 2), rng.randint(2, 4), rng.randint(1, 4)
    h = TokenHistory([rng.randrange(vocab) for _ in range(rng.randint(0, 6))], min_n, max_n, keep)
    several = 0
    for _ in range(60):
        h.extend([rng.randrange(vocab) for _ in range(rng.randint(1, 4))])
        k, branches = rng.randint(1, 6), rng.randint(1, 5)
        found = h.continuations(k, branches)
        assert found == brute_force_continuations(h.tokens, k, branches, keep, min_n, max_n), (h.tokens, k)
        assert len({tuple(c) for c in found}) == len(found) <= branches  # distinct
        assert found[:1] == ([h.lookup(k)] if h.lookup(k) else [])  # the first is the chain lookup's
        several += len(found) > 1
    assert several > 0 or keep == 1


def test_ngram_tree_proposes_distinct_continuations_longest_n_first():
    # Suffix [1, 2]: the 2-gram occurs twice (-> 30, then 20); the 1-gram [2] also once more (-> 40).
    h = TokenHistory([1, 2, 20, 21, 2, 40, 1, 2, 30, 31, 1, 2], 1, 2, keep=4)
    assert h.continuations(2, 4) == [[30, 31], [20, 21], [40, 1]]
    assert h.continuations(2, 2) == [[30, 31], [20, 21]]
    assert TokenHistory([1, 2, 9, 1, 2, 9, 1, 2], 1, 2, keep=4).continuations(1, 4) == [[9]]  # deduplicated


# ---------------------------------------------------------------- names, recipe, refusals


def test_tree_names():
    upper = get_mode("upper")
    assert make_drafter("ngram-tree") == NgramTree(4)
    assert make_drafter("ngram-tree:2") == NgramTree(2)
    assert make_drafter("tree:upper:3") == SelfDraftTree(upper, 3)
    assert make_drafter("tree:w4a16") == SelfDraftTree(get_mode("w4a16"), 4)
    assert make_drafter("hybrid-tree:3") == HybridTree(3)
    assert make_drafter("ngram-tree:1") == NgramDrafter()  # one branch: the chain drafter (sampling works)
    assert make_drafter("tree:upper:1") == SelfDraft(upper)  # malformed names: test_drafters.py


def test_hybrid_recipe():
    r = resolve_recipe("hybrid")
    assert (r.storage, r.verify, r.draft) == ("planes", "full", "hybrid")
    r = resolve_recipe("recycle")
    assert (r.storage, r.verify, r.draft) == ("planes", "full", "recycle-tree")
    assert resolve_recipe("planes", draft="tree:upper:2").storage == "planes"
    assert resolve_recipe("qspec", draft="tree:w4a4").storage == "int4"
    with pytest.raises(SelfspecError, match="no stored weight format"):
        resolve_recipe("hybrid", verify="w4a16", draft="tree:bf16")
    with pytest.raises(SelfspecError, match="not one"):
        resolve_recipe("layerskip", draft="hybrid")


def test_hybrid_recipe_generates_ar_output(llm):
    assert isinstance(llm.drafter, HybridDrafter)
    for p in REPETITIVE[:2]:
        out = llm.generate(p, greedy(12), gamma=4)  # fixed: the CPU-measured policy may not draft at all
        assert out.token_ids == llm.generate(p, greedy(12), gamma=0).token_ids
        assert out.stats.draft_accepted > 0


# ---------------------------------------------------------------- sampling: multi-candidate rejection sampling

# Every token a is followed by a + 1, a + 3 and a + 5 (mod 16) in the prompt: the n-gram tree proposes three
# candidates for token 1 whatever token 0 is.
SAMPLING_PROMPT = list(range(VOCAB)) + [(3 * i + 1) % VOCAB for i in range(VOCAB)] + [(5 * i + 2) % VOCAB
                                                                                      for i in range(VOCAB)]


@pytest.fixture(scope="module")
def sampling_model():
    """A one-layer model over 16 tokens (planes storage: `upper` drafts for hybrid) and the exact verify
    probabilities of tokens 0, 1 and 2."""
    cfg, sd, _ = tiny_model("llama", seed=9, vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=1)
    llm = build(cfg, sd, None, resolve_recipe("hybrid"), group_size=32)
    prompt, params, m = SAMPLING_PROMPT, SamplingParams(**SAMPLING), llm.model
    p0 = next_probs(m, [prompt], llm.verify_mode, params)[tuple(prompt)]
    p1 = next_probs(m, [prompt + [a] for a in range(VOCAB)], llm.verify_mode, params)
    p2 = next_probs(m, [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], llm.verify_mode, params)
    return llm, p0, p1, p2


def first_candidates(llm, name: str, prefix: list[int]) -> set[int]:
    """The distinct first tokens a tree drafter proposes after `prefix` (prompt + token 0)."""
    if name.startswith("ngram"):
        return {c[0] for c in llm.drafter.history(prefix).continuations(2, llm.drafter.branches)}
    logits = llm.model(torch.tensor([prefix]), torch.arange(len(prefix)), llm.model.new_cache(len(prefix)),
                       llm.drafter.mode)[0, -1]
    return set(logits.topk(llm.drafter.branches).indices.tolist())  # the draft mode's top B


@pytest.mark.parametrize("name", ["ngram-tree:3", "tree:upper:3", "hybrid-tree:3", "recycle-tree:6"])
def test_tree_sampling_matches_verify_distribution(sampling_model, name):
    """Temperature 1, 1000 seeds: tokens 0, 1 and 2 follow the verify distribution (chi-square), and token 1 is an
    accepted candidate with probability sum p(c) over the candidates (not 1 - prod(1 - p(c)), as it would be had
    rejected candidates not been taken out of p: the self-draft tree's candidates hold most of p, so this tells
    the two apart)."""
    llm, p0, p1, p2 = sampling_model
    llm.drafter = make_drafter(name)
    n, prompt = 1000, SAMPLING_PROMPT
    rows = draw(llm, prompt, n, gamma=2)
    check_against_verify(rows, prompt, p0, p1, p2)
    t0, acc = rows[:, 0].tolist(), rows[:, 3].bool()
    assert 0.1 * n < int(acc.sum()) < 0.95 * n
    if name.startswith(("hybrid", "recycle")):  # candidates known only in the run (sampled, or ranked by it)
        return
    firsts = {a: first_candidates(llm, name, prompt + [a]) for a in range(VOCAB)}
    assert all(len(f) == 3 for f in firsts.values())
    p_tree = torch.tensor([sum(float(p1[tuple(prompt + [a])][c]) for c in firsts[a]) for a in t0])
    assert abs(int(acc.sum()) - p_tree.sum()) < 4 * math.sqrt((p_tree * (1 - p_tree)).sum()) + 1


# ---------------------------------------------------------------- SmolLM2


# Text the model goes on repeating, so the lookup's trees are accepted (counting: SmolLM2 continues the list).
SMOLLM2_PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
                   "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]


@pytest.mark.parametrize("name", ["ngram-tree:3", "hybrid-tree:3"])
def test_greedy_tree_equals_ar_on_smollm2(smollm2, name):
    llm = smollm2("hybrid")
    llm.drafter = make_drafter(name)
    p = greedy(16)
    accepted = 0
    for prompt in SMOLLM2_PROMPTS:
        out = llm.generate(prompt, p, gamma=4)
        assert out.token_ids == llm.generate(prompt, p, gamma=0).token_ids, (name, prompt)
        accepted += out.stats.draft_accepted
    assert accepted > 0


def test_trees_refuse_a_quantized_kv_cache(llm):
    llm.model.set_kv_format("int8", 16)
    try:
        with pytest.raises(SelfspecError, match="quantized KV cache"):
            next(decode(llm.model, [5, 6, 7], llm.verify_mode, NgramTree(branches=2), 3, greedy(4),
                        GenerationStats()))
    finally:
        llm.model.set_kv_format("bf16")


def test_bench_trees_compares_drafters_against_ar(capsys):
    """`selfspec bench trees` on SmolLM2: a row per drafter, each run checked token for token against AR."""
    from selfspec.bench import trees

    trees.main(["--prompts", "1", "--new-tokens", "6", "--gamma", "2", "--drafts", "ngram-tree:2", "upper"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ngram-tree:2 |")
            or line.startswith("| upper |")]
    assert len(rows) == 2 and all(r[5] == "yes" for r in rows)
    assert float(rows[1][3]) > 1  # the upper chain emits more than one token per verify pass here


def test_a_tree_pass_gives_each_branch_its_chain_logits_bitwise(llm):
    """model.TreeLayout: the shared nodes run once, yet each branch row gets the logits a pass of its chain alone
    gives, bit for bit, and the same KV in its cache row."""
    model, verify, prompt = llm.model, llm.verify_mode, REPETITIVE[1]
    branches = [[7, 8, 9], [7, 8], [7, 30, 31], [40]]
    caches = []
    for _ in range(2):
        cache = model.new_cache(32, len(branches))
        prefill(model, prompt, cache.rows(0, 1), prompt_mode(verify))
        cache.copy_positions(0, 0, len(prompt))
        caches.append(cache)
    layout, nodes, pos = TreeLayout.of([(5, len(prompt), branches)])
    assert len(nodes) == 1 + 6  # the pending token and 7, 8, 9, 30, 31, 40
    tree = model(nodes[None], pos[None], caches[0], verify, tree=layout)[0][layout.rows]
    chains = torch.tensor([[5] + b + [0] * (3 - len(b)) for b in branches])
    forked = model(chains, len(prompt) + torch.arange(4), caches[1], verify)
    for b, branch in enumerate(branches):
        n = len(branch) + 1
        assert torch.equal(tree[b, :n], forked[b, :n]), b
        end = len(prompt) + n
        assert torch.equal(caches[0].k[:, b, :, :end], caches[1].k[:, b, :, :end]), b


def test_branches_sharing_one_row_get_their_chain_logits_and_kv_bitwise(llm):
    """TreeLayout.of(shared=True): every branch row reads the sequence's one cache row, its own nodes from their
    tails (each node stored once, in node order from the pending token's position); logits are each chain's alone,
    bit for bit, and after a branch's drafts are moved to their positions the row holds that chain's KV."""
    model, verify, prompt = llm.model, llm.verify_mode, REPETITIVE[1]
    branches = [[7, 8, 9], [7, 30, 31], [40], [7, 8]]
    shared = model.new_cache(32)
    forked = model.new_cache(32, len(branches))
    prefill(model, prompt, shared, prompt_mode(verify))
    prefill(model, prompt, forked.rows(0, 1), prompt_mode(verify))
    forked.copy_positions(0, 0, len(prompt))
    layout, nodes, pos = TreeLayout.of([(5, len(prompt), branches)], shared=True)
    assert layout.tails.tolist()[1] == [len(prompt) + i for i in (0, 1, 4, 5)]  # root, 7, then 30, 31
    tree = model(nodes[None], pos[None], shared.shared_rows(0, len(branches)), verify, tree=layout)[0][layout.rows]
    chains = torch.tensor([[5] + b + [0] * (3 - len(b)) for b in branches])
    alone = model(chains, len(prompt) + torch.arange(4), forked, verify)
    for b, branch in enumerate(branches):
        assert torch.equal(tree[b, :len(branch) + 1], alone[b, :len(branch) + 1]), b
    before = shared.k.clone()
    path = layout.host_rows[1]  # branch 1 accepted whole
    end = len(prompt) + 4
    shared.move_positions(0, [len(prompt) + i for i in path[1:]], list(range(len(prompt) + 1, end)))
    assert torch.equal(shared.k[:, 0, :, :end], forked.k[:, 1, :, :end])
    assert torch.equal(shared.v[:, 0, :, :end], forked.v[:, 1, :, :end])
    assert torch.equal(shared.k[:, 0, :, end:], before[:, 0, :, end:])  # the rest untouched
    assert shared.shared_rows(0, 4) is shared.shared_rows(0, 4)  # one view (CUDA graphs are bound to it)


def test_move_positions_copies_runs_exactly_even_overlapping(llm):
    """KVCache.move_positions: each dst position gets src's KV as it was before the move (runs of consecutive
    positions are copied as slices, overlapping ones included); other positions and rows untouched."""
    cache = llm.model.new_cache(32, 2)
    cache.k.normal_(), cache.v.normal_()
    k, v = cache.k.clone(), cache.v.clone()
    src, dst = [10, 12, 13, 14, 20], [9, 10, 11, 12, 13]
    cache.move_positions(1, src, dst)
    want_k, want_v = k.clone(), v.clone()
    want_k[:, 1, :, dst], want_v[:, 1, :, dst] = k[:, 1, :, src], v[:, 1, :, src]
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
