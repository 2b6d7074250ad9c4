"""How many tokens each decoding request drafts for the next step, decided in one place.

`DraftLengthPolicy` composes the two models below it: the limits of `adaptive.py` (the request's
acceptance, the running batch size) and the room left before max_tokens or the context cap each
request; then, for a whole step's drafts, `cost.py` keeps as many as the measured step and
proposer times pay for, none included. Drafts made between steps for requests that join the
running batch (a decode worker's arrivals) take the limits only: their cost is not a step's.
"""

from __future__ import annotations

import torch

from tandem.config import SpecConfig
from tandem.engine.request import Request
from tandem.engine.spec.acceptance import SpecStats
from tandem.engine.spec.adaptive import disable_batch_size, num_draft_tokens
from tandem.engine.spec.cost import DraftLengthControl


class DraftLengthPolicy:
    """The draft lengths of one engine, and the costs it has measured."""

    def __init__(
        self, spec: SpecConfig, device: torch.device, max_model_len: int, stats: SpecStats
    ) -> None:
        self.spec = spec
        self.device = device
        self.max_model_len = max_model_len
        self.stats = stats  # counts the steps the costs leave undrafted
        self.control = DraftLengthControl()  # drafts as the measured costs pay for

    def draft_lengths(
        self, candidates: list[Request], num_running: int, by_cost: bool
    ) -> list[tuple[Request, int]]:
        """Each candidate that drafts, with how many tokens (> 0); none for a prefill chunk.
        `by_cost`: the candidates are the step's whole running batch, whose drafts the measured
        costs may cut."""
        limits, num_decoding = self._limits(candidates, num_running)
        if by_cost and self.spec.cost_aware and any(k for _, k in limits):
            limits = self._as_costs_pay(limits, num_decoding)
        return [(req, k) for req, k in limits if k > 0]

    def observe_step(self, num_positions: int, seconds: float) -> None:
        """A decode step (every request computing its next token, with or without drafts) over
        `num_positions` took `seconds`."""
        self.control.costs.observe_step(num_positions, seconds)

    def observe_propose(self, batch: list[tuple[Request, int]], seconds: float) -> None:
        """The proposer drafted for `batch` in `seconds`."""
        self.control.costs.observe_propose(max((k for _, k in batch), default=0), seconds)

    def _limits(
        self, candidates: list[Request], num_running: int
    ) -> tuple[list[tuple[Request, int]], int]:
        """Each speculating decoding candidate's most drafts (its acceptance and the batch size
        allow, never past max_tokens or the context), and how many candidates decode (a request
        whose next step computes one position, plus drafts), speculating or not."""
        no_drafts_from = disable_batch_size(self.spec.disable_batch_size, self.device)
        limits: list[tuple[Request, int]] = []
        num_decoding = 0
        for req in candidates:
            decoding = req.num_tokens - req.num_computed_tokens == 1
            num_decoding += decoding
            if not req.speculative or not decoding:
                continue
            room = min(
                req.params.output_budget - len(req.output_token_ids),
                self.max_model_len - req.num_tokens,
            )
            k = num_draft_tokens(
                self.spec.num_speculative_tokens,
                req.spec_acceptance.rate,
                num_running,
                no_drafts_from,
            )
            limits.append((req, max(min(k, room - 1), 0)))
        return limits, num_decoding

    def _as_costs_pay(
        self, limits: list[tuple[Request, int]], num_decoding: int
    ) -> list[tuple[Request, int]]:
        """One draft length for the step, as the measured costs pay for, within each limit."""
        acceptances = [req.spec_acceptance.rate for req, _ in limits]
        k = self.control.choose(acceptances, [most for _, most in limits], num_decoding)
        self.stats.num_plain_by_cost += k == 0
        return [(req, min(k, most)) for req, most in limits]
