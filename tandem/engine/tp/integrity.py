"""Every rank's integrity check: the ranks agree with rank 0's block bookkeeping.

Block bookkeeping (block tables, ref counts, the prefix cache) lives on rank 0 alone
(`KVCacheManager`); ranks 1.. allocate nothing and hold no block live of their own: they write
and read the blocks the step messages name. So a rank goes wrong by running other steps than
rank 0 sent (a lost or misread message would write KV into blocks rank 0 never assigned it, or
freed), or by holding a cache that is not the shard rank 0's block ids index. Each rank keeps a
`StepLedger` of the steps it ran: their number and a CRC-32 chained over their block tables and
block copies (the same ints rank 0 keeps of the steps it sent); a few int ops per step.

`check_ranks` (rank 0, between steps; the engine's `check_integrity` after rank 0's own
bookkeeping check) sends INTEGRITY and broadcasts its view (`rank_view`): its ledger and its
cache's layout (layers, [2, num_blocks, block_size, heads, slot_dim], dtype). Every rank
compares its own (`answer_integrity`: the same count and digest, the same layout, as the ranks
hold equally many heads of the same blocks) and rank 0 gathers each rank's verdict, a short
utf-8 message (empty: agreed), raising AssertionError naming the first rank that disagrees.
Collectives: a broadcast of the control header, one of 9 ints, one gather of 256 bytes a rank.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass

import torch

from tandem.engine.tp.group import TPGroup
from tandem.engine.tp.step import INTEGRITY, StepMessage, send_control

VERDICT_BYTES = 256  # a rank's verdict, utf-8, zero-padded (gathers need equal shapes)


@dataclass
class StepLedger:
    """The steps a rank ran (rank 0: sent): how many, and a digest of their block tables."""

    steps: int = 0
    digest: int = 0  # CRC-32 chained over each step's block tables and copies

    def record(self, step: StepMessage) -> None:
        ints = array("q")
        for seq in step.seqs:
            ints.extend((seq.num_computed_tokens, seq.query_len, len(seq.block_table)))
            ints.extend(seq.block_table)
        for pair in step.block_copies:
            ints.extend(pair)
        self.steps += 1
        self.digest = zlib.crc32(ints.tobytes(), self.digest)


def rank_view(ledger: StepLedger, caches: list[torch.Tensor]) -> list[int]:
    """What every rank must match of rank 0's: its ledger and its KV cache's layout (the
    layers, one layer's [2, num_blocks, block_size, heads, slot_dim], the dtype's CRC)."""
    first = caches[0]
    dtype = zlib.crc32(str(first.dtype).encode())
    return [ledger.steps, ledger.digest, len(caches), *first.shape, dtype]


def disagreement(rank0: list[int], own: list[int], caches: list[torch.Tensor]) -> str:
    """What of a rank's view (`own`, of its `caches`) differs from rank 0's; empty if nothing."""
    if own[0] != rank0[0]:
        return f"ran {own[0]} steps, rank 0 sent {rank0[0]}"
    if own[1] != rank0[1]:
        return f"ran other block tables than the {rank0[0]} steps rank 0 sent"
    if own[2:] != rank0[2:]:
        dtype = "" if own[8] == rank0[8] else f" (its dtype: CRC-32 {rank0[8]:#x})"
        return (
            f"holds {own[2]} layers of KV cache of {list(own[3:8])} {caches[0].dtype}, "
            f"rank 0 {rank0[2]} of {list(rank0[3:8])}{dtype}"
        )
    return ""


def check_ranks(group: TPGroup, ledger: StepLedger, caches: list[torch.Tensor]) -> None:
    """Rank 0, between steps: have every rank compare itself with rank 0's view; raise
    AssertionError naming the first rank that disagrees, and what."""
    if group.broken:
        raise AssertionError("a tensor-parallel rank was lost: the ranks cannot be checked")
    send_control(group, INTEGRITY)
    dev = group.device
    group.broadcast(torch.tensor(rank_view(ledger, caches), device=dev))
    verdicts = group.gather_rows(torch.zeros(1, VERDICT_BYTES, dtype=torch.uint8, device=dev))
    for rank, row in enumerate(verdicts.tolist()):
        verdict = bytes(row).rstrip(b"\0").decode(errors="replace")
        if verdict:
            raise AssertionError(f"tensor-parallel rank {rank} of {group.size} {verdict}")


def answer_integrity(group: TPGroup, ledger: StepLedger, caches: list[torch.Tensor]) -> None:
    """Ranks 1.., after an INTEGRITY message: compare with rank 0's view, send the verdict."""
    own = rank_view(ledger, caches)
    rank0 = group.broadcast(torch.zeros(len(own), dtype=torch.long, device=group.device))
    verdict = disagreement(rank0.tolist(), own, caches).encode()[:VERDICT_BYTES]
    row = torch.zeros(1, VERDICT_BYTES, dtype=torch.uint8)
    if verdict:
        row[0, : len(verdict)] = torch.frombuffer(bytearray(verdict), dtype=torch.uint8)
    group.gather_rows(row.to(group.device))
