"""Admission control: at most `max_inflight` requests are dispatched at once and at most
`max_queue` wait for a slot; beyond that a request is refused at once (RESOURCE_EXHAUSTED / 429
with a Retry-After) rather than queued without bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from router.errors import ErrorKind, RouterError


class Admission:
    def __init__(self, max_inflight: int = 256, max_queue: int = 1024) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.inflight = 0
        self.queued = 0
        self._slots = asyncio.Semaphore(max_inflight)

    @asynccontextmanager
    async def slot(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold one dispatch slot; waits up to `timeout_s` in a bounded queue."""
        if self._slots.locked() and self.queued >= self.max_queue:
            raise RouterError(
                ErrorKind.OVERLOADED,
                f"the router is at capacity ({self.max_inflight} in flight, "
                f"{self.queued} queued); retry later",
                retry_after_s=1.0,
            )
        self.queued += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout_s)
        except TimeoutError:
            raise RouterError(
                ErrorKind.OVERLOADED, "no dispatch slot freed up in time", retry_after_s=1.0
            ) from None
        finally:
            self.queued -= 1
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
            self._slots.release()
