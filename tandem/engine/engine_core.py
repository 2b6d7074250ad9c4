"""Engine core: requests in, token deltas out; `step()` = schedule -> execute -> update.

What executes the steps (the real model or the simulated one) comes from `executor.py`; the
speculative decoding around them, when the config asks for it, from `spec/decoder.py`. No
tokenizer and no network here: the offline API (`llm.py`) and the workers wrap it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem import hub
from tandem.config import EngineConfig
from tandem.engine.dtypes import model_device
from tandem.engine.executor import load_executor
from tandem.engine.grammar import GrammarCache
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import request_generator
from tandem.engine.scheduler import Role, Scheduler, SchedulerOutput
from tandem.engine.spec.decoder import StepKind, make_spec_decoder
from tandem.engine.tp.ranks import RankLauncher
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import (
    SamplingParams,
    choice_request_id,
    validate_prompt_token_ids,
)
from tandem.tokenizer import tokenizer_dir


@dataclass
class RequestDelta:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With the first token of a request that asked for them: its prompt tokens' logprobs, from
    # the second token on (the first has none)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # A prompt handed over (FINISHED_PREFILLED): the proposer's state for the decode side.
    handover: dict[str, Tensor] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.request.status.finished


class EngineCore:
    def __init__(
        self, config: EngineConfig, role: Role | None = None, launcher: RankLauncher | None = None
    ) -> None:
        """`launcher`: where a tensor-parallel engine's ranks 1.. run (default: processes)."""
        self.config = config
        mc = config.model
        if mc.cpu_threads is not None and model_device(mc).type == "cpu":
            torch.set_num_threads(mc.cpu_threads)
        self.model_path = hub.resolve(mc.model)
        self.executor = load_executor(config, self.model_path, launcher)
        self.model, self.runner = self.executor.model, self.executor.runner
        cfg = self.model.cfg
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(
            mc.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        cache = config.cache
        self.kv_cache = KVCacheManager(
            self.executor.num_blocks, cache.block_size, cache.enable_prefix_caching
        )
        # The longest sequence this engine can hold: its context, or what the KV cache fits.
        self.max_sequence_len = min(self.max_model_len, self.executor.num_blocks * cache.block_size)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, self.max_model_len, cfg.eos_token_ids, role
        )
        self.spec_decoder = make_spec_decoder(
            config, self.runner, self.kv_cache, self.scheduler, self.max_model_len
        )
        self.grammars = GrammarCache(
            lambda: (tokenizer_dir(self.model_path) / "tokenizer.json").read_text(),
            cfg.vocab_size,
            cfg.eos_token_ids,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        speculative: bool = True,
    ) -> Request:
        """Validate and queue a request; raises ValueError before any KV is allocated.

        `speculative=False` opts this request out of the engine's speculative decoding. With
        `params.n` > 1 the request is choice 0 and its `forks` are choices 1 .. n-1 (their ids
        from `choice_request_id`): one prompt computation, n outputs."""
        # No max_tokens: the rest of the context, as far as the KV cache can hold one sequence
        params = params.resolved_for(len(prompt_token_ids), self.max_sequence_len)
        params.validate(self.vocab_size)
        validate_prompt_token_ids(
            prompt_token_ids, self.vocab_size, self.max_model_len, params.output_budget
        )
        scheduler = self.config.scheduler
        if not scheduler.enable_chunked_prefill and (
            len(prompt_token_ids) > scheduler.max_num_batched_tokens
        ):
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; with chunked prefill disabled a "
                f"prompt must fit in one step, max_num_batched_tokens="
                f"{scheduler.max_num_batched_tokens}"
            )
        # A request that could never fit would preempt itself forever.
        max_blocks = math.ceil(
            (len(prompt_token_ids) + params.output_budget) / self.kv_cache.block_size
        )
        if max_blocks > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt + max_tokens need {max_blocks} KV blocks; the cache has "
                f"{self.kv_cache.num_blocks} (raise cache memory or lower max_tokens)"
            )
        if params.n > scheduler.max_num_seqs:
            raise ValueError(
                f"n must be at most max_num_seqs={scheduler.max_num_seqs}, got {params.n}"
            )
        choices = [
            self._request(
                choice_request_id(request_id, i),
                prompt_token_ids,
                params if i == 0 else params.choice(i),
                priority,
                speculative,
                i,
            )
            for i in range(params.n)
        ]
        req = choices[0]
        req.forks = choices[1:]
        self.scheduler.add(req)
        return req

    def _request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        speculative: bool,
        index: int,
    ) -> Request:
        generator = request_generator(params.seed, model_device(self.config.model))
        grammar = None
        if params.structured_output is not None:
            # A resumed request's output so far ends its prompt: the matcher starts after it.
            output = prompt_token_ids[len(prompt_token_ids) - params.output_offset :]
            grammar = self.grammars.matcher(params.structured_output, output)
        return Request(
            request_id,
            list(prompt_token_ids),
            params,
            priority,
            generator=generator,
            speculative=speculative,
            grammar=grammar,
            index=index,
        )

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self.scheduler.finish(request_id, status)
        if self.spec_decoder is not None:
            self.spec_decoder.release(request_id)

    def remote_kv_arrived(
        self,
        request_id: str,
        first_token: int,
        handover: dict[str, Tensor],
        fork_tokens: Sequence[int] = (),
    ) -> Request:
        """A parked request's prompt KV landed, with the first token (its forks' in
        `fork_tokens`) and the proposer state the prefill side handed over
        (`RequestDelta.handover`): the request and its forks join the running batch, with drafts
        for their first decode step as a colocated engine would make them."""
        req = self.scheduler.remote_kv_arrived(request_id, first_token, fork_tokens)
        if self.spec_decoder is not None:
            for r in (req, *req.forks):  # the forks share the prompt, and so its state
                if r.status == RequestStatus.RUNNING:
                    self.spec_decoder.adopt(r, handover)
        return req

    def close(self) -> None:
        """Stop what runs beside this process (a tensor-parallel engine's other ranks)."""
        self.executor.close()

    def check_integrity(self) -> None:
        """Between steps: raise AssertionError naming the first broken invariant of the KV
        blocks, in rank 0's bookkeeping (`KVCacheManager.check_integrity`) or on another
        tensor-parallel rank (one that ran other steps than it was sent, holds a cache of
        another layout, or other KV in the live blocks than another holder of its KV heads:
        tp/integrity.py)."""
        self.kv_cache.check_integrity()
        self.executor.check_ranks(self.kv_cache.referenced_blocks())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        """schedule -> execute -> update; then the speculative decoder, if any, observes the
        step, drafts for the next one and hands over what finished prompts leave to it."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        tables = self._block_tables(out)
        kind = StepKind.of(out)  # before update moves the requests on
        start = time.perf_counter()
        result = self.runner.execute(out, tables, self._layer_hook(out))
        for req_id, scored in result.prompt_logprobs.items():
            req = self.scheduler.requests[req_id]
            req.prompt_logprobs += scored
            for fork in req.forks:  # the prompt's, shared: each choice's first token carries it
                fork.prompt_logprobs = req.prompt_logprobs
        changed = self.scheduler.update(out, result.tokens)
        seconds = time.perf_counter() - start
        deltas = [
            RequestDelta(
                r,
                kept,
                result.logprobs.get(r.request_id, [])[: len(kept)],
                _first_prompt_logprobs(r, kept),
            )
            for r, kept in changed
        ]
        if self.spec_decoder is not None:
            self.spec_decoder.after_step(kind, seconds, result.hidden)
            for delta in deltas:  # after drafting: the step's hidden states still cover them
                if delta.finished:
                    delta.handover = self.spec_decoder.finish(delta.request)
        return deltas

    def _block_tables(self, out: SchedulerOutput) -> dict[str, list[int]]:
        return {
            s.request.request_id: self.kv_cache.block_table(s.request.request_id)
            for s in out.scheduled
        }

    def _layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """The role's per-layer callback for the prompts that complete in this step, if any."""
        role = self.scheduler.role
        if not role.streams_layers:
            return None
        done = [
            s.request
            for s in out.scheduled
            if s.request.num_computed_tokens
            < s.request.num_prompt_tokens
            <= s.request.num_computed_tokens + s.num_new_tokens
        ]
        return (lambda layer: role.prompt_layer_computed(layer, done)) if done else None


def _first_prompt_logprobs(req: Request, kept: list[int]) -> list[TokenLogprobs]:
    """The prompt's logprobs if `kept` starts the request's output and it asked for them."""
    first = bool(kept) and len(req.output_token_ids) == len(kept)
    return req.prompt_logprobs if first and req.params.prompt_logprobs is not None else []
