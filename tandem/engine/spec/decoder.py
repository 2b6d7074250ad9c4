"""Speculative decoding around the engine's step: the proposer, the draft length, the hand-over.

An engine that speculates holds one `SpecDecoder` and calls it at named points:

    after_step(kind, seconds, hidden)   the step ran: its cost observed (a decode step's seconds
                                        by positions; a verify step's as verify time), then
                                        drafts for every running request's next step
    finish(request)                     a request left in the step: its proposer state released,
                                        first handed over when its prompt goes on to a decode
                                        worker (FINISHED_PREFILLED)
    adopt(request, state)               a decode worker's arrival joined the running batch: the
                                        prefill side's proposer state adopted, drafts for its
                                        first decode step
    release(request_id)                 a request was aborted: its proposer state dropped

How many drafts each request gets is `DraftLengthPolicy`'s (draft_length.py); the scheduler
schedules them and the runner verifies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import Tensor

from tandem.config import EngineConfig
from tandem.engine.dtypes import model_device
from tandem.engine.executor import Runner
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.spec.draft_length import DraftLengthPolicy
from tandem.engine.spec.factory import make_proposer
from tandem.engine.spec.proposer import Proposer, StepHidden


@dataclass(frozen=True)
class StepKind:
    """What the speculative decoder learns of a step from its schedule, read before `update`
    moves the step's requests on."""

    num_positions: int
    verifies: bool  # some request verifies drafts
    decodes: bool  # every request computes its next token only (and its drafts)

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepKind:
        return cls(
            out.num_tokens,
            any(s.draft_token_ids for s in out.scheduled),
            all(
                s.num_new_tokens == len(s.draft_token_ids) + 1
                and s.request.num_computed_tokens >= s.request.num_prompt_tokens
                for s in out.scheduled
            ),
        )


class SpecDecoder:
    def __init__(
        self, proposer: Proposer, config: EngineConfig, scheduler: Scheduler, max_model_len: int
    ) -> None:
        self.proposer = proposer
        self.scheduler = scheduler
        self.draft_length = DraftLengthPolicy(
            config.spec, model_device(config.model), max_model_len, scheduler.spec_stats
        )

    def after_step(self, kind: StepKind, seconds: float, hidden: StepHidden | None) -> None:
        if kind.decodes:
            self.draft_length.observe_step(kind.num_positions, seconds)
        if kind.verifies:
            self.scheduler.spec_stats.verify_seconds += seconds
        self._propose(self.scheduler.running, hidden, by_cost=True)

    def finish(self, request: Request) -> dict[str, Tensor]:
        """The request's proposer state for a decode worker when its prompt is handed over ({}
        otherwise), released here either way. Call after `after_step`: the step's hidden states
        still cover the request then."""
        request_id = request.request_id
        handover: dict[str, Tensor] = {}
        if request.status == RequestStatus.FINISHED_PREFILLED:
            handover = self.proposer.handover_state(request_id)
        self.proposer.release(request_id)
        return handover

    def adopt(self, request: Request, state: dict[str, Tensor]) -> None:
        """Drafts for a request whose prompt another engine computed, as the step that computed
        it makes them on a colocated engine: its first decode step verifies drafts too."""
        self.proposer.adopt_state(request.request_id, state)
        self._propose([request], None, by_cost=False)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def _propose(self, candidates: list[Request], hidden: StepHidden | None, by_cost: bool) -> None:
        """Drafts for the next step of `candidates`, as many as `draft_length` gives each (the
        old drafts go); the proposer still sees a step's hidden states when none drafts. Its
        time counts as the proposer's."""
        start = time.perf_counter()
        for req in candidates:
            req.spec_token_ids, req.spec_draft_probs = [], None
        batch = self.draft_length.draft_lengths(candidates, len(self.scheduler.running), by_cost)
        if batch or hidden is not None:
            drafts = self.proposer.propose(batch, hidden)
            for (req, k), draft in zip(batch, drafts, strict=True):
                req.spec_token_ids, req.spec_draft_probs = draft.token_ids, draft.probs
                if req.grammar is not None:  # forced tokens, refused ones cut (grammar.py)
                    req.spec_token_ids, req.spec_draft_probs = req.grammar.drafts(
                        draft.token_ids, draft.probs, k
                    )
        seconds = time.perf_counter() - start
        self.draft_length.observe_propose(batch, seconds)
        self.scheduler.spec_stats.propose_seconds += seconds


def make_spec_decoder(
    config: EngineConfig,
    runner: Runner,
    kv_cache: KVCacheManager,
    scheduler: Scheduler,
    max_model_len: int,
) -> SpecDecoder | None:
    """The engine's speculative decoder for `config.spec`; None when it does not speculate."""
    if config.spec.method is None:
        return None
    proposer = make_proposer(config.spec, runner, kv_cache, config.model)
    return SpecDecoder(proposer, config, scheduler, max_model_len)
