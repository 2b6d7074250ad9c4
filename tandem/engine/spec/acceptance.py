"""Acceptance counters of speculative decoding, named as in BENCHMARKS.md.

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (tokens
a verify step yields on average); per-position rate i = how often the i-th draft was accepted when
one was proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    propose_seconds: float = 0.0  # time in the proposer
    verify_seconds: float = 0.0  # time in target steps that verified drafts
    num_plain_by_cost: int = 0  # steps the cost model left undrafted (its probes included)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        missing = num_draft_tokens - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for i in range(num_draft_tokens):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_rates(self) -> list[float]:
        pairs = zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        return [accepted / drafted for accepted, drafted in pairs]
