"""Paged KV cache bookkeeping: exact block ids after scripted sequences, plus a stateful model."""

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tandem import prefix_hash
from tandem.engine.kv_cache import KVCacheManager, OutOfBlocksError
from tandem.prefix_hash import block_hashes


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def prefill(kv: KVCacheManager, request_id: str, prompt: list[int]) -> list[int]:
    """Admit a request the way the scheduler does: prefix lookup, then one allocation."""
    prefix = kv.match_prefix(prompt)
    num_cached = len(prefix) * kv.block_size
    assert kv.allocate(request_id, prompt, num_cached, len(prompt) - num_cached, prefix)
    return kv.block_table(request_id)


def snapshot(kv: KVCacheManager) -> tuple[object, ...]:
    # Private state on purpose: "changes nothing" includes the LRU order and the cache map.
    return (
        {rid: list(table) for rid, table in kv._tables.items()},
        list(kv._free),
        dict(kv._cached),
        [(b.ref_cnt, b.block_hash) for b in kv._blocks],
        dict(kv._num_tokens),
        {rid: list(hashes) for rid, hashes in kv._hashes.items()},
    )


def test_allocate_takes_free_blocks_in_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert prefill(kv, "a", tokens(10)) == [0, 1, 2]
    assert prefill(kv, "b", tokens(5, 100)) == [3, 4]
    assert kv.num_free_blocks == 3
    assert kv.usage == 5 / 8
    kv.free("a")
    assert kv.referenced_blocks() == [3, 4]
    kv.check_integrity()


def test_decode_growth_adds_a_block_only_when_the_last_one_is_full() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = tokens(3)
    assert kv.allocate("a", prompt, 0, 3)
    prompt.append(3)
    assert kv.allocate("a", prompt, 3, 1)
    assert kv.block_table("a") == [0]
    prompt.append(4)
    assert kv.allocate("a", prompt, 4, 1)
    assert kv.block_table("a") == [0, 1]
    # Block 0 became full during decode, so a new request can share it while "a" runs.
    assert kv.match_prefix(tokens(6)) == [0]
    kv.check_integrity()


def test_chunked_prefill_grows_the_table_per_chunk() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = tokens(10)
    assert kv.allocate("a", prompt, 0, 6)
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate("a", prompt, 6, 4)
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_integrity()


def test_prefix_hit_reuses_the_freed_request_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = tokens(10)
    assert prefill(kv, "a", a) == [0, 1, 2]
    assert prefill(kv, "b", tokens(5, 100)) == [3, 4]
    kv.free("a")
    # Free list: a's uncached partial block 2 first (warm), never-used 5, 6, 7, then a's cached
    # blocks tail first.
    assert list(kv._free) == [2, 5, 6, 7, 1, 0]
    c = [*a[:8], 99, 98]
    assert kv.match_prefix(c) == [0, 1]
    assert kv.allocate("c", c, 8, 2, [0, 1])
    # The cached blocks left the free list; the new block came from its head.
    assert kv.block_table("c") == [0, 1, 2]
    assert kv.num_free_blocks == 3
    assert kv.stats.evictions == 0
    kv.check_integrity()


def test_shared_prefix_blocks_are_ref_counted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert prefill(kv, "a", tokens(9)) == [0, 1, 2]
    assert prefill(kv, "b", tokens(9)) == [0, 1, 3]
    assert kv.usage == 4 / 8
    kv.free("a")
    assert kv.num_free_blocks == 5  # only a's partial block 2 came back
    assert kv.block_table("b") == [0, 1, 3]
    kv.free("b")
    # Uncached partial blocks at the head, most recently freed first; cached ones at the tail.
    assert list(kv._free) == [3, 2, 4, 5, 6, 7, 1, 0]
    kv.check_integrity()


def test_lru_eviction_takes_least_recently_freed_and_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = tokens(8), tokens(8, 100)
    assert prefill(kv, "a", a) == [0, 1]
    assert prefill(kv, "b", b) == [2, 3]
    kv.free("a")
    kv.free("b")
    # 20 tokens need 5 blocks: the 4 never-used ones, then a's tail block 1, the LRU cached one.
    assert prefill(kv, "d", tokens(20, 200)) == [4, 5, 6, 7, 1]
    assert kv.stats.evictions == 1
    assert kv.match_prefix([*a, 9]) == [0]
    assert kv.match_prefix([*b, 9]) == [2, 3]
    # Next come a's head block 0, then b's tail block 3 before b's head block 2.
    assert kv.allocate("d", tokens(28, 200), 20, 8)
    assert kv.block_table("d") == [4, 5, 6, 7, 1, 0, 3]
    assert kv.stats.evictions == 3
    assert kv.match_prefix([*b, 9]) == [2]
    kv.check_integrity()


