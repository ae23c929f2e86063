"""Speculation counters, as vLLM reports them: drafts, draft tokens, accepted tokens (also per position)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify steps of a request (one draft each)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts whose token j was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step produced on average: the accepted drafts plus the model's own next token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
