"""Model-based drafts: a smaller draft model with its own paged KV, or the target's own first N
layers (layer-skip self-draft).

A draft model shares the target's tokenizer and keeps one KV tensor per draft layer with the
target's `num_blocks` and `block_size`, indexed by the target's block tables: a request's draft
KV lives in the same block ids as its target KV, so there is no second allocator and freeing a
request frees both. The layer-skip draft runs the target's first N layers, its final norm and its
LM head over the target's own KV tensors of those layers: the target computed exactly those
values for every position it verified, and what the draft writes at draft positions the next
verification overwrites.

Each step, per drafted request: reserve KV slots up to position num_tokens + k - 2
(`KVCacheManager.allocate`; fewer drafts when blocks are short, never a preemption), then one
forward over the tokens the draft has not seen plus the last known token, then k - 1 one-token
forwards, batched across requests (requests with a smaller k drop out). Each draft is sampled
from q, the draft's distribution processed like the target's (penalties see the drafts so far,
temperature/top-k/top-p/min-p; greedy requests take the argmax; `draft_sampling.py`), and q
goes to the verifier. A draft model saved with a token ranking (`spec train --method draft`)
scores only its first `draft_vocab_size` tokens (`draft_vocab.py`); layer-skip, which has none,
scores the whole vocabulary.

A request's draft state (own-KV drafts only) lives from its first draft to `release`:

    new (nothing valid) --draft--> num_valid = known tokens, fed = drafts past them
      --next draft--> keep the KV of fed tokens the target accepted, recompute from the first
      rejected one; a preemption (its blocks were taken) starts over from position 0.

A request whose prompt KV was computed elsewhere (another worker, a prefix-cache hit) starts new
too, so the draft catches up over its whole prompt in one (batched) forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from tandem import hub
from tandem.config import ModelSettings, SpecConfig
from tandem.engine.attention import MAX_BATCHED_QUERY_LEN, SeqSpec
from tandem.engine.dtypes import model_device, model_dtype
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.kv_quant import kv_bytes_per_token, slot_dim
from tandem.engine.models import load_model
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.loader import load_tokenizer
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner, to_device
from tandem.engine.spec.draft_sampling import DraftChain, extend_chains
from tandem.engine.spec.draft_vocab import LMHead, draft_lm_head
from tandem.engine.spec.proposer import NO_DRAFT, Draft, Proposer, StepHidden
from tandem.model_config import load_config


@dataclass
class _DraftState:
    num_preemptions: int  # the request's count when this state was last valid
    num_valid: int = 0  # draft KV positions [0, num_valid) hold the request's known tokens
    fed: list[int] = field(default_factory=list)  # drafts fed at positions num_valid, ...

    def valid_prefix(self, token_ids: list[int]) -> int:
        """Positions whose draft KV holds `token_ids`: the known ones and the fed drafts the
        target accepted. Never the last token: its logits are needed."""
        n = self.num_valid
        for token in self.fed:
            if n >= len(token_ids) or token_ids[n] != token:
                break
            n += 1
        return min(n, len(token_ids) - 1)


@dataclass
class _Job:
    """One request's drafting in one `propose` call."""

    chain: DraftChain  # the request, its k and its drafts so far
    block_table: list[int]
    state: _DraftState
    position: int  # of the first token of the next forward
    pending: list[int]  # tokens the next forward feeds


# A draft's forward: (input_ids [num_tokens], positions [num_tokens], each request's SeqSpec,
# rows [n]) -> the logits at those rows, [n, vocab] float32; it writes the fed tokens' draft KV.
DraftLogits = Callable[[Tensor, Tensor, list[SeqSpec], Tensor], Tensor]


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: LlamaForCausalLM,
        logits: DraftLogits,
        kv_cache: KVCacheManager,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        own_kv: bool = True,
    ) -> None:
        """`model` drafts through `logits` (`own_model_logits`, or the target runner's first
        layers). `own_kv`: the KV is the draft's own and must catch up; False: it is the
        target's, valid up to each request's `num_computed_tokens`."""
        self.model = model
        self.logits = logits
        self.kv_cache = kv_cache
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.own_kv = own_kv
        self._states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        jobs = [job for req, k in batch if (job := self._start(req, k)) is not None]
        # Short queries first: the attention backend batches them in one call.
        jobs.sort(key=lambda j: len(j.pending) > MAX_BATCHED_QUERY_LEN)
        for step in range(max((j.chain.k for j in jobs), default=0)):
            live = [j for j in jobs if j.chain.k > step]
            extend_chains([j.chain for j in live], self._forward(live), self.eos_token_ids)
            for j in live:
                j.pending = j.chain.token_ids[-1:]
        drafts: dict[str, Draft] = {}
        for job in jobs:
            # The last draft was never fed; the others' KV is kept if the target accepts them.
            req, token_ids = job.chain.request, job.chain.token_ids
            job.state.num_valid, job.state.fed = req.num_tokens, token_ids[:-1]
            drafts[req.request_id] = job.chain.draft()
        return [drafts.get(req.request_id, NO_DRAFT) for req, _ in batch]

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _start(self, req: Request, k: int) -> _Job | None:
        """Reserve the request's draft KV slots and say what its first forward feeds."""
        state = self._states.get(req.request_id)
        if state is None:
            state = self._states[req.request_id] = _DraftState(req.metrics.num_preemptions)
        elif state.num_preemptions != req.metrics.num_preemptions:  # its blocks were taken
            state.num_preemptions, state.num_valid, state.fed = req.metrics.num_preemptions, 0, []
        # Positions up to num_tokens + k - 2 get KV; the draft's RoPE table may be shorter.
        k = min(k, self.model.cfg.max_position_embeddings - req.num_tokens + 1)
        request_id = req.request_id
        while k > 0 and not self.kv_cache.allocate(
            request_id, req.all_token_ids, req.num_computed_tokens, k
        ):
            k -= 1
        if k <= 0:
            return None
        start = state.valid_prefix(req.all_token_ids) if self.own_kv else req.num_computed_tokens
        table = self.kv_cache.block_table(request_id)
        return _Job(DraftChain(req, k), table, state, start, req.all_token_ids[start:])

    def _forward(self, jobs: list[_Job]) -> Tensor:  # [len(jobs), vocab] at each last token
        input_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSpec] = []
        last_rows: list[int] = []
        for j in jobs:
            input_ids += j.pending
            positions += range(j.position, j.position + len(j.pending))
            seqs.append(SeqSpec(j.position, len(j.pending), j.block_table))
            last_rows.append(len(input_ids) - 1)
            j.position += len(j.pending)
        ids, pos, rows = to_device((input_ids, positions, last_rows), self.device)
        return self.logits(ids, pos, seqs, rows)


