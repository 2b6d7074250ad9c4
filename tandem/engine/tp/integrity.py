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
cache's layout (layers, [2, num_blocks, block_size, heads, slot_dim], dtype), and its
allocator's live blocks (those some block table holds). Every rank compares its own
(`answer_integrity`: the same count and digest, the same layout, as the ranks hold equally many
heads of the same blocks) and hashes its KV in the live blocks; rank 0 gathers each rank's
verdict, a short utf-8 message (empty: agreed), and the hashes, and raises AssertionError naming
the first rank that disagrees, or whose KV in the live blocks differs from another holder's of
the same (replicated) KV heads: every write, a forward's or a KV transfer's, reaches all holders.
Collectives: 3 broadcasts (header, 10 ints, the live block ids), 2 gathers (256 bytes, 1 int a
rank); each rank copies its live blocks' KV to the host once to hash it (a check for tests).
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


def live_kv_digest(caches: list[torch.Tensor], live: list[int]) -> int:
    """CRC-32 of the bytes `caches` hold in the blocks `live`, every layer."""
    digest = 0
    if not live:
        return digest
    index = torch.tensor(live, device=caches[0].device)
    for cache in caches:  # [2, num_blocks, block_size, heads, slot_dim]
        data = cache[:, index].contiguous().view(torch.uint8).cpu().numpy()
        digest = zlib.crc32(data.tobytes(), digest)
    return digest


def check_ranks(
    group: TPGroup,
    ledger: StepLedger,
    caches: list[torch.Tensor],
    live: list[int],
    first_heads: list[int],
) -> None:
    """Rank 0, between steps: have every rank compare itself with rank 0's view, and the ranks
    that hold the same KV heads (`first_heads[r]`: rank r's first; replicated heads when
    several ranks share one) the same KV in the blocks `live` (rank 0's referenced blocks);
    raise AssertionError naming the first rank that disagrees, and what."""
    if group.broken:
        raise AssertionError("a tensor-parallel rank was lost: the ranks cannot be checked")
    send_control(group, INTEGRITY)
    dev = group.device
    group.broadcast(torch.tensor([*rank_view(ledger, caches), len(live)], device=dev))
    if live:
        group.broadcast(torch.tensor(live, device=dev))
    verdicts = group.gather_rows(torch.zeros(1, VERDICT_BYTES, dtype=torch.uint8, device=dev))
    digest = torch.tensor([[live_kv_digest(caches, live)]], device=dev)
    digests = group.gather_rows(digest)[:, 0].tolist()
    for rank, row in enumerate(verdicts.tolist()):
        verdict = bytes(row).rstrip(b"\0").decode(errors="replace")
        if verdict:
            raise AssertionError(f"tensor-parallel rank {rank} of {group.size} {verdict}")
    holder: dict[int, int] = {}  # first head -> the first rank holding it
    for rank, first in enumerate(first_heads):
        other = holder.setdefault(first, rank)
        if digests[rank] != digests[other]:
            raise AssertionError(
                f"tensor-parallel rank {rank} of {group.size} holds other KV than rank {other} "
                f"in the {len(live)} live blocks of the KV heads both hold (from head {first})"
            )


def answer_integrity(group: TPGroup, ledger: StepLedger, caches: list[torch.Tensor]) -> None:
    """Ranks 1.., after an INTEGRITY message: compare with rank 0's view, send the verdict and
    the digest of the live blocks' KV."""
    own = rank_view(ledger, caches)
    dev = group.device
    *rank0, num_live = group.broadcast(
        torch.zeros(len(own) + 1, dtype=torch.long, device=dev)
    ).tolist()
    live = []
    if num_live:
        live = group.broadcast(torch.zeros(num_live, dtype=torch.long, device=dev)).tolist()
    verdict = disagreement(rank0, own, caches).encode()[:VERDICT_BYTES]
    row = torch.zeros(1, VERDICT_BYTES, dtype=torch.uint8)
    if verdict:
        row[0, : len(verdict)] = torch.frombuffer(bytearray(verdict), dtype=torch.uint8)
    group.gather_rows(row.to(dev))
    group.gather_rows(torch.tensor([[live_kv_digest(caches, live)]], device=dev))
