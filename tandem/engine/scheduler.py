"""Token-budget scheduler: continuous batching, chunked prefill, prefix reuse, preemption.

It schedules tokens, not phases: a request has `num_computed_tokens`, and each step gives it
`num_tokens - num_computed_tokens` more (capped by the step's token budget), so a long prompt is
split across steps while running decodes keep their one token per step. A prefix-cache hit, or KV
that arrived from a prefill worker, is just "these tokens are already computed".

Order of a step: running requests first (oldest first; most urgent first under the priority
policy), preempting the newest (least urgent) running request by recompute when blocks run out;
then waiting requests (FCFS, or by priority) while budget, seats and blocks last. `update` appends
the sampled tokens and finishes requests.

Roles (colocated, prefill, decode) are a `Role` hooks object consulted at admission and at the
first token, so one scheduler serves all three.

n > 1 choices: a request computes its prompt once and samples its first token together with those
of its forks (request.py), which then fork onto its blocks: its full blocks shared (ref counts),
a fresh block for the partial last one, whose KV the runner copies before the next step's
forward (`SchedulerOutput.block_copies`). Each choice then runs, is preempted and finishes as a
request of its own; a fork that finds no free block for its copy is preempted at once and
recomputes. A prefill role hands the choices' first tokens over with the request instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.config import SchedulerConfig
from tandem.engine.kv_cache import KVCacheManager, OutOfBlocksError
from tandem.engine.request import Request, RequestStatus
from tandem.engine.spec.acceptance import SpecStats


class Role:
    """Colocated role: a request is prefilled and decoded here. Subclasses change the hooks."""

    def computes_prompt(self, request: Request) -> bool:
        """False parks the request in WAITING_FOR_REMOTE_KV with blocks reserved for its prompt.

        Asked when a request is first admitted; a preempted request always recomputes here."""
        return True

    def hands_over_after_first_token(self, request: Request) -> bool:
        """True ends the request after its first token with its blocks held (FINISHED_PREFILLED),
        even when that token would stop it: the side it is handed to decides."""
        return False

    def prompt_layer_computed(self, layer: int, requests: list[Request]) -> None:
        """Layer `layer` of the whole prompt of each request is in its blocks (called during the
        step that computes the prompt's last chunk, once per layer, when `streams_layers`)."""

    streams_layers = False


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including the draft tokens
    draft_token_ids: tuple[int, ...] = ()  # speculative tokens verified in this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a token is sampled."""
        r = self.request
        known = self.num_new_tokens - len(self.draft_token_ids)
        return r.num_computed_tokens + known == r.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]
    # (src, dst): copy block src's KV into dst before the forward (a fork's partial last block)
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        role: Role | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.role = role or Role()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}  # waiting for remote KV, or held for hand-over
        self.requests: dict[str, Request] = {}
        self.spec_stats = SpecStats()
        self.num_preemptions = 0  # since start, over all requests
        self._block_copies: dict[str, tuple[int, int]] = {}  # by fork, until a step runs them

    def add(self, request: Request) -> None:
        for r in (request, *request.forks):
            if r.request_id in self.requests:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.monotonic()
        if self.config.policy == "priority":
            # Urgent requests claim blocks first, so a victim is never more urgent than a request
            # already scheduled this step.
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts: tuple[int, ...] = ()
            if n == 1 and req.spec_token_ids:  # a decode with drafts verifies them in one pass
                drafts = tuple(req.spec_token_ids[: budget - 1])
                n += len(drafts)
            while not self._allocate(req, n):  # blocks ran out: preempt by recompute
                victim = self._pick_victim(self.running[i:])
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n, drafts))
                budget -= n
                i += 1

        if not preempted:
            self._admit_waiting(scheduled, budget, now)
        copies: tuple[tuple[int, int], ...] = ()
        if scheduled:  # with nothing to run, no forward writes a block: they wait
            copies = tuple(self._block_copies.values())
            self._block_copies.clear()
        return SchedulerOutput(scheduled, preempted, copies)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int, now: float) -> None:
        if self.config.policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self._num_seated() + _seats(req) > self.config.max_num_seqs:
                break
            # A preempted request recomputes here: the KV its role had sent from elsewhere is gone.
            if req.status == RequestStatus.WAITING and not self.role.computes_prompt(req):
                # Reserve the prompt's blocks without hashing them: their KV is not there yet.
                # They join the prefix cache on the first decode step after it lands.
                if not self.kv_cache.allocate(req.request_id, (), 0, req.num_tokens):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.parked[req.request_id] = req
                continue
            prefix = self.kv_cache.match_prefix(req.all_token_ids) if req.reads_prefix_cache else []
            computed = len(prefix) * self.kv_cache.block_size
            n = req.num_tokens - computed
            # Without chunking a prompt waits for a step with room for all of it. Only a preempted
            # request's recompute can exceed a whole step (add_request refuses such prompts);
            # it is chunked, or it would wait forever.
            whole = n <= self.config.max_num_batched_tokens
            if n > budget and whole and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv_cache.allocate(req.request_id, req.all_token_ids, computed, n, prefix):
                break
            self.waiting.popleft()
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _num_seated(self) -> int:
        """Running requests, and parked ones that join the running batch when their KV lands."""
        return sum(_seats(r) for r in self.running) + sum(
            _seats(r)
            for r in self.parked.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KV
        )

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """Among requests not yet scheduled this step: the newest, or under the priority policy
        the least urgent."""
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _allocate(self, req: Request, n: int) -> bool:
        return self.kv_cache.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, n)

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req.request_id)
        self._block_copies.pop(req.request_id, None)  # its copy's block may be reused
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- update -----------------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[tuple[Request, list[int]]]:
        """Advance the scheduled requests; `sampled` maps request id -> its new tokens (one, or
        the accepted drafts and the token after them).

        Returns each request that got tokens this step, with the tokens it kept (a stop may cut
        them short).
        """
        now = time.monotonic()
        changed: list[tuple[Request, list[int]]] = []
        for s in output.scheduled:
            req = s.request
            tokens = sampled.get(req.request_id)
            # KV is valid up to the last accepted draft; rejected drafts' slots lie beyond
            # num_computed_tokens, unseen by attention, and are overwritten by the next step.
            rejected = len(s.draft_token_ids) - (len(tokens) - 1) if tokens else 0
            req.num_computed_tokens += s.num_new_tokens - rejected
            if tokens is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if req.forking:  # before its own token: that may finish it and free its blocks
                changed += self._fork(req, [sampled[f.request_id][0] for f in req.forks], now)
            if s.draft_token_ids:
                num_accepted = len(s.draft_token_ids) - rejected
                req.metrics.num_drafts += 1
                req.metrics.num_draft_tokens += len(s.draft_token_ids)
                req.metrics.num_accepted_tokens += num_accepted
                self.spec_stats.observe(len(s.draft_token_ids), num_accepted)
                req.spec_acceptance.observe(len(s.draft_token_ids), num_accepted)
            kept: list[int] = []
            for token in tokens:
                req.append_output(token, now)
                kept.append(token)
                if self.role.hands_over_after_first_token(req):
                    # Even a final first token is handed over: the receiving side owns stopping.
                    self.running.remove(req)
                    req.status = RequestStatus.FINISHED_PREFILLED
                    self.parked[req.request_id] = req
                    break
                if (status := self._check_stop(req)) is not None:
                    self.finish(req.request_id, status)
                    break
            changed.append((req, kept))
        return changed

    def _check_stop(self, req: Request) -> RequestStatus | None:
        token = req.output_token_ids[-1]
        params = req.params
        stops = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )
        if stops and len(req.output_token_ids) >= params.min_tokens:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if (
            len(req.output_token_ids) >= params.output_budget
            or req.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- finishing and roles -------------------------------------------------------------------

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop, length, abort) and free its blocks; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.parked.pop(request_id, None)
        req.status = status
        self.kv_cache.free(request_id)
        self._block_copies.pop(request_id, None)  # its copy's block may be reused
        return req

    def remote_kv_arrived(
        self, request_id: str, first_token: int, fork_tokens: Sequence[int] = ()
    ) -> Request:
        """A parked request's prompt KV is in its blocks: it joins the running batch with its
        first token, and its forks with theirs (`fork_tokens`, one each, in order)."""
        req = self.parked[request_id]
        if len(fork_tokens) != len(req.forks):
            raise ValueError(
                f"request {request_id!r} has {len(req.forks)} forks, got {len(fork_tokens)} tokens"
            )
        del self.parked[request_id]
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        now = time.monotonic()
        self._fork(req, fork_tokens, now)
        req.append_output(first_token, now)
        if (status := self._check_stop(req)) is not None:
            self.finish(request_id, status)
        return req

    def _fork(
        self, parent: Request, first_tokens: Sequence[int], now: float
    ) -> list[tuple[Request, list[int]]]:
        """The parent's forks, each with its first token (it just computed its prompt): forked
        onto its blocks and running, or, in a prefill role, handed over with it."""
        changed: list[tuple[Request, list[int]]] = []
        for fork, token in zip(parent.forks, first_tokens, strict=True):
            fork.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            fork.append_output(token, now)
            changed.append((fork, [token]))
            if self.role.hands_over_after_first_token(parent):
                fork.status = RequestStatus.FINISHED_PREFILLED
                continue
            self.requests[fork.request_id] = fork
            try:
                copy = self.kv_cache.fork(parent.request_id, fork.request_id)
            except OutOfBlocksError:
                self._preempt(fork)  # it recomputes its prompt once blocks free up
            else:
                if copy is not None:
                    self._block_copies[fork.request_id] = copy
                fork.num_computed_tokens = parent.num_computed_tokens
                fork.status = RequestStatus.RUNNING
                self.running.append(fork)
            if (status := self._check_stop(fork)) is not None:
                self.finish(fork.request_id, status)
        return changed

    def compute_prompt_locally(self, request_id: str) -> Request:
        """A parked request's KV will not arrive (failed transfer): compute its prompt here, in
        the blocks already reserved for it."""
        req = self.parked.pop(request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def release(self, request_id: str) -> None:
        """Free the blocks of a request handed over after its first token."""
        self.finish(request_id, RequestStatus.FINISHED_PREFILLED)


def _seats(req: Request) -> int:
    """Running seats the request takes: its forks' too while they are still to come."""
    return 1 + len(req.forks) if req.forking else 1