def own_model_logits(
    model: LlamaForCausalLM, kv_caches: list[Tensor], lm_head: LMHead
) -> DraftLogits:
    """A draft model's forward over its own KV tensors (one per layer), scored by `lm_head`."""

    def logits(ids: Tensor, positions: Tensor, seqs: list[SeqSpec], rows: Tensor) -> Tensor:
        meta = model.backend.build_metadata(seqs, ids.device)
        return lm_head(model(ids, positions, kv_caches, meta)[rows])  # [num_tokens, hidden]

    return logits


def draft_kv_bytes_per_block(
    spec: SpecConfig, block_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype
) -> int:
    """KV bytes per block that the proposer of `spec` adds to the target's: a draft model's own
    layers (in the cache's format), an EAGLE head's one layer (in the model dtype); nothing for
    the others (layer-skip reads the target's cache, Medusa heads keep no KV)."""
    if spec.method == "draft":
        return kv_bytes_per_token(load_config(_draft_path(spec)), kv_dtype) * block_size
    if spec.method == "eagle":
        assert spec.path is not None  # SpecConfig requires it for method "eagle"
        return kv_bytes_per_token(load_config(spec.path), model_dtype) * block_size
    return 0


def load_draft_proposer(
    spec: SpecConfig, runner: ModelRunner, kv_cache: KVCacheManager, settings: ModelSettings
) -> DraftModelProposer:
    """The draft model of `spec.draft_model`, its weights quantized as the target's (if they
    are), refused unless it shares the target's tokenizer."""
    path = _draft_path(spec)
    target = runner.model.cfg
    draft_cfg = load_config(path)
    if draft_cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft_model {spec.draft_model!r} has vocab_size {draft_cfg.vocab_size}, "
            f"the target {target.vocab_size}: a draft must share the target's vocabulary"
        )
    if load_tokenizer(path).get_vocab() != load_tokenizer(hub.resolve(settings.model)).get_vocab():
        raise ValueError(
            f"draft_model {spec.draft_model!r} has another tokenizer than the target "
            f"{settings.model!r}: a draft must share the target's tokenizer"
        )
    block_size, device = kv_cache.block_size, model_device(settings)
    model = load_model(
        path,
        type(runner.backend),  # the target's attention backend
        block_size,
        model_dtype(settings),
        device,
        settings.quantization,
        settings.quant_group_size,
        settings.kernel_routes,
    )
    kv_dtype = runner.kv_caches[0].dtype  # the engine's KV format, quantized or not
    # [2, num_blocks, block_size, num_kv_heads, slot_dim] per draft layer, as the target's
    shape = (
        2,
        kv_cache.num_blocks,
        block_size,
        draft_cfg.num_kv_heads,
        slot_dim(kv_dtype, draft_cfg.head_dim),
    )
    caches = [
        torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(draft_cfg.num_layers)
    ]
    lm_head = draft_lm_head(path, spec.draft_vocab_size, model)
    logits = own_model_logits(model, caches, lm_head)
    return DraftModelProposer(model, logits, kv_cache, device, runner.eos_token_ids)


def layerskip_proposer(
    num_layers: int, runner: ModelRunner, kv_cache: KVCacheManager
) -> DraftModelProposer:
    """The target's first `num_layers` layers, final norm and LM head, over its own KV (under
    tensor parallelism a step every rank mirrors: `TPModelRunner.first_layers_logits`)."""
    total = runner.model.cfg.num_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"num_layers must be in [1, {total}) (the target's layers), got {num_layers}"
        )
    logits = partial(runner.first_layers_logits, num_layers)
    return DraftModelProposer(
        runner.model, logits, kv_cache, runner.device, runner.eos_token_ids, own_kv=False
    )


def _draft_path(spec: SpecConfig) -> Path:
    assert spec.draft_model is not None  # SpecConfig requires it for method "draft"
    try:
        return hub.resolve(spec.draft_model)
    except ValueError as e:
        raise ValueError(f"draft_model: {e}") from None
