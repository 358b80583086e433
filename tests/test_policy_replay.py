"""bench/policy_replay.py: the gamma policy through a trace's recorded texts at given pass costs, no model."""
import pytest

from selfspec.bench import policy_replay
from selfspec.bench.policy_replay import Choice, Costs, Refill, main, replay, replay_batch, seeded_policy
from selfspec.bench.traces import RecordedText, Round, ServeTreeReplay, serve_replay
from selfspec.errors import SelfspecError

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
    seconds, tokens, drafting = replay(policy, text, COSTS, 6, 1, choice=Choice(2))
    assert tokens == 6 and drafting == 3
    assert seconds == pytest.approx(3 * COSTS.draft_s + COSTS.round_s(6) + COSTS.plain_s + COSTS.round_s(7))
    assert replay(policy, text, COSTS, 6, 2, choice=Choice(0)) == (pytest.approx(12 * COSTS.plain_s), 12, 0)
    # the oracle knows that task 0's second round accepts nothing: a plain step there without its proposing, the
    # rest as drafting k = 2 every round
    oracle_s, oracle_tokens, oracle_drafting = replay(policy, text, COSTS, 6, 1, choice=Choice(2, oracle=True))
    assert (oracle_tokens, oracle_drafting) == (6, 2) and oracle_s == pytest.approx(seconds - COSTS.draft_s)
    # a drafting round's host time around its pass: paid by the two rounds that ran a pass of drafts, not by plain ones
    hosted = Costs(COSTS.plain_s, COSTS.tree_s, COSTS.draft_s, host_s=0.0003)
    assert replay(policy, text, hosted, 6, 1, choice=Choice(2))[0] == pytest.approx(seconds + 2 * hosted.host_s)


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


CHAINS = [[Round("ngram", 3, 0, 1, 4, 2), Round("ngram", 0, 0, 1, 1, 0)], [Round("ngram", 2, 0, 1, 3, 1)]]


def test_batched_chain_rounds_verify_the_longest_proposal_and_refill_finished_rows():
    """Two rows drafting k = 3 from tasks 0 and 1 (requests read from their task's start; the prefill emits the
    first token): the first round verifies both rows' pending tokens and the longer proposal, 2 x (3 + 1) tokens,
    and emits 2 and 1 tokens; plain decoding runs the steps due as one burst (rows joining after the prefill's
    token) at the batch's step, plus the burst's host time, and a finished pair's successors are prefilled
    together."""
    text = RecordedText(CHAINS)
    costs = Costs(0.004, {1: 0.003, 2: 0.004, 8: 0.006}, draft_s=0.001, host_s=0.0005, burst_host_s=0.0002)
    assert costs.pass_s(5) == pytest.approx(0.005) and costs.pass_s(16) == 0.006 and costs.pass_s(1) == 0.003
    policy = seeded_policy(costs, serve_replay(CHAINS), 4, batch=2)
    seconds, tokens, drafting, rows = replay_batch(policy, text, costs, 3, 2, 2, choice=Choice(3))
    # round 1 ends request 0; round 2: request 1 (1 token left) alone at text position 6, which cycles to task 0's
    # start (3 drafts, 2 accepted: the row takes the 1 it needs)
    assert (tokens, drafting, rows) == (6, 2, 1.5)
    assert seconds == pytest.approx(2 * costs.draft_s + costs.pass_s(8) + costs.pass_s(4) + 2 * costs.host_s)
    prefill = Refill(prompt_s=0.01, pass_s=0.002)
    plain_s, plain_tokens, _, plain_rows = replay_batch(policy, text, costs, 3, 4, 2, prefill, choice=Choice(0))
    assert (plain_tokens, plain_rows) == (12, 2.0)
    assert plain_s == pytest.approx(4 * costs.pass_s(2) + 2 * costs.burst_host_s + 2 * (0.002 + 2 * 0.01))


def test_a_lone_successor_waits_for_company_while_others_decode():
    """Request 0 finishes a round before request 1: its successor waits (up to `wait` steps, as the engine holds a
    prompt that fills under half the prefill budget) while request 1 decodes alone; with no wait it joins at once."""
    text = RecordedText(CHAINS)
    costs = Costs(0.004, {1: 0.003, 2: 0.004, 8: 0.006})
    policy = seeded_policy(costs, serve_replay(CHAINS), 4, batch=2)
    held = replay_batch(policy, text, costs, 3, 3, 2, Refill(wait=8), choice=Choice(3))
    at_once = replay_batch(policy, text, costs, 3, 3, 2, Refill(wait=0), choice=Choice(3))
    assert held[1] == at_once[1] == 9
    assert held[3] < at_once[3]  # fewer rows a decode pass while the successor waits


