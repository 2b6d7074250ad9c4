"""Which KV heads each prefill rank sends each decode rank in a per-rank transfer.

Both sides hold contiguous head ranges per rank (tandem/engine/tp/shard.py). A head that several
prefill ranks hold (replicated: more ranks than KV heads) is sent once, by the lowest of them;
each decode rank gets every head it holds, so a head replicated over several decode ranks goes
to each. One stream per (prefill rank, decode rank) that share a head, carrying the heads they
share: fewer prefill ranks than decode ranks split a rank's heads over several streams (fan-out),
more assemble a decode rank's heads from several (fan-in), equal sizes pair rank with rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankStream:
    prefill_rank: int
    decode_rank: int
    heads: range  # of the model's KV heads


def rank_streams(prefill: Sequence[range], decode: Sequence[range]) -> list[RankStream]:
    """The streams between prefill ranks holding `prefill[p]` and decode ranks holding
    `decode[d]`, by prefill rank then decode rank. ValueError when the two sides do not hold
    the same heads (another model)."""
    held = {h for heads in prefill for h in heads}
    wanted = {h for heads in decode for h in heads}
    if held != wanted:
        raise ValueError(
            f"the prefill ranks hold KV heads {sorted(held)}, the decode ranks {sorted(wanted)}"
        )
    streams, sent = [], 0  # heads [0, sent) have a sender
    for p, heads in enumerate(prefill):
        own = range(max(heads.start, sent), heads.stop)
        if not own:
            continue
        sent = own.stop
        for d, theirs in enumerate(decode):
            shared = range(max(own.start, theirs.start), min(own.stop, theirs.stop))
            if shared:
                streams.append(RankStream(p, d, shared))
    return streams
