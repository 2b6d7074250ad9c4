"""Ordered messages between rank 0 and one other rank of an engine, through the ranks' TCPStore.

A worker's rank 0 gives orders to the service it runs in each other rank (`Ranks.start_service`:
the receivers and senders of a per-rank KV transfer) and reads their reports. Each direction is
a `Mailbox`: pickled items under `<name>/<n>` keys, n = 0, 1, ..., each deleted once read. The
store is on loopback (an engine's ranks share a host), so an item costs a round trip or two
(~0.1 ms). One thread per end uses a mailbox.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch.distributed as dist

POLL_S = 0.001  # how often `get` looks for the next item while it waits


class Mailbox:
    def __init__(self, store: dist.Store, name: str) -> None:
        self.store = store
        self.name = name
        self._sent = 0
        self._read = 0

    def put(self, item: Any) -> None:
        self.store.set(f"{self.name}/{self._sent}", pickle.dumps(item))  # type: ignore[arg-type]
        self._sent += 1

    def get(self, timeout_s: float = 0.0) -> Any | None:
        """The next item, or None when none came within `timeout_s` (0: only one there now).
        It looks every POLL_S: a store's own wait would hold its connection (a put from
        another thread would wait on it) and log each timeout."""
        key = f"{self.name}/{self._read}"
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
        item = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self._read += 1
        return item
