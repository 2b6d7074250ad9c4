"""EAGLE draft head (Li et al. 2024, EAGLE-1): one decoder layer that extrapolates the target's
final hidden state, drafting a chain of tokens.

Per position j of a request, with x the tokens and h the target's final (normed) hidden states:

    f_j = layer(fc(cat(embed(x_{j+1}), h_j)))     f_j ~ h_{j+1}
    the draft of x_{j+2} is sampled from q = lm_head(f_j) processed under the request's params

`embed` and `lm_head` are the target's. The layer is a Llama decoder layer without input norm (as
EAGLE-1's first layer) and without final norm, with its own one-layer paged KV and RoPE at the
target's positions. The first draft of a request whose last token is x_n comes from f_{n-1};
draft i + 1 feeds the pair (f, draft i) at the next position, on the head's own output.

The head must see every position's pair (h_j, x_{j+1}), so the proposer buffers the hidden states
each step hands it (prefill chunks, decodes, verified rows, rejected ones until overwritten) per
request, and writes a position into the head's KV once its next token is final
(j < num_computed_tokens), in one batched catch-up forward when the request next drafts.

Request state (created at the first step that computes the request, dropped by `release`):

    base     the first position the proposer has a hidden state for: the head's context starts
    done     positions [base, done) are in the head's KV
    pending  hidden states of positions [done, done + len(pending))
    feature  f_{done-1}, which drafts when nothing new arrived (a request skipped by a step)

A preemption changes none of it (the head's KV is its own, and recomputed positions hold the same
tokens): rows already consumed are ignored when the recompute hands them over again.

Handover: on a decode worker the prompt's KV arrives from the prefill worker, which computed the
prompt; when that worker runs the same proposer, it sends the prompt's hidden states along
(`handover_state`, in the transfer's trailer) and the context starts as if the prompt had been
computed here (`adopt_state`; the catch-up writes the head's KV at the first draft).

Missing prefix: without a handover (a prefill worker without the head, a prompt longer than
MAX_HANDOVER_POSITIONS) the prompt's hidden states are missing, and a prefix-cache hit skips
computing (so seeing) the cached blocks. The head's
context then starts at the first position it has a hidden state for (base > 0): its attention
sees the positions from there on, while each h_j still carries the whole prompt through the
target's own attention. The acceptance this costs is measured in docs/engine.md.

KV: one tensor per head layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]` in the model
dtype, with its own block bookkeeping (a `KVCacheManager` without prefix caching, as many blocks
as the target's pool): slot i of a request holds position base + i, so a missing prefix costs no
slots, and no block is shared between requests (the target shares prefix-cache blocks, but the
head's KV at a block's last position depends on the token after the block). Slots past `done`
hold drafts and are overwritten by the next catch-up. When blocks are short a request drafts
fewer tokens or none; nothing is preempted. A request that never drafts (opted out, or the batch
is past `disable_batch_size`) keeps its hidden states buffered until it drafts or leaves: one
hidden-size row per token (for SmolLM2 ~5% of the target's KV per token).

Checkpoints: the public EAGLE-1/EAGLE-2 draft layout (SafeAILab/EAGLE): a Llama `config.json`
(`num_hidden_layers: 1`; `bias`, default true, for fc) and `model.safetensors` or
`pytorch_model.bin` with `fc.weight`, `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, and in
some `embed_tokens.weight` (skipped: the target's is used). Ours (`tandem spec train --method
eagle`) is the same names and config plus `"method": "eagle"` and the base model (heads.py).
EAGLE-3 heads (`midlayer.*`, a draft vocabulary) are refused. Tree drafts are not built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tandem.engine.attention import (
    MAX_BATCHED_QUERY_LEN,
    AttentionBackend,
    AttentionMetadata,
    SeqSpec,
)
from tandem.engine.kv_cache import KVCacheManager
from tandem.engine.models.llama import DecoderLayer, LlamaForCausalLM, fused_target
from tandem.engine.models.loader import iter_weights
from tandem.engine.models.rope import RotaryEmbedding
from tandem.engine.request import Request
from tandem.engine.spec.draft_sampling import DraftChain, extend_chains
from tandem.engine.spec.draft_vocab import LMHead
from tandem.engine.spec.heads import (
    check_fits,
    hf_config,
    hf_tensors,
    read_config,
    save_heads,
    warn_if_other_model,
)
from tandem.engine.spec.proposer import NO_DRAFT, Draft, Proposer, StepHidden
from tandem.model_config import ModelConfig, load_config

log = logging.getLogger(__name__)


class _NoInputNorm(nn.Module):
    """EAGLE-1's layer has no input norm; attention still takes the model dtype (the residual
    stream is float32)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.dtype)


