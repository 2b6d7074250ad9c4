"""What a generation hands back besides text: the logprobs of a sampled token (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """One request's logprobs for one sampled token, in the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
