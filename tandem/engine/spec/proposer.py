"""The proposer interface: after each step, drafts for the decoding requests' next step.

The engine decides how many drafts each request may get (`draft_length.py`), then asks its proposer
once for the whole batch. A proposer returns, per request, up to that many draft tokens and, when
it sampled them from a distribution, that distribution q (the verifier needs it for exact
speculative sampling; None means one-hot drafts, as from n-gram lookup or a greedy drafter).

Model-based proposers may need the target's final hidden states of the step that just ran
(Medusa, EAGLE): the factory that builds them makes the runner keep those (`keep_hidden`), and
they receive a `StepHidden` covering every request the step computed (prefill chunks included),
after every step, even one with nothing to draft.

Disaggregated, a prompt is computed on a prefill worker and decoded on a decode worker; a
proposer that needs state of the prompt (EAGLE: its hidden states) hands it over
(`handover_state` on the prefill side, `adopt_state` on the decode side, through the KV
transfer's trailer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import Tensor

from tandem.engine.request import Request


@dataclass
class Draft:
    token_ids: list[int]
    probs: Tensor | None = None  # [len(token_ids), vocab] q of each draft; None: one-hot

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"draft probs have {self.probs.shape[0]} rows for {len(self.token_ids)} tokens"
            )


NO_DRAFT = Draft([])


@dataclass
class StepHidden:
    """The target model's final (normed) hidden states of one step, per request.

    A request's rows cover the positions the step computed for it, in order: a prefill chunk,
    one decode token, or the last token plus its drafts (rows of rejected drafts included).
    """

    states: Tensor  # [num_tokens, hidden_size]
    spans: dict[str, tuple[int, int, int]]  # request id -> (first row, first position, num rows)

    def at(self, request_id: str, start: int, end: int) -> Tensor | None:
        """Hidden states of positions [start, end) of a request, or None if the step lacks any."""
        span = self.spans.get(request_id)
        if span is None:
            return None
        row, first, num = span
        if start < first or end > first + num or start >= end:
            return None
        return self.states[row + start - first : row + end - first]


class Proposer(ABC):
    @abstractmethod
    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        """One `Draft` per (request, k): at most k tokens to follow the request's known tokens.

        Each request is decoding: all its tokens but the last have KV in the target's cache
        (`num_computed_tokens == num_tokens - 1`), and it has room for k more tokens."""

    def release(self, request_id: str) -> None:  # noqa: B027 - a hook; stateless proposers skip it
        """The request left the engine (finished, aborted or handed over): drop its state."""

    def handover_state(self, request_id: str) -> dict[str, Tensor]:
        """What a decode worker's proposer needs of a prompt this engine computed for it (a
        prefill worker), sent with the first token to its `adopt_state`; {}: nothing."""
        return {}

    def adopt_state(self, request_id: str, state: dict[str, Tensor]) -> None:  # noqa: B027
        """A request's prompt KV arrived from a prefill worker with that worker's
        `handover_state` (maybe {} or another proposer's: then ignore it)."""


class GrammarOnlyProposer(Proposer):
    """Proposes nothing: the drafts a structured output's grammar forces are the only ones
    (`GrammarMatcher.drafts`), and free text is not speculated. The `grammar` method."""

    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        return [Draft([]) for _ in batch]