class EagleHead(nn.Module):
    """fc(cat(embed, hidden)) -> decoder layer(s) -> features; embed and LM head are the
    target's."""

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        fc_bias: bool,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`cfg`: the head's layer shape (num_layers layers); `max_positions`: the RoPE table,
        the target's context rather than the head config's (EAGLE's configs say 2048)."""
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.dtype = dtype
        self.fc = nn.Linear(
            2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, dtype, device) for _ in range(cfg.num_layers)
        )
        self.layers[0].add_module("input_layernorm", _NoInputNorm(dtype))
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )

    def forward(
        self,
        embeds: Tensor,  # [num_tokens, hidden] the next tokens' embeddings
        hidden: Tensor,  # [num_tokens, hidden] target states (or the head's own features)
        positions: Tensor,  # [num_tokens]
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
    ) -> Tensor:  # [num_tokens, hidden] float32 features, each ~ the next target state
        x = self.fc(torch.cat([embeds, hidden.to(self.dtype)], dim=-1)).float()
        cos_sin = self.rope(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(cos_sin, x, kv_cache, meta)
        return x

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, Tensor]], source: Path) -> None:
        """Copy tensors named as in EAGLE's checkpoints in, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            if name == "embed_tokens.weight":
                continue  # the target's embedding is used
            if name.startswith("midlayer."):
                raise ValueError(f"{source} is an EAGLE-3 head ({name!r}); EAGLE-1/2 only")
            target, offset = (
                (name, None) if name.startswith("fc.") else fused_target(f"model.{name}", self.cfg)
            )
            if target is None or target not in params:
                raise ValueError(f"unexpected weight {name!r} in the EAGLE head at {source}")
            param = params[target]
            dst = param if offset is None else param[offset : offset + tensor.shape[0]]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"{name} in {source}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            missing.discard(target)
        if missing:
            raise ValueError(f"the EAGLE head at {source} lacks {sorted(missing)[:8]}")


def load_eagle(
    path: str | Path,
    target: LlamaForCausalLM,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> EagleHead:
    """A head in EAGLE's layout (or ours, the same plus base-model fields), refused unless it
    fits the target."""
    path = Path(path)
    config = read_config(path)
    cfg = load_config(path)  # the head layer's Llama config
    check_fits(path, "eagle", cfg.hidden_size, cfg.vocab_size, target.cfg)
    if config.get("method") == "eagle":
        warn_if_other_model(path, config, target)
    backend = type(target.backend)(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    max_positions = max(cfg.max_position_embeddings, target.cfg.max_position_embeddings)
    head = EagleHead(cfg, backend, bool(config.get("bias", True)), max_positions, dtype, device)
    head.load_hf_weights(_weights(path), path)
    return head.eval()


def save_eagle(head: EagleHead, out: str | Path, base: dict[str, str]) -> None:
    """EAGLE's layout plus our fields; `base` from `heads.base_model_fields`."""
    config = {**hf_config(head.cfg), "bias": head.fc.bias is not None, "method": "eagle", **base}
    save_heads(Path(out), hf_tensors(head, head.cfg), config)


def _weights(path: Path) -> Iterator[tuple[str, Tensor]]:
    if (path / "pytorch_model.bin").is_file() and not (path / "model.safetensors").is_file():
        state: dict[str, Tensor] = torch.load(
            path / "pytorch_model.bin", map_location="cpu", weights_only=True
        )
        return iter(state.items())
    return iter_weights(path)


@dataclass
class _Seq:
    """One request's state in the head (see the module docstring)."""

    base: int
    done: int
    pending: Tensor  # [n, hidden] target states of positions [done, done + n)
    feature: Tensor | None = None  # [hidden] float32 f_{done - 1}


@dataclass
class _Job:
    """One request's drafting in one `propose` call."""

    seq: _Seq
    chain: DraftChain
    block_table: list[int]
    num_new: int  # positions to catch up: [seq.done, seq.done + num_new)
    feature: Tensor | None = None  # [hidden] the head's latest output (set by the catch-up)

    @property
    def latest(self) -> Tensor:
        assert self.feature is not None  # catch-up or the request's state sets it
        return self.feature


# What a prefill worker hands over with a prompt (`handover_state`): the target's hidden states
# of positions [first, first + n), [n, hidden_size], and first as a [1] tensor.
HIDDEN_STATES = "eagle.hidden_states"
FIRST_POSITION = "eagle.first_position"
MAX_HANDOVER_POSITIONS = 8192  # ~19 MB at SmolLM2's float32 hidden size; the trailer holds 64 MB


