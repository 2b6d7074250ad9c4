"""Model runner: scheduler output -> input tensors -> forward -> logits -> sampled tokens.

Owns the model, the KV cache tensors and the attention backend. Requests with short queries
(decodes) go first in the flattened token batch so that attention can batch them in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention import MAX_BATCHED_QUERY_LEN, AttentionBackend, SeqSpec
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, SamplingBatch, TokenLogprobs, seed_for_position
from tandem.engine.scheduler import SchedulerOutput

__all__ = ["ModelRunner", "StepResult", "TokenLogprobs"]


@dataclass
class StepResult:
    tokens: dict[str, int]  # request id -> sampled token, for requests that reached their end
    logprobs: dict[str, TokenLogprobs]  # for those of them that asked for logprobs


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    seqs: list[SeqSpec]
    sample_indices: torch.Tensor  # [num_sampled] rows of the token batch whose logits are needed
    sampled_requests: list[Request]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.backend: AttentionBackend = model.backend
        self.device = device
        self.eos_token_ids = eos_token_ids
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler()

    @staticmethod
    def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        cfg = model.cfg
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelInput:
        scheduled = sorted(out.scheduled, key=lambda s: s.num_new_tokens > MAX_BATCHED_QUERY_LEN)
        input_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSpec] = []
        sample_indices: list[int] = []
        sampled: list[Request] = []
        for s in scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            seqs.append(SeqSpec(start, s.num_new_tokens, block_tables[req.request_id]))
            if s.samples:
                sample_indices.append(len(input_ids) - 1)
                sampled.append(req)
        dev = self.device
        return ModelInput(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            seqs,
            torch.tensor(sample_indices, device=dev),
            sampled,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        inp = self.prepare(out, block_tables)
        meta = self.backend.build_metadata(inp.seqs, self.device)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, meta)
        reqs = inp.sampled_requests
        if not reqs:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[inp.sample_indices])  # [num_sampled, vocab]
        for r in reqs:
            if r.generator is not None and r.params.seed is not None:
                r.generator.manual_seed(seed_for_position(r.params.seed, len(r.output_token_ids)))
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            [r.generator for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            self.model.cfg.vocab_size,
            self.device,
            self.eos_token_ids,
        )
        result = self.sampler(logits, batch)
        tokens = dict(zip((r.request_id for r in reqs), result.token_ids.tolist(), strict=True))
        logprobs = {}
        if result.logprobs is not None:
            lists = result.logprobs.to_lists(batch.num_logprobs)
            logprobs = {r.request_id: lp for r, lp in zip(reqs, lists, strict=True) if lp}
        return StepResult(tokens, logprobs)