def test_a_successor_waits_only_for_company_that_can_come():
    """As the engine: request 0 (accepting every draft) ends while request 1 (accepting none) has 5 tokens due; its
    successor waits for company only where the wait outlasts them (8 steps), and with a wait of 4 is prefilled at
    once, as with no wait."""
    tasks = [[Round("ngram", 3, 0, 1, 4, 3)] * 10, [Round("ngram", 3, 0, 1, 4, 0)] * 40]
    text, costs = RecordedText(tasks), Costs(0.004, {1: 0.003, 2: 0.004, 8: 0.006})
    runs = {wait: replay_batch(seeded_policy(costs, serve_replay(tasks), 4, batch=2), text, costs, 9, 3, 2,
                               Refill(wait=wait), choice=Choice(3)) for wait in (0, 4, 8)}
    assert runs[4] == runs[0] and runs[8][1] == runs[0][1] == 27
    assert runs[8][3] < runs[0][3] and runs[8][0] > runs[0][0]  # held: fewer rows a pass, more time
    # due 20 tokens each, ending at 9 (an EOS the hold cannot foresee): request 1 looks due 16, past the wait
    eos = replay_batch(seeded_policy(costs, serve_replay(tasks), 4, batch=2), text, costs, 9, 3, 2, Refill(wait=8),
                       choice=Choice(3), due=20)
    assert eos == runs[0]


def test_the_oracle_replays_one_sequence_at_a_time():
    text = RecordedText(CHAINS)
    costs = Costs(0.004, {1: 0.003, 2: 0.004, 8: 0.006})
    with pytest.raises(SelfspecError, match="oracle replays one sequence"):
        replay_batch(seeded_policy(costs, serve_replay(CHAINS), 4, batch=2), text, costs, 3, 2, 2,
                     choice=Choice(3, oracle=True))


def test_the_cli_replays_a_lookup_trace_at_a_batch_and_refuses_a_tree_trace_there(capsys):
    main(["--trace", "selfspec/bench/traces/qwen2.5-coder-1.5b.quasar.json", "--batch", "8", "--plain-ms", "3.7",
          "--tree-ms", "1:3.6", "16:3.9", "40:4.8", "72:6.2", "--draft-ms", "0.2", "--host-ms", "0.5",
          "--burst-host-ms", "1", "--tokens", "16", "--runs", "1"])
    out = capsys.readouterr().out
    assert "32 requests x 16 tokens a run at batch 8" in out and "oracle" not in out
    speeds = [float(line.split("|")[2].strip().rstrip("x")) for line in out.splitlines() if line.startswith("| k = ")]
    assert len(speeds) == 4 and all(0.5 < v < 2 for v in speeds)
    with pytest.raises(SelfspecError, match="tree trace replays at batch 1"):
        main(["--trace", "selfspec/bench/traces/qwen2.5-coder-1.5b.ngram.recycle-tree.json", "--batch", "4",
              "--plain-ms", "4", "--tree-ms", "16:5"])
    with pytest.raises(SelfspecError, match="at least the longest request"):
        main(["--trace", "selfspec/bench/traces/qwen2.5-coder-1.5b.quasar.json", "--batch", "4", "--plain-ms", "4",
              "--tree-ms", "16:5", "--tokens-spread", "0.5", "--tokens-due", "150"])
    with pytest.raises(SelfspecError, match="own lengths at --batch B > 1"):
        main(["--trace", "selfspec/bench/traces/qwen2.5-coder-1.5b.quasar.json", "--plain-ms", "4", "--tree-ms", "16:5",
              "--tokens-spread", "0.5"])


def test_the_policys_rows_in_step_draft_nothing_at_eight_rows(monkeypatch):
    """The engine's rule in the replay (`in_step`): eight requests of one length started together draft no round
    where the policy would draft (a forced k still drafts); of their own lengths they draft."""
    text = RecordedText(CHAINS)
    costs = Costs(0.004, {1: 0.003, 8: 0.0041, 32: 0.0045}, draft_s=0.0001)

    def drafting(choice: Choice, lengths: list[int] | None) -> int:
        policy = seeded_policy(costs, serve_replay(CHAINS), 4, batch=8)
        return replay_batch(policy, text, costs, 6, 8, 8, choice=choice, lengths=lengths)[2]

    assert drafting(Choice(), None) == 0 and drafting(Choice(3), None) > 0
    assert drafting(Choice(), [3, 4, 5, 6, 7, 8, 9, 10]) > 0
    monkeypatch.setattr(policy_replay, "in_step", lambda dues: False)
    assert drafting(Choice(), None) > 0  # without the rule the policy drafts these rows


def test_requests_of_their_own_lengths_leave_rows_out_of_step_in_plain_decoding():
    """bench serve's --max-new-tokens-spread in the replay: four requests of one length keep both rows of plain
    decoding full to the end; of their own lengths (the same tokens in all) they do not."""
    text = RecordedText(CHAINS)
    costs = Costs(0.004, {1: 0.003, 2: 0.004, 8: 0.006})
    runs = [replay_batch(seeded_policy(costs, serve_replay(CHAINS), 4, batch=2), text, costs, 4, 4, 2,
                         choice=Choice(0), lengths=lengths) for lengths in (None, [2, 6, 3, 5])]
    assert [r[1] for r in runs] == [16, 16]
    assert runs[0][3] == 2.0 and runs[1][3] < 2.0
