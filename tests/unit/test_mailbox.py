"""A mailbox between two ranks' processes (`tandem/engine/tp/mailbox.py`) over a real TCPStore on
loopback: items arrive in order, `get` never waits, a reader with nothing to do waits for the next
item on a connection of its own (so its other connection still serves the same thread's reports
and another thread's calls), `wake` ends a wait for a stop, and a wait that times out is None."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from tandem.engine.tp.mailbox import Mailbox

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def stores() -> Iterator[tuple[dist.Store, dist.Store, dist.Store]]:
    """Rank 0's store, and a rank's two connections to it (the second to wait on)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=TIMEOUT)
    waiter = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=TIMEOUT)
    yield master, client, waiter


def test_items_arrive_in_order_and_get_never_waits(stores: tuple[dist.Store, ...]) -> None:
    master, client, waiter = stores
    sender, reader = Mailbox(master, "orders"), Mailbox(client, "orders", waiter)
    started = time.monotonic()
    assert reader.get() is None
    assert time.monotonic() - started < 1.0
    items = [("expect", "a", [1, 2]), ("cancel", "a"), None, 3]
    for item in items:
        sender.put(item)
    # another connection's put may reach the store after a `get` asks: `wait` for those
    assert [reader.wait() for _ in items] == items
    assert not client.check(["orders/0"]) and not client.check(["orders/3"])  # read, deleted
    Mailbox(client, "own").put("through the reader's connection")
    assert Mailbox(client, "own", waiter).get() == "through the reader's connection"


def test_a_waiting_reader_leaves_its_other_connection_free(stores: tuple[dist.Store, ...]) -> None:
    master, client, waiter = stores
    orders, reports = Mailbox(client, "orders", waiter), Mailbox(client, "reports")
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(orders.wait()), daemon=True)
    reader.start()
    time.sleep(0.2)  # waiting now
    putter = threading.Thread(target=reports.put, args=("report while the reader waits",))
    putter.start()
    putter.join(2.0)
    free = not putter.is_alive()
    Mailbox(master, "orders").put("order")  # ends the wait either way
    reader.join(5.0)
    putter.join(5.0)
    assert free, "the put waited on the reader's wait"
    assert Mailbox(master, "reports").wait(timeout_s=5.0) == "report while the reader waits"
    assert got == ["order"]


def test_wake_ends_a_wait_in_progress(stores: tuple[dist.Store, ...]) -> None:
    _, client, waiter = stores
    orders = Mailbox(client, "orders", waiter)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(orders.wait()), daemon=True)
    thread.start()
    time.sleep(0.2)
    orders.wake()
    thread.join(5.0)
    assert not thread.is_alive() and got == [None]


def test_a_wait_that_times_out_is_none(stores: tuple[dist.Store, ...]) -> None:
    _, client, waiter = stores
    started = time.monotonic()
    assert Mailbox(client, "orders", waiter).wait(timeout_s=0.2) is None
    assert 0.2 <= time.monotonic() - started < 2.0
