"""Prefix hashes of KV blocks: chained over full blocks, stable across processes and hosts.

Workers key their prefix caches by them and publish them (shortened, `prefix_key`) to the
registry; the router hashes a prompt the same way to send it where its prefix is cached.
Torch-free.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    # Stable across processes and hosts (unlike hash()): the prefix index is shared via Redis.
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, start: int, stop: int, parent: BlockHash
) -> Iterator[BlockHash]:
    """Chained hashes of full blocks start..stop-1; parent is the hash of block start-1."""
    for i in range(start, stop):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        yield parent


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of the full blocks of token_ids (a trailing partial block has none)."""
    num_full = len(token_ids) // block_size
    return list(iter_block_hashes(token_ids, block_size, 0, num_full, ROOT_HASH))


def prefix_key(block_hash: BlockHash) -> int:
    """A block hash shortened to a non-negative int64, as workers publish it."""
    return int.from_bytes(block_hash[:8], "little") >> 1
