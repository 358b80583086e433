"""bench/policy_replay.py: the gamma policy through a trace's recorded texts at given pass costs, no model."""
import pytest

from selfspec.bench.policy_replay import Costs, main, replay, seeded_policy
from selfspec.bench.traces import RecordedText, Round, ServeTreeReplay

TASKS = [[Round("tree", 6, 0, 3, 9, 2, nodes=5), Round("none", 0, 0, 1, 1, 0)],
         [Round("tree", 8, 0, 4, 12, 1, nodes=6), Round("tree", 4, 0, 2, 6, 3, nodes=3)]]
COSTS = Costs(0.004, {16: 0.005, 32: 0.007}, draft_s=0.001)


def test_recorded_text_gives_the_round_at_a_position_and_what_remains_of_its_run():
    text = RecordedText(TASKS)
    assert text.starts == [0, 3, 4, 6, 10] and text.task_starts == [0, 4]
    assert text.round_at(1).accepted == 1 and text.round_at(7).accepted == 2 and text.round_at(10 + 6).accepted == 3


def test_fixed_k_rounds_cost_and_emit_what_the_text_says():
    """Drafting k = 2 every round from task 0's start, 6 tokens: the tree round accepts 2 (3 tokens, one pass of its
    nodes + 1 and one proposing), the round that proposed nothing is a plain pass (1 token), then task 1's first round
    cut to 2 drafts accepts 1 (2 tokens) ... and plain decoding costs a step a token."""
    text = RecordedText(TASKS)
    policy = seeded_policy(COSTS, ServeTreeReplay(TASKS), 4)
    seconds, tokens, drafting = replay(policy, text, COSTS, 6, 1, fixed_k=2)
    assert tokens == 6 and drafting == 3
    assert seconds == pytest.approx(3 * COSTS.draft_s + COSTS.round_s(6) + COSTS.plain_s + COSTS.round_s(7))
    assert replay(policy, text, COSTS, 6, 2, fixed_k=0) == (pytest.approx(12 * COSTS.plain_s), 12, 0)
    # the oracle knows that task 0's second round accepts nothing: a plain step there without its proposing, the
    # rest as drafting k = 2 every round
    oracle_s, oracle_tokens, oracle_drafting = replay(policy, text, COSTS, 6, 1, oracle_k=2)
    assert (oracle_tokens, oracle_drafting) == (6, 2) and oracle_s == pytest.approx(seconds - COSTS.draft_s)
    # a drafting round's host time around its pass: paid by the two rounds that ran a pass of drafts, not by plain ones
    hosted = Costs(COSTS.plain_s, COSTS.tree_s, COSTS.draft_s, host_s=0.0003)
    assert replay(policy, text, hosted, 6, 1, fixed_k=2)[0] == pytest.approx(seconds + 2 * hosted.host_s)


@pytest.mark.parametrize("trace", ["ngram.recycle-tree", "ngram"])  # tree rounds, lookup chains
def test_the_cli_prints_the_policy_against_fixed_k(capsys, trace):
    main(["--trace", f"selfspec/bench/traces/qwen2.5-coder-1.5b.{trace}.json", "--plain-ms", "4.7",
          "--tree-ms", "16:5.8", "32:6.4", "--draft-ms", "0.5", "--tokens", "32", "--sequences", "2", "--runs", "1"])
    cells = [line.split("|")[1:3] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    speeds = {name.strip(): float(speed.strip().rstrip("x")) for name, speed in cells if speed.strip().endswith("x")}
    assert set(speeds) == {"policy", "k = 1 every round", "k = 3 every round", "k = 5 every round",
                           "k = 8 every round", "oracle: k = 5 where the round accepts a draft, else a plain step"}
    assert all(0.5 < v < 3 for v in speeds.values())
    assert speeds["oracle: k = 5 where the round accepts a draft, else a plain step"] >= speeds["k = 5 every round"]
