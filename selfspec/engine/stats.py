"""Per-generation statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Iterable


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # speculative rounds, or AR steps
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rejected: int = 0  # rounds that ended with a rejected draft (fewer accepted than the round's drafts)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @classmethod
    def total(cls, stats: Iterable[GenerationStats]) -> GenerationStats:
        """The field-by-field sum of several generations' stats (rates then come from the summed counts)."""
        out = cls()
        for s in stats:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(s, f.name))
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """The chain model's per-draft acceptance a: each judged draft is accepted with probability a, and the drafts
        after a rejection are not judged, so a round judges its accepted drafts plus the rejected one, if any:
        accepted / (accepted + rejected). This is the `a` of policy.expected_tokens(a, k) = 1 + a + ... + a^k.
        acceptance_rate (accepted / proposed) is lower: it counts the unjudged drafts after a rejection as
        proposed, i.e. E[accepted per round] / gamma at a fixed gamma."""
        judged = self.draft_accepted + self.draft_rejected
        return self.draft_accepted / judged if judged else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify pass: 1 + accepted / rounds (vLLM's definition)."""
        return 1 + self.draft_accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.prefill_s
        return self.new_tokens / decode_s if decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, per_token_acceptance=self.per_token_acceptance,
                 mean_acceptance_length=self.mean_acceptance_length,
                 tokens_per_s=self.tokens_per_s)
        return d

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_s:.2f} s ({self.tokens_per_s:.1f} tok/s decode); "
                f"rounds {self.rounds}, drafts accepted {self.draft_accepted}/{self.draft_proposed} "
                f"({100 * self.acceptance_rate:.1f}%; per-token {self.per_token_acceptance:.3f}), "
                f"mean acceptance length {self.mean_acceptance_length:.2f}; "
                f"prefill {self.prefill_s:.2f} s, draft {self.draft_s:.2f} s, verify {self.verify_s:.2f} s")
