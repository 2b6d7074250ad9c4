"""A tensor-parallel decode worker's reservations (`decode_worker/rank_receivers.py`) never wait
on its ranks: `reserve` sends the orders and returns, `reserved` hands out the ticket once every
rank has answered, and a rank that refuses, dies or stops answering fails that request alone.

Rank 1 is the real service (`serve_rank`: its own `KVReceiver` and order loop) in this process,
its mailboxes over an in-process store, as `Ranks` runs it in a rank's process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from decode_worker import rank_receivers
from decode_worker.rank_receivers import RankReceivers, serve_rank
from kv_transfer import KVReceiver, KVTicket, TransferError
from kv_transfer.state import FailureCause
from tandem.engine.tp.mailbox import Mailbox
from tandem.engine.tp.ranks import RankContext, RankLink

BLOCKS, BLOCK_SIZE, HEAD_DIM = 8, 4, 8


def _caches() -> list[torch.Tensor]:  # two layers, one KV head a rank
    return [torch.zeros(2, BLOCKS, BLOCK_SIZE, 1, HEAD_DIM) for _ in range(2)]


class CountingStore:
    """Test double: a store that counts the `check` calls made through it (a rank's polls)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.checks = 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        return self.store.check(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class Ranks:
    """Rank 0's `RankReceivers` over rank 1's service, and what a test does to rank 1."""

    def __init__(self) -> None:
        store = dist.HashStore()
        self.rank_store = CountingStore(store)  # rank 1's end
        orders = Mailbox(cast(dist.Store, self.rank_store), "orders")
        self.ctx = RankContext(1, 2, _caches(), orders, Mailbox(store, "reports"))
        started = serve_rank(
            "fp", "127.0.0.1", False, False, [range(0, 1), range(1, 2)], 2, self.ctx
        )
        self.alive = True
        link = RankLink(
            1, started, Mailbox(store, "orders"), Mailbox(store, "reports"), self.is_alive
        )
        own = KVReceiver(_caches(), "fp", enable_pairs=False, num_kv_heads=2)
        self.receivers = RankReceivers(own, [link])

    def is_alive(self) -> bool:
        return self.alive

    def reserved(self, key: str, within_s: float = 5.0) -> KVTicket | Exception:
        """What `reserved` gives for `key`, polled as the decode loop does between steps."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for k, result in self.receivers.reserved():
                assert k == key, f"{k!r} reported, expected {key!r}"
                return result
            time.sleep(0.002)
        raise AssertionError(f"{key!r} was not reported within {within_s} s")

    def close(self) -> None:
        self.receivers.close()
        self.ctx.stop()


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    r = Ranks()
    yield r
    r.close()


def test_a_ticket_lists_every_rank_once_all_have_reserved(ranks: Ranks) -> None:
    started = time.monotonic()
    ranks.receivers.reserve("a", [0, 1], 8)
    assert time.monotonic() - started < 0.05, "reserve waits on no rank"
    ticket = ranks.reserved("a")
    assert isinstance(ticket, KVTicket)
    assert [(r.first_head, r.num_heads) for r in ticket.ranks] == [(0, 1), (1, 1)]
    assert ticket.block_ids == (0, 1)


def test_a_reservation_a_rank_refuses_fails_that_request_alone(ranks: Ranks) -> None:
    ranks.receivers.reserve("too-long", [2], 64)  # 64 tokens in one block of 4
    error = ranks.reserved("too-long")
    assert isinstance(error, ValueError) and "do not fit" in str(error)
    ranks.receivers.reserve("next", [2], 4)  # the next request is served
    assert isinstance(ranks.reserved("next"), KVTicket)


def test_a_request_cancelled_while_reserving_is_never_reported(ranks: Ranks) -> None:
    ranks.receivers.reserve("gone", [3], 4)
    ranks.receivers.cancel("gone")
    # the same key again: rank 1 no longer holds the first reservation ("already exists" else)
    ranks.receivers.reserve("gone", [3], 4)
    assert isinstance(ranks.reserved("gone"), KVTicket)


def test_a_stale_answer_does_not_stand_for_a_new_reservation_of_the_same_key(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 reads the ranks' reports only while requests are in flight, so the answers to a
    reservation cancelled while reserving may still wait there when the key is reserved again:
    they are the earlier reservation's, not the new one's."""
    monkeypatch.setattr(rank_receivers, "EXPECT_TIMEOUT_S", 0.3)
    ranks.receivers.reserve("again", [3], 4)
    ranks.receivers.cancel("again")
    time.sleep(0.3)  # rank 1 reserved, answered, cancelled and reported the end
    ranks.ctx.stopping.set()  # it drops its next order and ends: no answer comes
    ranks.receivers.reserve("again", [3], 4)
    error = ranks.reserved("again")
    assert isinstance(error, TransferError) and error.cause == FailureCause.TIMEOUT


def test_an_idle_rank_waits_for_its_next_order_rather_than_polling(ranks: Ranks) -> None:
    time.sleep(0.3)
    assert ranks.rank_store.checks == 0, "an idle rank polls its mailbox"
    ranks.receivers.reserve("i", [6], 4)
    assert isinstance(ranks.reserved("i"), KVTicket)


def test_a_rank_that_stops_answering_times_the_request_out(
    ranks: Ranks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rank_receivers, "EXPECT_TIMEOUT_S", 0.3)
    ranks.ctx.stopping.set()  # it drops its next order and ends: no answer comes
    ranks.receivers.reserve("c", [4], 4)
    error = ranks.reserved("c")
    assert isinstance(error, TransferError) and error.cause == FailureCause.TIMEOUT
    assert "rank 1" in str(error)


def test_a_dead_rank_fails_the_request_at_once(ranks: Ranks) -> None:
    ranks.ctx.stopping.set()
    ranks.alive = False
    ranks.receivers.reserve("d", [5], 4)
    error = ranks.reserved("d", within_s=1.0)
    assert isinstance(error, TransferError) and error.cause == FailureCause.PEER_LOST