def test_prefix_hit_refreshes_lru_position() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = tokens(4), tokens(4, 100)
    assert prefill(kv, "a", a) == [0]
    assert prefill(kv, "b", b) == [1]
    kv.free("a")
    kv.free("b")
    assert prefill(kv, "a2", [*a, 7]) == [0, 2]  # revives block 0
    kv.free("a2")
    # Free list is now [2, 1, 0]: a2's uncached block 2, then the cached blocks, b's (freed
    # before a2's) first.
    assert prefill(kv, "e", tokens(4, 300)) == [2]
    assert prefill(kv, "f", tokens(4, 400)) == [1]
    assert kv.match_prefix([*a, 7]) == [0]
    assert kv.match_prefix([*b, 7]) == []


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = tokens(8)
    assert prefill(kv, "a", prompt) == [0, 1]
    kv.free("a")
    assert kv.match_prefix(prompt) == [0]
    assert kv.allocate("c", prompt, 4, 4, [0])
    assert kv.block_table("c") == [0, 2]
    assert kv.match_prefix([*prompt, 8]) == [0, 1]
    assert kv.match_prefix(tokens(4)) == []
    kv.check_integrity()


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert prefill(kv, "a", tokens(12)) == [0, 1, 2]
    before = snapshot(kv)
    assert not kv.allocate("b", tokens(8, 100), 0, 8)
    assert snapshot(kv) == before
    with pytest.raises(KeyError):
        kv.block_table("b")
    assert not kv.allocate("a", tokens(20), 12, 8)
    assert snapshot(kv) == before
    kv.check_integrity()


def test_allocate_failure_counts_revived_prefix_blocks_as_taken() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = tokens(8)
    assert prefill(kv, "a", a) == [0, 1]
    kv.free("a")
    c = tokens(16)
    assert kv.match_prefix(c) == [0, 1]
    before = snapshot(kv)
    # 2 new blocks needed, 3 free, but 2 of those are the prefix blocks themselves.
    assert not kv.allocate("c", c, 8, 8, [0, 1])
    assert snapshot(kv) == before
    assert kv.allocate("c", c[:12], 8, 4, [0, 1])
    assert kv.block_table("c") == [0, 1, 2]
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_stale_prefix_blocks_are_rejected() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    prompt = tokens(9)
    assert prefill(kv, "a", prompt) == [0, 1, 2]
    kv.free("a")
    prefix = kv.match_prefix(prompt)
    assert prefix == [0, 1]
    assert prefill(kv, "x", tokens(4, 100)) == [2]
    assert prefill(kv, "y", tokens(4, 200)) == [1]  # evicts prefix block 1
    before = snapshot(kv)
    with pytest.raises(ValueError, match="no longer cache"):
        kv.allocate("c", prompt, 8, 1, prefix)
    assert snapshot(kv) == before


def test_equal_block_is_not_deduplicated() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = tokens(5)
    # Both scheduled in one step, before either's blocks were cached.
    assert kv.allocate("a", prompt, 0, 5)
    assert kv.allocate("b", prompt, 0, 5)
    assert kv.block_table("a") == [0, 1]
    assert kv.block_table("b") == [2, 3]
    kv.free("a")
    kv.free("b")
    assert kv.match_prefix(prompt) == [0]  # a's block stays the cache entry
    # b's blocks 2, 3 and a's partial block 1 are uncached and go first; then never-used ones,
    # then a's cached block 0.
    assert prefill(kv, "c", tokens(24, 100)) == [2, 3, 1, 4, 5, 6]
    assert prefill(kv, "d", tokens(8, 300)) == [7, 0]
    assert kv.stats.evictions == 1
    kv.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert prefill(kv, "a", tokens(6)) == [0, 1]
    assert kv.fork("a", "b") == (1, 2)
    assert kv.block_table("b") == [0, 2]
    kv.check_integrity()
    # Each sequence now grows into its own last block.
    assert kv.allocate("a", [*tokens(6), 10], 6, 1)
    assert kv.allocate("b", [*tokens(6), 20], 6, 1)
    assert kv.block_table("a") == [0, 1]
    assert kv.block_table("b") == [0, 2]
    kv.free("a")
    assert kv.block_table("b") == [0, 2]
    assert kv.num_free_blocks == 2  # block 0 is still b's
    kv.check_integrity()


