"""Gamma policy: how many tokens to draft this round, from measured acceptance and measured step costs.

With per-token acceptance a and k drafts a round emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per row and costs
k * draft(B) + verify(B * (k+1) tokens) (a drafter that runs no draft step, a lookup or a recycled tree, pays its
proposing once a round whatever k: `draft_steps`); plain decoding (k = 0) emits 1 token for verify(B). The policy picks
the k in 0..max_gamma with the most tokens per second, and 0 unless speculation beats plain decoding by
`margin`, so speculative serving is never slower than plain decoding of the verify mode at any batch size. The margin
is to start drafting: once the policy drafts by its own choice, it goes on while drafting is estimated to win at all
(hysteresis). Acceptance comes in bursts, and an estimate from recent rounds dips below the margin inside a stretch
where drafting pays; stopping there loses the bursts that follow until a probe (the policy replay, recycle / ngram /
quasar traces at batch 1 with 0.3 ms of a round's host time the warm-up does not see: 1.41-1.50x / 1.22x / 1.25x
with the margin always, 1.52-1.53x / 1.30-1.31x / 1.32x with it to start only, against 1.56x / 1.31x / 1.33x for
k = 5 every round).

Acceptance is learned from recent rounds' counts with a prior (`acceptance`), costs as the engine runs
(exponential moving averages):
- verify cost by tokens in the pass, interpolated between measured sizes, extrapolated linearly: B(k + 1) for a
  chain, what `pass_tokens` says for a tree (its branches forked into rows of k + 1: B x branches x (k + 1));
- draft cost as a ratio to the verify cost of a pass of the same size (B tokens), per batch size
  (the nearest measured batch size stands in for an unmeasured one).
Exploration: an unmeasured batch size first runs plain decoding once (measures verify(B)); while no draft
step was ever measured, it then drafts 1 token once (measures the draft ratio and acceptance), unless drafting
would lose even if every draft were accepted, by the costs known (the serving engine's warm-up times the passes it
captures: `observe_round`, `observe_draft_step`), e.g. a tree forked into a row per branch at batch 32: then the
first drafting round is a probe, which waits as long as its loss requires (below).

Probes keep the estimates fresh (a first measurement may be a slow outlier or an unlucky sample, and the losing
option is otherwise never re-timed). A probe of the losing option is a lost round, so probing is cost-bounded (a
plain round the engine runs as several steps back to back counts each step as a round: `observe_round`):
- while speculating, a plain round re-times verify(B) every `probe_every` rounds, each probe that leaves the choice
  as it was doubling the interval, up to `max_probe_every` (128 rounds: once backed off, under 0.8% of rounds);
- while decoding plainly, a drafting round re-times the draft step and acceptance every max(probe_every,
  L / `probe_budget`) rounds, L its estimated loss against plain decoding of the same tokens, in plain rounds
  (before drafting was measured: at every draft accepted). So drafting probes lose at most 1% of the time however
  dear (a tree forked into B x branches rows at a large batch can lose several steps a probe), and come every
  probe_every rounds where they cost little (a lone sequence's tree of 16 nodes: a few % of a step), so that one
  unlucky exploration round does not keep a cheap drafter off for hundreds of rounds;
- the interval restarts at its base when the choice changes (a probe, or drift seen by the rounds themselves,
  flipped it) or when the batch size moves by more than a quarter from where the schedule started (the costs
  there are another question);
- a drafting probe runs the k estimated to lose the least time against plain decoding of the same tokens,
  k * draft(B) + verify(B * (k+1)) - E(k) * verify(B), not the k of the best throughput. Each extra draft
  costs a draft step and a wider verify and adds a^k tokens, so when speculation loses by a wide margin (drafts
  as dear as verify steps, as on the H100) that is k = 1, the cheapest round that still measures the draft step
  and acceptance; when speculation nearly pays it is near the best k, whose verify width the choice hinges on.

`measuring` says whether the last choice drafts only to measure, not because speculation pays: an exploration
round, a drafting probe, or any drafting round while fewer than `min_trials` acceptance trials were seen (one
exploration round whose rows all accepted estimates acceptance near 1, and speculation chosen on that is a guess). The
serving engine then has its greedy rows in step (due as many tokens as another) emit the plain decoding step's one
token (engine/engine.py `_lockstep`): drafts accepted there would move some rows ahead of the others, and requests
started together would stop finishing (and being replaced) together; a row out of step already commits what it
accepts.
"""
from __future__ import annotations

