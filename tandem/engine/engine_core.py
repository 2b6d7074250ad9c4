"""Engine core: requests in, token deltas out; `step()` = schedule -> execute -> update.

No tokenizer and no network here: the offline API (`llm.py`) and the workers wrap it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from tandem import hub
from tandem.config import EngineConfig
from tandem.engine.attention import TorchSDPABackend
from tandem.engine.dtypes import kv_dtype, model_device, model_dtype
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.kv_quant import kv_bytes_per_token
from tandem.engine.models import load_model
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request, RequestStatus
from tandem.engine.runner import ModelRunner
from tandem.engine.sampler import request_generator
from tandem.engine.scheduler import Role, Scheduler, SchedulerOutput
from tandem.engine.sim import SimModel, SimProfile, SimRunner
from tandem.engine.spec.adaptive import disable_batch_size, num_draft_tokens
from tandem.engine.spec.cost import DraftLengthControl
from tandem.engine.spec.draft import draft_kv_bytes_per_block
from tandem.engine.spec.factory import make_proposer
from tandem.engine.spec.proposer import Proposer, StepHidden
from tandem.model_config import load_config
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams, validate_prompt_token_ids


@dataclass
class RequestDelta:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # A prompt handed over (FINISHED_PREFILLED): the proposer's state for the decode side.
    handover: dict[str, Tensor] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.request.status.finished


class EngineCore:
    def __init__(self, config: EngineConfig, role: Role | None = None) -> None:
        self.config = config
        mc = config.model
        if mc.num_threads is not None and model_device(mc).type == "cpu":
            torch.set_num_threads(mc.num_threads)
        self.model_path = hub.resolve(mc.model)
        block_size = config.cache.block_size
        cache_dtype = kv_dtype(config)
        self.model: LlamaForCausalLM | SimModel
        self.sim: SimProfile | None = None  # the timing model of a simulated engine
        if mc.engine == "sim":  # the real config and tokenizer, no weights
            self.sim = SimProfile.load(mc.sim_profile)
            real = load_config(self.model_path)
            self.model = SimModel.of(real, self.sim.sim_layers)
            if not self.sim.kv_bytes_per_token:
                per_token = kv_bytes_per_token(real, cache_dtype)
                self.sim = replace(self.sim, kv_bytes_per_token=per_token)
            bytes_per_block = self.sim.kv_bytes_per_token * block_size
        else:
            self.model = load_model(
                self.model_path,
                TorchSDPABackend,
                block_size,
                model_dtype(mc),
                model_device(mc),
                mc.quantization,
                mc.quant_group_size,
                mc.kernel_routes,
            )
            bytes_per_block = kv_bytes_per_token(self.model.cfg, cache_dtype) * block_size
            bytes_per_block += draft_kv_bytes_per_block(
                config.spec, block_size, cache_dtype, model_dtype(mc)
            )
        cfg = self.model.cfg
        self.vocab_size = cfg.vocab_size
        self.max_model_len = min(
            mc.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        num_blocks = config.cache.num_blocks or max(
            1, int(config.cache.memory_gib * 2**30) // bytes_per_block
        )
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, self.max_model_len, cfg.eos_token_ids, role
        )
        self.runner: ModelRunner | SimRunner
        if isinstance(self.model, SimModel):
            assert self.sim is not None
            self.runner = SimRunner(
                self.sim, num_blocks, block_size, cfg.vocab_size, cfg.eos_token_ids
            )
        else:
            self.runner = ModelRunner(
                self.model,
                num_blocks,
                block_size,
                cache_dtype,
                model_device(mc),
                cfg.eos_token_ids,
            )
        self.proposer: Proposer | None = None
        if config.spec.method is not None:
            self.proposer = make_proposer(config.spec, self.runner, self.kv_cache, mc)
        self.draft_control = DraftLengthControl()  # drafts as the measured costs pay for

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        speculative: bool = True,
    ) -> Request:
        """Validate and queue a request; raises ValueError before any KV is allocated.

        `speculative=False` opts this request out of the engine's speculative decoding."""
        params.validate(self.vocab_size)
        validate_prompt_token_ids(
            prompt_token_ids, self.vocab_size, self.max_model_len, params.max_tokens
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
            (len(prompt_token_ids) + params.max_tokens) / self.kv_cache.block_size
        )
        if max_blocks > self.kv_cache.num_blocks:
            raise ValueError(
                f"prompt + max_tokens need {max_blocks} KV blocks; the cache has "
                f"{self.kv_cache.num_blocks} (raise cache memory or lower max_tokens)"
            )
        generator = request_generator(params.seed, model_device(self.config.model))
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            priority,
            generator=generator,
            speculative=speculative,
        )
        self.scheduler.add(req)
        return req

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self.scheduler.finish(request_id, status)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestDelta]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        tables = {
            s.request.request_id: self.kv_cache.block_table(s.request.request_id)
            for s in out.scheduled
        }
        verifying = any(sr.draft_token_ids for sr in out.scheduled)
        decoding = all(
            s.num_new_tokens == len(s.draft_token_ids) + 1
            and s.request.num_computed_tokens >= s.request.num_prompt_tokens
            for s in out.scheduled
        )
        start = time.perf_counter()
        result = self.runner.execute(out, tables, self._layer_hook(out))
        changed = self.scheduler.update(out, result.tokens)
        if self.proposer is not None and decoding:
            self.draft_control.costs.observe_step(out.num_tokens, time.perf_counter() - start)
        deltas = [
            RequestDelta(r, kept, result.logprobs.get(r.request_id, [])[: len(kept)])
            for r, kept in changed
        ]
        if self.proposer is not None:
            stats = self.scheduler.spec_stats
            if verifying:
                stats.verify_seconds += time.perf_counter() - start
            self._propose(self.proposer, result.hidden)
            for delta in deltas:  # after proposing: the step's hidden states still cover them
                if delta.finished:
                    rid = delta.request.request_id
                    if delta.request.status == RequestStatus.FINISHED_PREFILLED:
                        delta.handover = self.proposer.handover_state(rid)
                    self.proposer.release(rid)
        return deltas

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

    def propose_for(self, requests: list[Request]) -> None:
        """Drafts for requests that joined the running batch decoding (a decode worker's
        arrivals), as the step that computed their prompt makes them on a colocated engine."""
        if self.proposer is not None:
            self._propose(self.proposer, None, requests)

    def _propose(
        self, proposer: Proposer, hidden: StepHidden | None, requests: list[Request] | None = None
    ) -> None:
        """Drafts for the next step of the running requests (or of `requests`): as many as each
        one's acceptance and the batch size allow, never past max_tokens or the context, and
        as many of those as the measured costs pay for; none for a prefill chunk. Its time
        counts as the proposer's."""
        start = time.perf_counter()
        spec = self.config.spec
        running = self.scheduler.running
        limits: list[tuple[Request, int]] = []  # each decoding request and its most drafts
        no_drafts_from = disable_batch_size(
            spec.disable_batch_size, model_device(self.config.model)
        )
        num_decoding = 0  # requests whose next step computes one position (plus drafts)
        for req in running if requests is None else requests:
            req.spec_token_ids, req.spec_draft_probs = [], None
            num_decoding += req.num_tokens - req.num_computed_tokens == 1
            if not req.speculative or req.num_tokens - req.num_computed_tokens != 1:
                continue
            room = min(
                req.params.max_tokens - len(req.output_token_ids),
                self.max_model_len - req.num_tokens,
            )
            k = num_draft_tokens(
                spec.num_speculative_tokens,
                req.spec_acceptance.rate,
                len(running),
                no_drafts_from,
            )
            limits.append((req, max(min(k, room - 1), 0)))
        if spec.cost_aware and requests is None and any(k for _, k in limits):
            acceptances = [req.spec_acceptance.rate for req, _ in limits]
            caps = [most for _, most in limits]
            k = self.draft_control.choose(acceptances, caps, num_decoding)
            self.scheduler.spec_stats.num_plain_by_cost += k == 0
            limits = [(req, min(k, most)) for req, most in limits]
        batch = [(req, k) for req, k in limits if k > 0]
        if batch or hidden is not None:
            drafts = proposer.propose(batch, hidden)
            for (req, _), draft in zip(batch, drafts, strict=True):
                req.spec_token_ids, req.spec_draft_probs = draft.token_ids, draft.probs
        seconds = time.perf_counter() - start
        self.draft_control.costs.observe_propose(max((k for _, k in batch), default=0), seconds)
        self.scheduler.spec_stats.propose_seconds += seconds