def test_fork_of_block_aligned_request_copies_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert prefill(kv, "a", tokens(8)) == [0, 1]
    assert kv.fork("a", "b") is None
    assert kv.block_table("b") == [0, 1]
    assert kv.num_free_blocks == 0
    kv.free("a")
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_fork_without_a_free_block_raises_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert prefill(kv, "a", tokens(6)) == [0, 1]
    before = snapshot(kv)
    with pytest.raises(OutOfBlocksError):
        kv.fork("a", "b")
    assert snapshot(kv) == before


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = tokens(5), tokens(5, 100)
    prefill(kv, "a", a)
    prefill(kv, "b", b)
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.match_prefix(a) == []
    assert kv.match_prefix(b) == [2]
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_prefix_caching_disabled_hashes_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prompt = tokens(9)
    assert prefill(kv, "a", prompt) == [0, 1, 2]
    kv.free("a")
    assert kv.match_prefix(prompt) == []
    assert kv._cached == {}
    with pytest.raises(ValueError, match="disabled"):
        kv.allocate("b", prompt, 4, 5, [0])
    assert kv.stats.prefix_queries == 0


def test_hit_rate_counts_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = tokens(10)
    prefill(kv, "a", prompt)
    prefill(kv, "b", prompt)
    assert (kv.stats.prefix_queries, kv.stats.prefix_hits) == (20, 8)
    assert kv.stats.prefix_hit_rate == 0.4


def test_hash_collision_does_not_return_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_hash, "hash_block", lambda parent, token_ids: b"same")
    kv = KVCacheManager(num_blocks=8, block_size=2)
    assert prefill(kv, "a", [0, 0, 1, 1, 5]) == [0, 1, 2]
    assert kv.match_prefix([1, 1, 0]) == []
    assert kv.match_prefix([0, 0, 1, 1, 5]) == [0]  # block 1's hash entry is block 0
    kv.check_integrity()


def test_hash_collision_with_another_parent_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hash that ignores the parent: equal blocks after different prefixes collide.
    monkeypatch.setattr(prefix_hash, "hash_block", lambda parent, token_ids: bytes(token_ids))
    kv = KVCacheManager(num_blocks=8, block_size=2)
    assert prefill(kv, "a", [0, 0, 1, 1, 5]) == [0, 1, 2]
    assert kv.match_prefix([1, 1, 9]) == []


def test_block_hashes_are_chained_and_stable() -> None:
    hashes = block_hashes([1, 2, 3, 4, 5], 2)
    # Pinned: workers and routers in other processes must agree on these bytes.
    assert [h.hex() for h in hashes] == [
        "f59df9f51bfcb52f7ae49756810ec78b",
        "b7d206afafc69562e9a824c16c0a95f1",
    ]
    assert block_hashes([9, 2, 3, 4], 2)[1] != hashes[1]
    assert block_hashes([1, 2, 3, 4], 4) != block_hashes([1, 2, 3, 4], 2)[1:]
    assert block_hashes([1], 2) == []


def test_check_integrity_reports_corruption() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, "a", tokens(5))
    kv._blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 0 has ref_cnt 2 but 1 block tables hold it"):
        kv.check_integrity()
    kv._blocks[0].ref_cnt -= 1
    kv._free[1] = None
    with pytest.raises(AssertionError, match="block 1 is free and referenced"):
        kv.check_integrity()
    del kv._free[1]
    kv._cached[b"bogus"] = 2
    with pytest.raises(AssertionError, match="points at block 2"):
        kv.check_integrity()


# --- stateful model -------------------------------------------------------------------------