import bisect
import math
from itertools import accumulate
from typing import Callable

PROBE_BUDGET = 0.01  # the most of plain decoding's time drafting probes may lose


class Ema:
    """Exponential moving average; the first observation is taken as is."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round emits per row with k drafts at per-token acceptance a: 1 + a + ... + a^k."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def chain_tokens(batch: int, k: int) -> int:
    """A chain round's verify pass: each row's pending token and its k drafts."""
    return batch * (k + 1)


class GammaPolicy:
    def __init__(self, max_gamma: int = 8, alpha: float = 0.2, margin: float = 0.05, probe_every: int = 16,
                 max_probe_every: int = 128, min_trials: int = 32,
                 pass_tokens: Callable[[int, int], int] | None = None, probe_budget: float = PROBE_BUDGET,
                 draft_steps: Callable[[int], int] | None = None):
        """pass_tokens(B, k): the tokens a round of k drafts over B rows verifies (default B(k + 1), a chain's);
        draft_steps(k): the draft steps such a round pays (default k; a drafter proposing on the host alone: 1, its
        proposing time once a round)."""
        self.max_gamma = max_gamma
        self.draft_steps = draft_steps or (lambda k: k)
        self.probe_budget = probe_budget
        self.pass_tokens = pass_tokens or chain_tokens
        self.alpha = alpha
        self.margin = margin
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.min_trials = min_trials
        self.num_trials = 0  # acceptance trials seen, all rounds together
        self.successes = 0.0  # accepted drafts, a round's weight decaying by 1 - alpha a round ...
        self.tries = 0.0  # ... and acceptance trials (accepted + 1 where a draft was rejected)
        self.verify_cost: dict[int, Ema] = {}  # tokens in the pass -> seconds
        self.verify_sizes: list[int] = []  # its keys, sorted (a choice reads them max_gamma + 1 times)
        self._floors: list[float] | None = None  # the dearest cost among verify_sizes[:i + 1]; None: out of date
        self.draft_ratio: dict[int, Ema] = {}  # batch size -> draft step seconds / verify(B tokens) seconds
        self.last_gamma = 0
        self.measuring = False  # the last choice drafts only to measure (module docstring)
        # the probe schedule: the choice it follows, the batch size it started at, rounds since it last probed
        self.speculating: bool | None = None
        self.schedule_batch = 0
        self.since_probe = 0
        self.probe_interval = probe_every

    # ---------------------------------------------------------------- observations

    def observe_round(self, batch: int, k: int, draft_s: float, verify_s: float, steps: int = 1) -> None:
        """A round of k drafts over `batch` rows took draft_s (all k steps) and verify_s (a step's, where a plain
        round ran `steps` steps back to back: the engine's bursts, each step a round of the probe schedule)."""
        self.since_probe += steps - 1
        tokens = self.pass_tokens(batch, k)
        if tokens not in self.verify_cost:
            self.verify_cost[tokens] = Ema(self.alpha)
            bisect.insort(self.verify_sizes, tokens)
        self.verify_cost[tokens].update(verify_s)
        self._floors = None
        base = self.verify_estimate(batch)
        if k and base:
            self.draft_ratio.setdefault(batch, Ema(self.alpha)).update(draft_s / self.draft_steps(k) / base)

    def observe_draft_step(self, batch: int, seconds: float) -> None:
        """A draft step over `batch` rows took `seconds` (the engine's warm-up times its graphs): its ratio to
        verify(batch), where that is measured."""
        base = self.verify_estimate(batch)
        if base:
            self.draft_ratio.setdefault(batch, Ema(self.alpha)).update(seconds / base)

    def observe_acceptance(self, k: int, accepted: list[int]) -> None:
        """Per-row accepted counts of a round with k drafts. A row accepting n < k drafts saw n successes in
        n + 1 trials, one accepting all k saw k in k (the geometric model's likelihood)."""
        if k and accepted:
            trials = sum(n + (n < k) for n in accepted)
            keep = 1 - self.alpha
            self.successes = keep * self.successes + sum(accepted)
            self.tries = keep * self.tries + trials
            self.num_trials += trials

    @property
    def acceptance(self) -> float | None:
        """Per-draft acceptance over recent rounds, with one success and one failure of prior (Laplace's rule):
        a first round that accepted nothing is not taken for certain. Acceptance comes in bursts (a lookup or a
        recycled tree matches a stretch of text, then nothing), and a drafting probe is rare while decoding plainly:
        taken as is, one probe that met no burst estimated 0, and with it every later probe ran the least
        informative k = 1 (`_probe`) and kept drafting off where it pays (a tree at batch 1: 1.2 to 2.4x)."""
        if not self.num_trials:
            return None
        return (self.successes + 1) / (self.tries + 2)

    # ---------------------------------------------------------------- estimates

    def verify_estimate(self, tokens: int) -> float | None:
        """Seconds of a verify pass over `tokens` tokens: measured, interpolated, or extrapolated linearly
        from the two largest (smallest) measured sizes; one measured size stands for all. An estimate never falls
        below the dearest pass measured over fewer tokens (nor below 0): noisy timings, a larger pass measured
        cheaper than a smaller one, would otherwise price the passes past them at nearly nothing."""
        sizes = self.verify_sizes
        if not sizes:
            return None
        if self._floors is None:  # a prefix maximum once per observation, not a scan per estimate
            self._floors = list(accumulate((self.verify_cost[n].value for n in sizes), max))
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return self._floors[i]  # a measured size too: the warm-up's pass, timed once over a short context
        if len(sizes) == 1:
            return self.verify_cost[sizes[0]].value
        n0, n1 = sizes[min(max(i - 1, 0), len(sizes) - 2):][:2]
        c0, c1 = self.verify_cost[n0].value, self.verify_cost[n1].value
        floor = self._floors[i - 1] if i else 0.0
        return max(c0 + (c1 - c0) * (tokens - n0) / (n1 - n0), floor)

    def draft_estimate(self, batch: int) -> float | None:
        if not self.draft_ratio:
            return None
        nearest = min(self.draft_ratio, key=lambda b: (abs(b - batch), b))
        base = self.verify_estimate(batch)
        return None if base is None else self.draft_ratio[nearest].value * base

    def round_cost(self, batch: int, k: int, draft: float | None = None) -> float:
        """Estimated seconds of a round with k drafts over `batch` rows (requires measurements); `draft`: the
        draft step's estimate, where the caller has it."""
        if not k:
            return self.verify_estimate(batch)
        return self.draft_steps(k) * (self.draft_estimate(batch) if draft is None else draft) + self.verify_estimate(
            self.pass_tokens(batch, k))

    def throughput(self, batch: int, k: int, draft: float | None = None) -> float:
        """Estimated tokens per second per row of a round with k drafts (requires measurements)."""
        tokens = expected_tokens(self.acceptance, k) if k else 1.0
        return tokens / self.round_cost(batch, k, draft)

    # ---------------------------------------------------------------- the choice

    def choose(self, batch: int) -> int:
        """Drafts per row for the next round over `batch` rows."""
        exploring = self._exploring(batch)
        k = self._choose(batch)
        self._follow(batch, k > 0)
        self.since_probe += 1
        if self.since_probe > self.probe_interval and not self.speculating:  # a drafting probe is due: can it be paid?
            self.probe_interval = max(self.probe_interval, self._probe_floor(batch))
        probing = self.max_gamma > 0 and self.since_probe > self.probe_interval
        if probing:
            k = 0 if k else self._probe(batch)  # re-time the option not taken, once
            self.since_probe = 0
            # Plain probes back off (undone if the choice flips); drafting probes wait for their loss's budget alone.
            self.probe_interval = (min(2 * self.probe_interval, self.max_probe_every) if self.speculating
                                   else self.probe_every)
        self.last_gamma = k
        self.measuring = k > 0 and (exploring or probing or self.num_trials < self.min_trials)
        return k

    def _follow(self, batch: int, speculating: bool) -> None:
        """Restart the probe schedule at its base interval when the choice changes or the batch size moves by
        more than a quarter."""
        moved = max(batch, self.schedule_batch) > 1.25 * min(batch, self.schedule_batch)
        if speculating != self.speculating or moved:
            self.speculating, self.schedule_batch, self.since_probe = speculating, batch, 0
            self.probe_interval = self.probe_every

    def _probe_floor(self, batch: int) -> int:
        """Decoding plainly: the fewest rounds between drafting probes for their estimated loss against plain
        decoding of the same tokens to stay within `probe_budget` of those rounds' time. Before drafting was
        measured, the loss at the best case: every draft accepted, draft steps free where none was timed."""
        plain = self.verify_estimate(batch)
        if not plain:
            return 0
        a = 1.0 if self.acceptance is None else self.acceptance
        draft = self.draft_estimate(batch) or 0.0
        k = self._probe(batch)
        lost = self.round_cost(batch, k, draft) - expected_tokens(a, k) * plain
        return max(0, math.ceil(lost / plain / self.probe_budget))

    def _cannot_pay(self, batch: int) -> bool:
        """Whether drafting loses at this batch size even if every draft were accepted, by the costs known (a draft
        step free where none was timed; one measured size stands for all, so this needs the larger passes' costs,
        which the engine's warm-up times): then exploring waits for the probe schedule, whose floor prices it."""
        plain = self.verify_estimate(batch)
        draft = self.draft_estimate(batch) or 0.0
        # (k + 1) / cost(k) <= (1 + margin) / plain for every k, multiplied out: an extrapolated cost may be 0
        return all((k + 1) * plain <= (1 + self.margin) * self.round_cost(batch, k, draft)
                   for k in range(1, self.max_gamma + 1))

    def _exploring(self, batch: int) -> bool:
        """Whether plain decoding is measured at this size and drafting is not yet."""
        return self.max_gamma > 0 and batch in self.verify_cost and (self.acceptance is None or not self.draft_ratio)

    def _choose(self, batch: int) -> int:
        if self.max_gamma == 0 or batch not in self.verify_cost:
            return 0  # measure plain decoding at this size first
        if self._exploring(batch):  # one cheap round measures the draft step and acceptance, unless it must lose
            return 0 if self._cannot_pay(batch) else 1
        draft = self.draft_estimate(batch)
        rates = [self.throughput(batch, k, draft) for k in range(self.max_gamma + 1)]
        best = max(range(1, self.max_gamma + 1), key=rates.__getitem__)  # the k >= 1 of the most tokens/s
        going_on = self.speculating and not self.measuring  # drafting by its own choice: no margin to go on
        return best if rates[best] > rates[0] * (1 + (0.0 if going_on else self.margin)) else 0

    def _probe(self, batch: int) -> int:
        """The k >= 1 a probe of drafting runs: the least estimated time lost against plain decoding of the same
        tokens (1 while nothing is measured)."""
        plain = self.verify_estimate(batch)
        if self.acceptance is None or not self.draft_ratio or plain is None:
            return min(1, self.max_gamma)
        return min(range(1, self.max_gamma + 1),
                   key=lambda k: self.round_cost(batch, k) - expected_tokens(self.acceptance, k) * plain)
