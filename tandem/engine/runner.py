"""Model runner: scheduler output -> input tensors -> forward -> logits -> sampled tokens.

Owns the model, the KV cache tensors and the attention backend. Requests with short queries
(decodes) go first in the flattened token batch so that attention can batch them in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.engine.attention import MAX_BATCHED_QUERY_LEN, AttentionBackend, SeqSpec
from tandem.engine.cuda_graphs import CudaGraphs
from tandem.engine.grammar import token_masks
from tandem.engine.kv_quant import slot_dim
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    gather_logprobs,
    processed_probs,
    seed_for_position,
)
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.spec.proposer import StepHidden
from tandem.engine.spec.rejection import rejection_sample
from tandem.engine.tp.vocab import TargetVocab
from tandem.outputs import TokenLogprobs

__all__ = ["ModelRunner", "StepResult"]


@dataclass
class StepResult:
    # request id -> its new tokens (one, or accepted drafts + one), for requests that reached
    # the end of their known tokens
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # for those of them that asked for logprobs: one per new token
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    hidden: StepHidden | None = None  # the step's final hidden states, when the runner keeps them
    # request id -> logprobs of the prompt tokens this step scored (`Request.scores_prompt`)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    seqs: list[SeqSpec]
    # [num_rows] rows of the token batch whose logits are needed: the sampled rows, then the
    # scored prompt rows
    sample_indices: torch.Tensor
    sampled: list[ScheduledRequest]  # one logits row each, k + 1 rows with k drafts
    scored: list[tuple[Request, list[int]]]  # after them: prompt rows, with the tokens they score
    spans: dict[str, tuple[int, int, int]]  # request id -> (first row, first position, rows)


def to_device(lists: tuple[list[int], ...], device: torch.device) -> list[torch.Tensor]:
    """Integer lists as int64 tensors on `device`; on CUDA in one copy from pinned memory that
    the host does not wait for (the caching host allocator keeps the buffer until it is done)."""
    cuda = device.type == "cuda"
    flat = torch.tensor([v for values in lists for v in values], dtype=torch.int64, pin_memory=cuda)
    flat = flat.to(device, non_blocking=True) if cuda else flat
    return list(flat.split([len(values) for values in lists]))


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
        # [2, num_blocks, block_size, num_kv_heads, slot_dim]: slot_dim counts a quantized
        # cache's scales (kv_quant.py)
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, slot_dim(kv_dtype, cfg.head_dim))
        self.kv_caches = [
            torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler()
        self.keep_hidden = False  # a proposer reads the target's hidden states (Medusa, EAGLE)
        self.graphs: CudaGraphs | None = None  # decode / verify steps as CUDA graphs (executor)

    def target_vocab(self) -> TargetVocab:
        """The target's embedding and LM head as a drafter on this rank calls them."""
        return self.model

    def use_kv_caches(self, make: Callable[[], list[torch.Tensor]]) -> None:
        """Compute into KV tensors of the same layout that `make()` allocates (e.g. shared memory);
        call before the first step, since the current caches' contents are not copied. The
        engine's own caches are freed first, so the two never hold the device's memory at once."""
        ours = [(c.shape, c.dtype, c.device) for c in self.kv_caches]
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed caches back to the driver, for make()
        kv_caches = make()
        if [(c.shape, c.dtype, c.device) for c in kv_caches] != ours:
            raise ValueError("KV caches must match the engine's layers, shape, dtype and device")
        self.kv_caches = kv_caches

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelInput:
        scheduled = sorted(out.scheduled, key=lambda s: s.num_new_tokens > MAX_BATCHED_QUERY_LEN)
        input_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSpec] = []
        sample_indices: list[int] = []
        sampled: list[ScheduledRequest] = []
        spans: dict[str, tuple[int, int, int]] = {}
        prompt_rows: list[int] = []
        scored: list[tuple[Request, list[int]]] = []
        for s in scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            spans[req.request_id] = (len(input_ids), start, s.num_new_tokens)
            if req.scores_prompt:
                # position p's logits score prompt token p + 1; a recompute skips those scored
                first = max(start, len(req.prompt_logprobs))
                last = min(end, req.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows.extend(
                        range(len(input_ids) + first - start, len(input_ids) + last - start)
                    )
                    scored.append((req, req.all_token_ids[first + 1 : last + 1]))
            input_ids.extend(req.all_token_ids[start:end])
            input_ids.extend(s.draft_token_ids)  # beyond the known tokens
            positions.extend(range(start, end))
            seqs.append(SeqSpec(start, s.num_new_tokens, block_tables[req.request_id]))
            if s.samples:
                num_rows = len(s.draft_token_ids) + 1
                sample_indices.extend(range(len(input_ids) - num_rows, len(input_ids)))
                sampled.append(s)
        ids, pos, rows = to_device(
            (input_ids, positions, sample_indices + prompt_rows), self.device
        )
        return ModelInput(ids, pos, seqs, rows, sampled, scored, spans)

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        block_tables: dict[str, list[int]],
        after_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        inp = self.prepare(out, block_tables)
        self.copy_blocks(out.block_copies)
        hidden = None
        if self.graphs is not None and after_layer is None:
            hidden = self.graphs.run(inp.input_ids, inp.positions, inp.seqs, self.kv_caches)
        if hidden is None:
            meta = self.backend.build_metadata(inp.seqs, self.device)
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, meta, after_layer)
        result = StepResult(hidden=StepHidden(hidden, inp.spans) if self.keep_hidden else None)
        if not inp.sample_indices.numel():
            return result
        logits = self.model.compute_logits(hidden[inp.sample_indices])  # [num_rows, vocab]
        if inp.scored:
            num_sampled = logits.shape[0] - sum(len(tokens) for _, tokens in inp.scored)
            _score_prompts(logits[num_sampled:], inp.scored, result)
            logits = logits[:num_sampled]
        if not inp.sampled:
            return result
        plain_rows: list[int] = []
        plain: list[Request] = []
        verify: list[tuple[ScheduledRequest, int]] = []  # with the index of its first row
        row = 0
        for s in inp.sampled:
            # A first token: the request's forks (other choices) sample from its row too.
            choices = [s.request, *s.request.forks] if s.request.forking else [s.request]
            for r in choices:
                if r.generator is not None and r.params.seed is not None:
                    position = r.params.output_offset + len(r.output_token_ids)
                    r.generator.manual_seed(seed_for_position(r.params.seed, position))
            if s.draft_token_ids:
                verify.append((s, row))
            else:
                plain_rows += [row] * len(choices)
                plain += choices
            row += len(s.draft_token_ids) + 1
        if plain:
            whole = plain_rows == list(range(len(logits)))
            self._sample(logits if whole else logits[plain_rows], plain, result)
        if verify:
            self._verify(logits, verify, result)
        return result

    def first_layers_logits(
        self,
        num_layers: int,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        seqs: list[SeqSpec],
        rows: torch.Tensor,  # [n]
    ) -> torch.Tensor:  # [n, vocab] float32
        """The logits at `rows` of the model's first `num_layers` layers, final norm and LM
        head, writing those layers' KV (a layer-skip draft's forward)."""
        meta = self.backend.build_metadata(seqs, self.device)
        caches = self.kv_caches[:num_layers]
        hidden = self.model(input_ids, positions, caches, meta, num_layers=num_layers)
        return self.model.compute_logits(hidden[rows])

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's KV, every layer (a fork's partial last block)."""
        if not copies:
            return
        src, dst = to_device(([s for s, _ in copies], [d for _, d in copies]), self.device)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, heads, slot_dim]
            cache[:, dst] = cache[:, src]

    def _batch(
        self,
        requests: list[Request],
        output_ids: list[list[int]] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> SamplingBatch:
        return SamplingBatch.build(
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.prompt_token_ids for r in requests],
            output_ids or [r.output_token_ids for r in requests],
            self.model.cfg.vocab_size,
            self.device,
            self.eos_token_ids,
            allowed,
        )

    def _sample(self, logits: torch.Tensor, reqs: list[Request], result: StepResult) -> None:
        vocab_size = self.model.cfg.vocab_size
        batch = self._batch(
            reqs, allowed=token_masks([(r.grammar, ()) for r in reqs], vocab_size, self.device)
        )
        out = self.sampler(logits, batch)
        for r, token in zip(reqs, out.token_ids.tolist(), strict=True):
            result.tokens[r.request_id] = [token]
        if out.logprobs is not None:
            lists = out.logprobs.to_lists(batch.num_logprobs)
            result.logprobs.update(
                (r.request_id, [lp]) for r, lp in zip(reqs, lists, strict=True) if lp
            )

    def _verify(
        self,
        logits: torch.Tensor,  # [num_rows, vocab]
        verify: list[tuple[ScheduledRequest, int]],
        result: StepResult,
    ) -> None:
        """Speculative requests: the target distribution at every draft position and the bonus
        position (penalties see the drafts before each position), then exact verification."""
        rows: list[int] = []
        row_reqs: list[Request] = []
        row_outputs: list[list[int]] = []
        for s, first in verify:
            for i in range(len(s.draft_token_ids) + 1):
                rows.append(first + i)
                row_reqs.append(s.request)
                row_outputs.append(s.request.output_token_ids + list(s.draft_token_ids[:i]))
        allowed = token_masks(
            [(s.request.grammar, s.draft_token_ids) for s, _ in verify],
            self.model.cfg.vocab_size,
            self.device,
        )
        batch = self._batch(row_reqs, row_outputs, allowed)
        probs = processed_probs(apply_penalties(logits[rows], batch), batch)  # [rows, vocab]
        max_k = max(len(s.draft_token_ids) for s, _ in verify)
        target = probs.new_zeros(len(verify), max_k + 1, probs.shape[1])
        draft_ids = torch.full((len(verify), max_k), -1, dtype=torch.long)
        start = 0
        for i, (s, _) in enumerate(verify):
            k = len(s.draft_token_ids)
            target[i, : k + 1] = probs[start : start + k + 1]
            draft_ids[i, :k] = torch.tensor(s.draft_token_ids)
            start += k + 1
        requests = [s.request for s, _ in verify]
        greedy = torch.tensor([r.params.greedy for r in requests], device=self.device)
        out = rejection_sample(
            target,
            draft_ids.to(self.device),
            _draft_probs(verify, probs.shape[1], self.device),
            greedy,
            [r.generator for r in requests],
        )
        tokens, emitted = out.token_ids.tolist(), out.num_emitted.tolist()
        for i, r in enumerate(requests):
            result.tokens[r.request_id] = tokens[i][: emitted[i]]
        if batch.max_num_logprobs is not None:
            self._verified_logprobs(logits[rows], batch, result, row_reqs, rows)

    def _verified_logprobs(
        self,
        logits: torch.Tensor,  # [rows, vocab] of the verified requests
        batch: SamplingBatch,
        result: StepResult,
        row_reqs: list[Request],
        rows: list[int],
    ) -> None:
        """Logprobs of each emitted token in the raw model distribution of its own row."""
        emitted_rows: list[int] = []
        emitted_ids: list[int] = []
        first: dict[str, int] = {}
        for i, r in enumerate(row_reqs):
            first.setdefault(r.request_id, i)
            offset = i - first[r.request_id]
            new = result.tokens[r.request_id]
            if offset < len(new) and r.params.logprobs is not None:
                emitted_rows.append(i)
                emitted_ids.append(new[offset])
        if not emitted_rows:
            return
        assert batch.max_num_logprobs is not None
        raw = logits[emitted_rows].float().log_softmax(dim=-1)
        ids = torch.tensor(emitted_ids, device=raw.device)
        lists = gather_logprobs(raw, ids, batch.max_num_logprobs).to_lists(
            [row_reqs[i].params.logprobs for i in emitted_rows]
        )
        for i, lp in zip(emitted_rows, lists, strict=True):
            if lp is not None:
                result.logprobs.setdefault(row_reqs[i].request_id, []).append(lp)


def _score_prompts(
    logits: torch.Tensor,  # [num_scored_rows, vocab]
    scored: list[tuple[Request, list[int]]],
    result: StepResult,
) -> None:
    """The prompt tokens' logprobs, each in the raw model distribution of the row before it."""
    raw = logits.float().log_softmax(dim=-1)
    ids = torch.tensor([t for _, tokens in scored for t in tokens], device=raw.device)
    counts = [r.params.prompt_logprobs for r, tokens in scored for _ in tokens]
    lists = gather_logprobs(raw, ids, max(n or 0 for n in counts)).to_lists(counts)
    start = 0
    for r, tokens in scored:
        chunk = lists[start : start + len(tokens)]
        result.prompt_logprobs[r.request_id] = [lp for lp in chunk if lp is not None]
        start += len(tokens)


def _draft_probs(
    verify: list[tuple[ScheduledRequest, int]], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[num_reqs, max_k, vocab] q of every draft (one-hot rows for one-hot drafts), or None when
    every draft in the step is one-hot."""
    if all(s.request.spec_draft_probs is None for s, _ in verify):
        return None
    max_k = max(len(s.draft_token_ids) for s, _ in verify)
    q = torch.zeros(len(verify), max_k, vocab_size, device=device)
    for i, (s, _) in enumerate(verify):
        k = len(s.draft_token_ids)
        probs = s.request.spec_draft_probs
        if probs is None:
            q[i, torch.arange(k, device=device), torch.tensor(s.draft_token_ids, device=device)] = (
                1.0
            )
        else:
            q[i, :k] = probs[:k]  # the scheduler may have cut the drafts short
    return q
