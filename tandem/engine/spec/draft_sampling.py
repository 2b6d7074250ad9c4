"""Draft tokens from a drafter's logits, sampled the way the target samples.

A model-based drafter (Medusa heads, an EAGLE head) turns its logits into q, the distribution the
target would sample from under the request's parameters (penalties seeing the drafts so far,
temperature, top-k/top-p/min-p; greedy requests take the argmax), and draws its draft from q. The
verifier gets q back, so speculative sampling stays exact whatever the drafter's quality.

Seeded requests draw from a generator seeded with (seed ^ DRAFT_SALT, output position of the
draft): their drafts, hence their outputs, are reproducible, and the draft noise is independent of
the verification noise (the runner reseeds the request's own generator with the plain seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.engine.request import Request
from tandem.engine.sampler import (
    SamplingBatch,
    apply_penalties,
    processed_probs,
    sample_from_probs,
    seed_for_position,
)
from tandem.engine.spec.proposer import Draft

DRAFT_SALT = 0x6472_6166_7420_7370  # mixed into a seeded request's seed for its draft draws


@dataclass
class DraftChain:
    """One request's drafts within one proposal, at most `k`."""

    request: Request
    k: int
    token_ids: list[int] = field(default_factory=list)
    probs: list[Tensor] = field(default_factory=list)  # [vocab] q of each draft (sampled rows)

    def draft(self) -> Draft:
        probs = torch.stack(self.probs) if self.probs else None  # greedy: one-hot, None
        return Draft(list(self.token_ids), probs)


def extend_chains(
    chains: Sequence[DraftChain],
    logits: Tensor,  # [len(chains), vocab] float32
    eos_token_ids: Sequence[int],
) -> None:
    """Append one draft to each chain, sampled from q of its row of `logits`."""
    requests = [c.request for c in chains]
    device = logits.device
    generators = [
        _generator(r, len(c.token_ids), device) for r, c in zip(requests, chains, strict=True)
    ]
    batch = SamplingBatch.build(
        [r.params for r in requests],
        generators,
        [r.prompt_token_ids for r in requests],
        [[*r.output_token_ids, *c.token_ids] for r, c in zip(requests, chains, strict=True)],
        logits.shape[1],
        device,
        eos_token_ids,
    )
    penalized = apply_penalties(logits, batch)
    if batch.all_greedy:
        for chain, token in zip(chains, penalized.argmax(dim=-1).tolist(), strict=True):
            chain.token_ids.append(token)
        return
    probs = processed_probs(penalized, batch)  # [len(chains), vocab]
    tokens = sample_from_probs(probs, batch).tolist()
    for chain, token, q in zip(chains, tokens, probs, strict=True):
        chain.token_ids.append(token)
        if not chain.request.params.greedy:
            chain.probs.append(q)


def _generator(request: Request, num_drafted: int, device: torch.device) -> torch.Generator | None:
    """A seeded sampled request's generator for its next draft; None for the others."""
    seed = request.params.seed
    if seed is None or request.params.greedy:
        return None
    position = request.params.output_offset + len(request.output_token_ids) + num_drafted
    return torch.Generator(device).manual_seed(seed_for_position(seed ^ DRAFT_SALT, position))
