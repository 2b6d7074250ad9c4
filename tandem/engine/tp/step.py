"""The step message: what rank 0 broadcasts so that every rank runs the same forward.

A step is its flattened tokens, their positions, where each request's query sits in its KV
blocks (`SeqSpec`), the rows whose logits the sampler reads, the blocks to copy before the
forward (a fork's partial last block) and how many of the model's layers it runs (all, or a
layer-skip draft's first N); the other ranks need nothing else of the scheduler. It travels as
two int64 tensors: a header of sizes (and the layer count), then the payload (tokens,
positions, each request's computed tokens, query length and block count, the block ids, the
sampled rows, the (src, dst) block pairs). A header of another kind is a control message
(`CONTROLS`): STOP ends the ranks' loop, KEEPALIVE proves the group alive while rank 0 is idle:
every rank answers it in an all-reduce (`acknowledge`), so a dead or stopped rank fails it within
the group's timeout (a worker heartbeats only while these succeed), INTEGRITY has each rank
check itself against rank 0's bookkeeping (`tandem/engine/tp/integrity.py`), RUN_SERVICE has
each rank start the service the worker runs beside the model (a per-rank KV transfer: ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from tandem.engine.attention import SeqSpec
from tandem.engine.tp.group import TPGroup

STOP, STEP, KEEPALIVE, INTEGRITY, RUN_SERVICE = 0, 1, 2, 3, 4
CONTROLS = (STOP, KEEPALIVE, INTEGRITY, RUN_SERVICE)
HEADER_LEN = 7  # kind, tokens, requests, block ids, sampled rows, block copies, layers (0: all)
# How long a rank waits for rank 0's next step (an idle engine sends none); a rank 0 that died
# ends the wait at once (its connections close).
IDLE_TIMEOUT = timedelta(days=1)


@dataclass(frozen=True)
class StepMessage:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    seqs: list[SeqSpec]  # in token order
    sample_indices: torch.Tensor  # [num_rows] int64: the rows whose logits rank 0 samples/scores
    block_copies: list[tuple[int, int]]  # (src, dst) blocks whose KV is copied first
    num_layers: int | None = None  # the first layers only (a layer-skip draft); None: all

    def send(self, group: TPGroup) -> None:
        """Rank 0: broadcast this step to the other ranks."""
        dev, blocks = group.device, [b for s in self.seqs for b in s.block_table]
        seq_fields = [
            f for s in self.seqs for f in (s.num_computed_tokens, s.query_len, len(s.block_table))
        ]
        copies = [b for pair in self.block_copies for b in pair]
        sizes = [len(self.input_ids), len(self.seqs), len(blocks), len(self.sample_indices)]
        header = [STEP, *sizes, len(self.block_copies), self.num_layers or 0]
        group.broadcast(torch.tensor(header, device=dev))
        tables = torch.tensor(seq_fields + blocks, dtype=torch.long, device=dev)
        pairs = torch.tensor(copies, dtype=torch.long, device=dev)
        parts = [self.input_ids, self.positions, tables, self.sample_indices, pairs]
        group.broadcast(torch.cat([p.to(dev, torch.long) for p in parts]))

    @classmethod
    def receive(cls, group: TPGroup) -> StepMessage | int:
        """Ranks 1..: rank 0's next step, or the kind of a control message (`CONTROLS`)."""
        header = torch.zeros(HEADER_LEN, dtype=torch.long, device=group.device)
        kind, tokens, num_seqs, num_blocks, rows, num_copies, num_layers = group.broadcast(
            header, IDLE_TIMEOUT
        ).tolist()
        if kind != STEP:
            return int(kind)
        sizes = [tokens, tokens, 3 * num_seqs, num_blocks, rows, 2 * num_copies]
        payload = torch.empty(sum(sizes), dtype=torch.long, device=group.device)
        input_ids, positions, seq_fields, blocks, sample_indices, pairs = group.broadcast(
            payload
        ).split(sizes)
        block_ids = blocks.tolist()
        seqs, start = [], 0
        for computed, query_len, num in seq_fields.view(-1, 3).tolist():
            seqs.append(SeqSpec(computed, query_len, block_ids[start : start + num]))
            start += num
        copies = [(src, dst) for src, dst in pairs.view(-1, 2).tolist()]
        return cls(input_ids, positions, seqs, sample_indices, copies, num_layers or None)


def send_control(group: TPGroup, kind: int) -> None:
    """Rank 0: a control message (`CONTROLS`) to the other ranks."""
    assert kind in CONTROLS
    group.broadcast(torch.tensor([kind] + [0] * (HEADER_LEN - 1), device=group.device))


def acknowledge(group: TPGroup) -> None:
    """Every rank, after a KEEPALIVE: an all-reduce that needs each rank's part, so rank 0's
    keep-alive is a round trip (a broadcast alone completes without a stopped rank)."""
    group.all_reduce(torch.zeros(1, device=group.device))
