"""A request inside the engine: its tokens, progress, sampling state and timestamps.

Lifecycle: WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED -> RUNNING when its blocks were
taken back (it recomputes). A role may park a request in WAITING_FOR_REMOTE_KV (its blocks are
reserved, another worker computes them) or hand it over after its first token (FINISHED_PREFILLED,
blocks held until released).

A request with n > 1 choices is choice 0; its `forks` are the others. They wait with it, hold
no blocks, and are sampled from its logits row when it samples its first token (each with its own
seed); then they are forked onto its prompt's blocks (shared full blocks, a copy of the partial
last one) and run as requests of their own.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.engine.spec.adaptive import Acceptance
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILLED = "prefilled"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_drafts: int = 0  # steps that verified drafts of this request
    num_draft_tokens: int = 0  # speculative tokens verified
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    speculative: bool = True  # False: this request never gets drafts
    spec_token_ids: list[int] = field(default_factory=list)  # drafts for the next step
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab] q; None: one-hot
    spec_acceptance: Acceptance = field(default_factory=Acceptance)  # of its drafts, per token
    grammar: GrammarMatcher | None = None  # a structured output's matcher, at the output's end
    index: int = 0  # which of its prompt's n choices this is
    forks: list[Request] = field(default_factory=list)  # choices 1 .. n-1, when this is choice 0
    # params.prompt_logprobs: those of prompt tokens 1, 2, ... computed so far (token 0 has none)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(self.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def forking(self) -> bool:
        """Whether its other choices are still to be sampled with its first token."""
        return bool(self.forks) and not self.output_token_ids

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prompt may start from cached blocks: not when its prompt's logprobs are
        asked for, since a cached position has no logits."""
        return self.params.prompt_logprobs is None

    @property
    def scores_prompt(self) -> bool:
        """Whether a step computing its prompt also scores it (`prompt_logprobs`): until its
        first token, with which they leave."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    def append_output(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)  # sampled under its mask: accepted
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