VOCAB = st.integers(0, 1)  # tiny, so prefixes repeat and prefix hits are common


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler and tracks what KV each block really holds.

    kv_prefix[block] is the token prefix whose KV ends in the block's written slots: the model
    runner writes position p of a request into its block p // block_size. A prefix hit must hand
    out blocks whose kv_prefix is exactly the prompt's prefix up to the block's end.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.kv_prefix: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        enable_prefix_caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)

    @property
    def manager(self) -> KVCacheManager:
        assert self.kv is not None
        return self.kv

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def held(self) -> set[int]:
        return {block_id for table in self.tables.values() for block_id in table}

    def write(self, request_id: str, start: int, stop: int) -> None:
        """The step computes positions start..stop-1: their KV lands in the request's blocks."""
        bs = self.manager.block_size
        prompt = self.tokens[request_id]
        for pos in range(start, stop):
            block_id = self.tables[request_id][pos // bs]
            holders = [rid for rid, table in self.tables.items() if block_id in table]
            assert holders == [request_id], f"block {block_id} written while shared: {holders}"
            assert self.kv_prefix[block_id] == tuple(prompt[:pos])
            self.kv_prefix[block_id] = tuple(prompt[: pos + 1])

    def allocate(
        self,
        request_id: str,
        prompt: list[int],
        num_computed: int,
        num_new: int,
        prefix: Sequence[int] = (),
    ) -> None:
        kv, bs = self.manager, self.manager.block_size
        old_table = self.tables.get(request_id, list(prefix))
        num_needed = max(0, -(-(num_computed + num_new) // bs) - len(old_table))
        held = self.held()
        num_revived = sum(1 for block_id in prefix if block_id not in held)
        num_available = kv.num_free_blocks - num_revived
        before = snapshot(kv)
        ok = kv.allocate(request_id, prompt, num_computed, num_new, prefix)
        assert ok == (num_needed <= num_available)
        if not ok:
            assert snapshot(kv) == before
            return
        table = kv.block_table(request_id)
        assert table[: len(old_table)] == old_table
        assert len(table) == len(old_table) + num_needed
        for i in range(len(old_table), len(table)):
            assert table[i] not in held
            self.kv_prefix[table[i]] = tuple(prompt[: i * bs])
        self.tables[request_id] = table
        self.tokens[request_id] = prompt
        self.computed[request_id] = num_computed + num_new
        self.write(request_id, num_computed, num_computed + num_new)

    @rule(prompt=st.lists(VOCAB, min_size=1, max_size=12), chunk=st.integers(1, 12))
    def add_request(self, prompt: list[int], chunk: int) -> None:
        kv, bs = self.manager, self.manager.block_size
        prefix = kv.match_prefix(prompt)
        num_cached = len(prefix) * bs
        assert num_cached < len(prompt)
        if not kv.enable_prefix_caching:
            assert prefix == []
        for i, block_id in enumerate(prefix):
            assert self.kv_prefix.get(block_id) == tuple(prompt[: (i + 1) * bs])
        self.allocate(
            self.new_id(), prompt, num_cached, min(chunk, len(prompt) - num_cached), prefix
        )

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        """A prefill chunk, or decode of newly sampled (or accepted speculative) tokens."""
        request_id = data.draw(st.sampled_from(sorted(self.tables)))
        prompt, num_computed = self.tokens[request_id], self.computed[request_id]
        if num_computed == len(prompt):
            prompt = prompt + data.draw(st.lists(VOCAB, min_size=1, max_size=3))
        num_new = data.draw(st.integers(1, len(prompt) - num_computed))
        self.allocate(request_id, prompt, num_computed, num_new)

    @precondition(lambda self: self.manager.num_free_blocks > 0)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """Allocate fresh blocks straight from the LRU head, bypassing the prefix cache."""
        num_blocks = data.draw(st.integers(1, self.manager.num_free_blocks))
        prompt = data.draw(st.lists(VOCAB, min_size=num_blocks, max_size=num_blocks))
        prompt = prompt * self.manager.block_size
        self.allocate(self.new_id(), prompt, 0, len(prompt))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tables)))
        self.manager.free(request_id)
        del self.tables[request_id], self.tokens[request_id], self.computed[request_id]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        kv = self.manager
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child = self.new_id()
        num_full, num_partial = divmod(self.computed[parent], kv.block_size)
        table = self.tables[parent]
        if num_partial and kv.num_free_blocks == 0:
            before = snapshot(kv)
            with pytest.raises(OutOfBlocksError):
                kv.fork(parent, child)
            assert snapshot(kv) == before
            return
        held = self.held()
        copy = kv.fork(parent, child)
        child_table = kv.block_table(child)
        assert child_table[:num_full] == table[:num_full]
        if num_partial:
            assert copy == (table[num_full], child_table[num_full])
            assert len(child_table) == num_full + 1 and child_table[-1] not in held
            self.kv_prefix[copy[1]] = self.kv_prefix[copy[0]]
        else:
            assert copy is None and len(child_table) == num_full
        self.tables[child] = child_table
        self.tokens[child] = self.tokens[parent]
        self.computed[child] = self.computed[parent]

    @rule()
    def reset(self) -> None:
        self.manager.reset_prefix_cache()

    @precondition(lambda self: self.kv is not None)
    @invariant()
    def consistent(self) -> None:
        kv = self.manager
        kv.check_integrity()
        for request_id, table in self.tables.items():
            assert kv.block_table(request_id) == table
        num_held = len(self.held())
        assert kv.num_free_blocks == kv.num_blocks - num_held
        assert kv.usage == pytest.approx(num_held / kv.num_blocks)


TestKVCacheStateful = KVCacheMachine.TestCase
TestKVCacheStateful.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