class EagleProposer(Proposer):
    def __init__(
        self,
        head: EagleHead,
        embed: Callable[[Tensor], Tensor],
        lm_head: LMHead,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.head = head
        self.embed = embed  # the target's embedding (under tensor parallelism: tp/vocab.py)
        self.lm_head = lm_head  # the target's, or over a draft vocabulary (draft_vocab.py)
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        cfg = head.cfg
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=head.dtype, device=device) for _ in range(cfg.num_layers)
        ]
        self._seqs: dict[str, _Seq] = {}

    @torch.inference_mode()
    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        if hidden is not None:
            self._absorb(hidden)
        jobs = [job for req, k in batch if (job := self._start(req, k)) is not None]
        if jobs:
            self._catch_up([j for j in jobs if j.num_new])
            for step in range(max(j.chain.k for j in jobs)):
                live = [j for j in jobs if j.chain.k > step]
                if step:
                    self._feed_drafts(live, step)
                features = torch.stack([j.latest for j in live])  # [len(live), hidden]
                logits = self.lm_head(features.to(self.head.dtype))
                extend_chains([j.chain for j in live], logits, self.eos_token_ids)
        drafts = {j.chain.request.request_id: j.chain.draft() for j in jobs}
        return [drafts.get(req.request_id, NO_DRAFT) for req, _ in batch]

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.kv_cache.free(request_id)

    def handover_state(self, request_id: str) -> dict[str, Tensor]:
        """The prompt's hidden states (the last MAX_HANDOVER_POSITIONS of them)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.done != seq.base or not len(seq.pending):
            return {}
        states = seq.pending[-MAX_HANDOVER_POSITIONS:]
        first = seq.done + len(seq.pending) - len(states)
        return {HIDDEN_STATES: states, FIRST_POSITION: torch.tensor([first])}

    def adopt_state(self, request_id: str, state: dict[str, Tensor]) -> None:
        """Start the request's context at the prefill worker's hidden states, as if this engine
        had computed the prompt (nothing else is checked against them: a wrong shape is
        ignored, and the context then starts at the first decoded position)."""
        states, first = state.get(HIDDEN_STATES), state.get(FIRST_POSITION)
        if states is None or first is None:
            return
        if states.dim() != 2 or states.shape[1] != self.head.cfg.hidden_size or first.numel() != 1:
            log.warning("ignoring EAGLE hidden states of shape %s", tuple(states.shape))
            return
        position = int(first.item())
        self.kv_cache.free(request_id)
        self._seqs[request_id] = _Seq(position, position, states.to(self.device))

    def _absorb(self, hidden: StepHidden) -> None:
        """Buffer the step's target states of every request it computed."""
        for request_id, (row, first, num) in hidden.spans.items():
            rows = hidden.states[row : row + num]  # [num, hidden], positions [first, first + num)
            seq = self._seqs.get(request_id)
            if seq is None or first > seq.done + len(seq.pending):
                # New, or (defensively) a gap of positions never seen: the context starts here.
                self.kv_cache.free(request_id)
                self._seqs[request_id] = _Seq(first, first, rows.clone())
                continue
            skip = max(0, seq.done - first)  # rows of positions already in the head's KV
            if skip < num:
                keep = first + skip - seq.done  # newer rows replace older ones from here
                seq.pending = torch.cat([seq.pending[:keep], rows[skip:]])

    def _start(self, req: Request, k: int) -> _Job | None:
        """Reserve the head's KV slots for the catch-up and k - 1 fed drafts."""
        seq = self._seqs.get(req.request_id)
        if seq is None:
            return None
        num_new = req.num_computed_tokens - seq.done
        if num_new > len(seq.pending) or (num_new == 0 and seq.feature is None):
            return None
        while k > 0 and not self.kv_cache.allocate(
            req.request_id, (), seq.done - seq.base, num_new + k - 1
        ):
            k -= 1
        if k == 0:
            return None
        table = self.kv_cache.block_table(req.request_id)
        return _Job(seq, DraftChain(req, k), table, num_new, seq.feature)

    def _catch_up(self, jobs: list[_Job]) -> None:
        """Write each job's new final positions into the head's KV; its feature is the last."""
        jobs = sorted(jobs, key=lambda j: j.num_new > MAX_BATCHED_QUERY_LEN)  # short first
        token_ids: list[int] = []
        positions: list[int] = []
        states: list[Tensor] = []
        seqs: list[SeqSpec] = []
        for j in jobs:
            seq, tokens = j.seq, j.chain.request.all_token_ids
            token_ids += tokens[seq.done + 1 : seq.done + j.num_new + 1]  # x_{p+1} for each p
            positions += range(seq.done, seq.done + j.num_new)
            states.append(seq.pending[: j.num_new])
            seqs.append(SeqSpec(seq.done - seq.base, j.num_new, j.block_table))
        features = self._forward(token_ids, torch.cat(states), positions, seqs)
        last = 0
        for j in jobs:
            last += j.num_new
            j.feature = j.seq.feature = features[last - 1]
            j.seq.done += j.num_new
            j.seq.pending = j.seq.pending[j.num_new :]

    def _feed_drafts(self, jobs: list[_Job], step: int) -> None:
        """Draft `step`: feed (feature, previous draft) at the position after the last fed."""
        features = self._forward(
            [j.chain.token_ids[-1] for j in jobs],
            torch.stack([j.latest for j in jobs]),
            [j.seq.done + step - 1 for j in jobs],
            [SeqSpec(j.seq.done - j.seq.base + step - 1, 1, j.block_table) for j in jobs],
        )
        for j, feature in zip(jobs, features, strict=True):
            j.feature = feature

    def _forward(
        self, token_ids: list[int], states: Tensor, positions: list[int], seqs: list[SeqSpec]
    ) -> Tensor:  # [num_tokens, hidden] float32
        dev = self.device
        ids = torch.tensor(token_ids, device=dev)
        meta = self.head.backend.build_metadata(seqs, dev)
        return self.head(
            self.embed(ids),
            states,
            torch.tensor(positions, device=dev),
            self.kv_caches,
            meta,
        )
