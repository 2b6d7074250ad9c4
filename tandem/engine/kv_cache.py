"""Paged KV cache bookkeeping: block pool, block tables, prefix hashing, ref counts.

The KV tensors live with the model runner; this module only decides which block ids
(``0 .. num_blocks - 1``) hold which request's tokens, in plain Python ints.

Block lifecycle::

    free ──allocate, fork──▶ referenced ──free: ref_cnt reaches 0──▶ free (LRU tail)
                                 ▲                                       │
                                 └───── prefix hit, if still hashed ─────┘

- A block is *referenced* while block tables hold it; ``ref_cnt`` is how many do. Otherwise it is
  on the free list, which allocation pops from the head. ``free`` puts a request's hashed blocks
  at the tail in reverse table order (its tail blocks are evicted before its head): the cached
  blocks form an LRU queue behind every uncached free block. Uncached blocks go to the head, so
  the most recently freed is reused first: its memory is still warm (on CPU this made batch-1
  decode ~20% faster than cycling through the whole pool).
- When a block fills with known tokens it is hashed, ``H(parent block hash, token ids)``, chained
  over full blocks only, and becomes the prefix-cache entry for that hash unless an equal block
  already is (then it stays a private, unhashed copy).
- A hashed block keeps its hash and KV after its last reference is gone: a prefix hit takes it
  back off the free list; allocation popping it from the head evicts the hash.
- A fork shares the parent's full blocks and gives the child a fresh block for the partial last
  one, whose KV the caller copies.
"""

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.prefix_hash import ROOT_HASH, BlockHash, iter_block_hashes, prefix_key


class OutOfBlocksError(RuntimeError):
    """A fork needs a fresh block for the parent's partial last block and none is free."""


