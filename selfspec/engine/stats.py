"""Per-generation statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # speculative rounds, or AR steps
    draft_proposed: int = 0
    draft_accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

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
        d.update(acceptance_rate=self.acceptance_rate, mean_acceptance_length=self.mean_acceptance_length,
                 tokens_per_s=self.tokens_per_s)
        return d

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_s:.2f} s ({self.tokens_per_s:.1f} tok/s decode); "
                f"rounds {self.rounds}, drafts accepted {self.draft_accepted}/{self.draft_proposed} "
                f"({100 * self.acceptance_rate:.1f}%), mean acceptance length {self.mean_acceptance_length:.2f}; "
                f"prefill {self.prefill_s:.2f} s, draft {self.draft_s:.2f} s, verify {self.verify_s:.2f} s")
