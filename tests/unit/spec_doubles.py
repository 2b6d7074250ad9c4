"""Test doubles for speculative decoding through the real engine.

`HashLM` is a target model over a tiny vocabulary whose next-token logits (float64) are a hash of
the whole prefix, and it reads that prefix back through the paged KV cache with the engine's real
attention backend. Each token writes `token + 1` into the value channel of its own position
(zero queries and keys make attention a uniform average over the visible slots, so
`mean * (position + 1)` recovers the visible prefix exactly). A rejected draft whose slot stayed
visible, a slot missing after rollback or preemption, or a stale slot of a shared block would
change the prefix the model sees, hence its distribution; a slot beyond the token's position
being visible raises at once.

`HashDraft` is a proposer that samples drafts from another prefix hash and hands over q, the
distribution it sampled from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from tandem.config import EngineConfig
from tandem.engine import engine_core as engine_module
from tandem.engine import executor as executor_module
from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.engine.dtypes import model_device, model_dtype
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request
from tandem.engine.spec.proposer import Draft, Proposer, StepHidden
from tandem.model_config import ModelConfig

VOCAB = 5
MAX_LEN = 16  # positions, = head_dim: one value channel per position
TARGET_SALT = 1
DRAFT_SALT = 2
DRAFT_MIX = 0.5  # weight of the draft's own hash in its logits: q near p, not p
LOGIT_SCALE = 1.5  # standard deviation of the logits


def mix(x: np.ndarray) -> np.ndarray:  # uint64 -> uint64
    """splitmix64's finalizer: a bijection that spreads every input bit over the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def extend(hashes: np.ndarray, tokens: np.ndarray) -> np.ndarray:  # [n] uint64, [n] int
    """Rolling hash: the hash of each prefix with one more token."""
    return mix(hashes * np.uint64(VOCAB + 1) + tokens.astype(np.uint64) + np.uint64(1))


def prefix_hash(salt: int, shifted: np.ndarray) -> np.ndarray:  # [n] uint64
    """Hash of each whole prefix; `shifted` is [n, L] tokens + 1, 0 past each prefix's end."""
    hashes = mix(np.full(len(shifted), salt, dtype=np.uint64))
    for column in shifted.T:
        hashes = np.where(column > 0, extend(hashes, column - 1), hashes)
    return hashes


def hash_logits(hashes: np.ndarray) -> np.ndarray:  # [n] uint64 -> [n, VOCAB] float64
    """Logits uniform in [-a, a] (standard deviation LOGIT_SCALE), one hash per token."""
    bits = mix(hashes[:, None] ^ np.arange(1, VOCAB + 1, dtype=np.uint64))  # [n, VOCAB]
    uniform = (bits >> np.uint64(11)).astype(np.float64) / 2.0**53  # [0, 1)
    return LOGIT_SCALE * np.sqrt(3.0) * (2.0 * uniform - 1.0)


def softmax(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    """[n, VOCAB] softmax(logits / temperature) over each row's top_k tokens (0: all), the
    distribution the engine samples from."""
    scaled = logits / temperature
    if top_k:
        kth = np.sort(scaled, axis=1)[:, -top_k, None]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def shifted_rows(sequences: Sequence[Sequence[int]]) -> np.ndarray:  # [n, MAX_LEN] int64
    rows = np.zeros((len(sequences), MAX_LEN), dtype=np.int64)
    for row, tokens in zip(rows, sequences, strict=True):
        row[: len(tokens)] = np.asarray(tokens) + 1
    return rows


class HashLM:
    """The target: p(next | prefix) = softmax(hash_logits(prefix_hash(TARGET_SALT, prefix)));
    see the module docstring for how it reads the prefix out of the KV cache."""

    def __init__(self, backend: AttentionBackend, dtype: torch.dtype, device: torch.device):
        self.cfg = ModelConfig(
            architecture="llama",
            vocab_size=VOCAB,
            hidden_size=MAX_LEN,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=MAX_LEN,
            max_position_embeddings=MAX_LEN,
        )
        self.backend = backend
        self.dtype = dtype
        self.device = device

    def __call__(
        self,
        input_ids: Tensor,  # [num_tokens]
        positions: Tensor,  # [num_tokens]
        kv_caches: list[Tensor],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> Tensor:  # [num_tokens, MAX_LEN] float64: the visible prefix, token + 1 per position
        n = input_ids.shape[0]
        rows = torch.arange(n, device=self.device)
        values = torch.zeros(n, MAX_LEN, dtype=self.dtype, device=self.device)
        values[rows, positions] = (input_ids + 1).to(self.dtype)
        zeros = torch.zeros_like(values)
        mean = self.backend.forward(zeros, zeros, values, kv_caches[0], meta)  # [n, MAX_LEN]
        if after_layer is not None:
            after_layer(0)
        digits = mean.double() * (positions + 1).unsqueeze(1).double()  # [n, MAX_LEN]
        seen = digits.round()
        if (digits - seen).abs().max() > 1e-3:
            raise AssertionError("attention did not weigh the visible slots uniformly")
        expected = torch.arange(MAX_LEN, device=self.device) <= positions.unsqueeze(1)
        if not torch.equal(seen > 0, expected) or bool((seen > VOCAB).any()):
            raise AssertionError("attention saw other slots than positions 0..t of each token")
        return seen

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [n, VOCAB] float64
        shifted = hidden.cpu().numpy().astype(np.int64)
        logits = hash_logits(prefix_hash(TARGET_SALT, shifted))
        return torch.from_numpy(logits).to(self.device)


class HashDraft(Proposer):
    """Drafts sampled from q = softmax(target logits + DRAFT_MIX * another hash's logits),
    handed over with that q."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        if not batch:
            return []
        shifted = shifted_rows([req.all_token_ids for req, _ in batch])
        target, own = prefix_hash(TARGET_SALT, shifted), prefix_hash(DRAFT_SALT, shifted)
        max_k = max(k for _, k in batch)
        tokens = np.zeros((len(batch), max_k), dtype=np.int64)
        probs = np.zeros((len(batch), max_k, VOCAB))
        for i in range(max_k):
            q = softmax(hash_logits(target) + DRAFT_MIX * hash_logits(own))  # [n, VOCAB]
            drawn = (q.cumsum(axis=1) < self.rng.random((len(batch), 1))).sum(axis=1)
            tokens[:, i] = np.minimum(drawn, VOCAB - 1)
            probs[:, i] = q
            target, own = extend(target, tokens[:, i]), extend(own, tokens[:, i])
        return [
            Draft(tokens[row, :k].tolist(), torch.from_numpy(probs[row, :k]))
            for row, (_, k) in enumerate(batch)
        ]


def hash_engine(proposer: Proposer | None = None, **options: Any) -> EngineCore:
    """A real `EngineCore` (scheduler, paged KV cache, runner, SDPA attention, verification)
    around a `HashLM`, speculating with the n-gram proposer of `speculative`, or `proposer`."""
    config = EngineConfig.create("hash-lm", **options)
    settings = config.model

    def load_hash_lm(path: Path, backend_cls: type[AttentionBackend], block_size: int, *_: Any):
        backend = backend_cls(1, 1, MAX_LEN, block_size)
        return HashLM(backend, model_dtype(settings), model_device(settings))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module.hub, "resolve", Path)
        patch.setattr(executor_module, "load_model", load_hash_lm)
        engine = EngineCore(config)
    if proposer is not None:
        assert engine.spec_decoder is not None, "pass speculative= for the engine's spec settings"
        engine.spec_decoder.proposer = proposer
    return engine
