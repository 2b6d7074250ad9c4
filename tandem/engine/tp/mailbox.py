"""Ordered messages between rank 0 and one other rank of an engine, through the ranks' TCPStore.

A worker's rank 0 gives orders to the service it runs in each other rank (`Ranks.start_service`:
the receivers and senders of a per-rank KV transfer) and reads their reports. Each direction is
a `Mailbox`: pickled items under `<name>/<n>` keys, n = 0, 1, ..., each deleted once read. The
store is on loopback (an engine's ranks share a host), so an item costs a round trip or two
(~0.1 ms). One thread per end uses a mailbox.

A reader with nothing else to do blocks in `wait` rather than asking again and again (each ask
is a round trip: ~4% of a core at one every 5 ms). A TCPStore client's wait holds its
connection, so the mailbox waits on a connection of its own (`waiter`), and `wake`, from another
thread, ends a wait in progress for a stop.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How long `wait` waits for an item at most by default: a day (a wait that times out logs two
# warning lines of c10's, so not often; a stop wakes it, and rank 0's end fails it at once).
WAIT_S = 86400.0


class Mailbox:
    def __init__(self, store: dist.Store, name: str, waiter: dist.Store | None = None) -> None:
        self.store = store
        self.name = name
        # `wait`'s connection to the same store: `store` itself where its wait holds no
        # connection (a HashStore), else a client of its own
        self.waiter = waiter if waiter is not None else store
        self._sent = 0
        self._read = 0

    def put(self, item: Any) -> None:
        self.store.set(f"{self.name}/{self._sent}", pickle.dumps(item))  # type: ignore[arg-type]
        self._sent += 1

    def get(self) -> Any | None:
        """The next item, or None when none is there now."""
        if not self.store.check([self._key()]):
            return None
        return self._take()

    def wait(self, timeout_s: float = WAIT_S) -> Any | None:
        """The next item once it is there; None after `timeout_s`, or when `wake` ended it."""
        try:
            self.waiter.wait([self._key()], timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            return None
        return self._take()

    def wake(self) -> None:
        """End a `wait` in progress (or the next one) with None, for a stop: it stands in for
        the next item, so the reader must stop reading once woken (an item sent after it is
        lost)."""
        self.store.set(self._key(), pickle.dumps(None))  # type: ignore[arg-type]

    def _key(self) -> str:
        return f"{self.name}/{self._read}"

    def _take(self) -> Any:
        key = self._key()
        item = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self._read += 1
        return item