@dataclass(slots=True)
class _Block:
    ref_cnt: int = 0
    # Set only while this block is the prefix-cache entry for block_hash; the parent hash and
    # token ids are kept so that a hit is re-checked rather than trusted to the hash alone.
    block_hash: BlockHash | None = None
    parent_hash: BlockHash = ROOT_HASH
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class KVCacheStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = KVCacheStats()
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # slots the request's latest allocate asked for
        self._hashes: dict[str, list[BlockHash]] = {}  # chained hashes of its hashed full blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: never used, or cached but unreferenced (evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hash_summary(self, limit: int) -> list[int]:
        """The newest `limit` prefix-cache entries as 63-bit ints (for the cluster's prefix
        index: a router compares them with `prefix_key`s of a prompt's block hashes)."""
        newest = list(itertools.islice(reversed(self._cached), limit))
        return [prefix_key(h) for h in newest]

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest prefix of full blocks of token_ids.

        Capped so that at least one token remains to compute (a fully cached prompt still needs
        its last token's logits). Takes no references: call it right before ``allocate``.
        """
        if not self.enable_prefix_caching:
            return []
        blocks, _ = self._lookup(token_ids, (len(token_ids) - 1) // self.block_size)
        self.stats.prefix_queries += len(token_ids)
        self.stats.prefix_hits += len(blocks) * self.block_size
        return blocks

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix_blocks: Sequence[int] = (),
    ) -> bool:
        """Grow the request's block table to hold num_computed_tokens + num_new_tokens tokens.

        On the request's first call, prefix_blocks (from ``match_prefix``) become the head of its
        table. token_ids are the request's known, final tokens (not draft tokens); it may be
        shorter than the slots asked for (e.g. lookahead slots), and every block that becomes
        full of them is hashed into the prefix cache. Returns False and changes nothing when
        there are not enough free blocks.
        """
        bs = self.block_size
        num_tokens = num_computed_tokens + num_new_tokens
        table = self._tables.get(request_id)
        if table is None:
            hashes = self._check_prefix(token_ids, prefix_blocks, num_tokens)
            num_held = len(prefix_blocks)
            # Cached prefix blocks on the free list leave it, so they are not free for new blocks.
            num_available = len(self._free) - sum(
                1 for block_id in prefix_blocks if self._blocks[block_id].ref_cnt == 0
            )
        elif prefix_blocks:
            raise ValueError(
                f"request {request_id!r} already has blocks; prefix_blocks is for its first call"
            )
        else:
            num_held = len(table)
            num_available = len(self._free)
        num_needed = max(0, -(-num_tokens // bs) - num_held)
        if num_needed > num_available:
            return False

        if table is None:
            for block_id in prefix_blocks:
                self._take(block_id)
            table = self._tables[request_id] = list(prefix_blocks)
            self._hashes[request_id] = hashes
        table.extend(self._pop_free() for _ in range(num_needed))
        self._num_tokens[request_id] = num_tokens
        if self.enable_prefix_caching:
            self._hash_full_blocks(request_id, token_ids, min(num_tokens, len(token_ids)) // bs)
        return True

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables[request_id])

    def referenced_blocks(self) -> list[int]:
        """The block ids some block table holds, ascending."""
        return [block_id for block_id, block in enumerate(self._blocks) if block.ref_cnt]

    def free(self, request_id: str) -> None:
        """Drop the request's references (a no-op for a request without blocks).

        Blocks whose ref count reaches 0 go to the free-list tail in reverse table order, so the
        request's tail blocks are evicted before its head. Hashed blocks stay cached.
        """
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        del self._num_tokens[request_id], self._hashes[request_id]
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    # Nothing to keep: reuse it first, while its memory is still warm.
                    self._free.move_to_end(block_id, last=False)

    def fork(self, parent_id: str, child_id: str) -> tuple[int, int] | None:
        """Give child_id the parent's tokens: its full blocks are shared (ref count + 1).

        If the parent's last block is partial, the child gets a fresh block for it and the
        return value (src_block, dst_block) tells the caller to copy that block's KV; None means
        nothing to copy. The parent's token count is that of its latest ``allocate``. Raises
        OutOfBlocksError, changing nothing, when the copy needs a block and none is free.
        """
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        table = self._tables[parent_id]
        num_tokens = self._num_tokens[parent_id]
        num_full, num_partial = divmod(num_tokens, self.block_size)
        if num_partial and not self._free:
            raise OutOfBlocksError(f"no free block to fork {parent_id!r} into {child_id!r}")
        child_table = table[:num_full]
        for block_id in child_table:
            self._blocks[block_id].ref_cnt += 1
        copy = None
        if num_partial:
            copy = (table[num_full], self._pop_free())
            child_table.append(copy[1])
        self._tables[child_id] = child_table
        self._num_tokens[child_id] = num_tokens
        self._hashes[child_id] = list(self._hashes[parent_id])
        return copy

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all unreferenced blocks."""
        for block_id in self._free:
            self._uncache(self._blocks[block_id])

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken bookkeeping invariant, if any."""
        ref_cnt = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id!r} holds a block twice: {table}")
            num_tokens = self._num_tokens[request_id]
            if len(table) * self.block_size < num_tokens:
                raise AssertionError(
                    f"request {request_id!r} has {len(table)} blocks for {num_tokens} tokens"
                )
            if len(self._hashes[request_id]) > num_tokens // self.block_size:
                raise AssertionError(f"request {request_id!r} has hashes beyond its full blocks")
            for block_id in table:
                ref_cnt[block_id] += 1
        for block_id, block in enumerate(self._blocks):
            if block.ref_cnt != ref_cnt[block_id]:
                raise AssertionError(
                    f"block {block_id} has ref_cnt {block.ref_cnt} "
                    f"but {ref_cnt[block_id]} block tables hold it"
                )
            if (block_id in self._free) == (ref_cnt[block_id] > 0):
                where = (
                    "free and referenced" if ref_cnt[block_id] else "neither free nor referenced"
                )
                raise AssertionError(f"block {block_id} is {where}")
            if block.block_hash is not None and self._cached.get(block.block_hash) != block_id:
                raise AssertionError(f"block {block_id} has a hash but is not its cache entry")
        num_referenced = sum(1 for n in ref_cnt if n)
        # The free list is an OrderedDict, so it cannot hold a block twice; an unknown id in it
        # shows up here.
        if len(self._free) + num_referenced != self.num_blocks:
            raise AssertionError(
                f"{len(self._free)} free + {num_referenced} referenced != {self.num_blocks} blocks"
            )
        for block_hash, block_id in self._cached.items():
            if self._blocks[block_id].block_hash != block_hash:
                raise AssertionError(
                    f"cache entry {block_hash.hex()} points at block {block_id}, "
                    "which stores another hash"
                )
        if self._cached and not self.enable_prefix_caching:
            raise AssertionError("blocks are cached with prefix caching disabled")

    def _lookup(
        self, token_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[int], list[BlockHash]]:
        """Longest chain of cache hits among the first max_blocks full blocks, with its hashes."""
        bs = self.block_size
        stop = min(max_blocks, len(token_ids) // bs)
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent = ROOT_HASH
        for i, block_hash in enumerate(iter_block_hashes(token_ids, bs, 0, stop, parent)):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(
                token_ids[i * bs : (i + 1) * bs]
            ):
                break  # a hash collision
            blocks.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return blocks, hashes

    def _check_prefix(
        self, token_ids: Sequence[int], prefix_blocks: Sequence[int], num_tokens: int
    ) -> list[BlockHash]:
        """Hashes of prefix_blocks, after checking they still cache the head of token_ids."""
        if not prefix_blocks:
            return []
        if not self.enable_prefix_caching:
            raise ValueError("prefix_blocks given with prefix caching disabled")
        if len(prefix_blocks) * self.block_size > num_tokens:
            raise ValueError(f"{len(prefix_blocks)} prefix blocks exceed {num_tokens} tokens")
        blocks, hashes = self._lookup(token_ids, len(prefix_blocks))
        if blocks != list(prefix_blocks):
            raise ValueError(
                f"prefix blocks {list(prefix_blocks)} no longer cache these tokens "
                f"(cached: {blocks}); call match_prefix right before allocate"
            )
        return hashes

    def _hash_full_blocks(self, request_id: str, token_ids: Sequence[int], num_full: int) -> None:
        """Hash the request's blocks up to num_full; each new hash gets a cache entry if free."""
        bs = self.block_size
        table = self._tables[request_id]
        hashes = self._hashes[request_id]
        start = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        for i, block_hash in enumerate(
            iter_block_hashes(token_ids, bs, start, num_full, parent), start=start
        ):
            hashes.append(block_hash)
            if block_hash not in self._cached:
                block = self._blocks[table[i]]
                block.block_hash = block_hash
                block.parent_hash = parent
                block.token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
                self._cached[block_hash] = table[i]
            parent = block_hash

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        """Take the least recently freed block, evicting its hash if it has one."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if self._uncache(block):
            self.stats.evictions += 1
        block.ref_cnt = 1
        return block_id

    def _uncache(self, block: _Block) -> bool:
        """Drop the block's cache entry; False if it had none."""
        if block.block_hash is None:
            return False
        del self._cached[block.block_hash]
        block.block_hash, block.parent_hash, block.token_ids = None, ROOT_HASH, ()
        return True
