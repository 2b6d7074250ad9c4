"""n choices per request (OpenAI's `n`): one request upstream, one stream of deltas per choice.

The request goes to the workers once with n (router/core.py: one admission slot, one prefill,
one KV transfer; the decode worker forks the choices over the prompt's blocks). Choice i samples
with the seed `seed + i` (wrapped to 64 bits) when the request has a seed: the choices differ,
and the same request gives the same n choices again. Here the request's tagged deltas are split
into one stream per choice, so that the APIs render, and the metrics count, each choice as
before; `merged` reads them back as one. Closing the merged stream (a client that leaves, an
error) ends the request, every choice, on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from router.core import Prepared, Router
from router.merge import merged
from router.relay import Delta
from tandem.sampling_params import MAX_N, derived_seed

__all__ = ["MAX_N", "Choice", "derived_seed", "merged", "request_choices"]


@dataclass(frozen=True)
class Choice:
    """Choice `index` of the request `prep` (whose `params.n` counts its choices)."""

    prep: Prepared
    index: int
    request: _Request

    def deltas(self, router: Router) -> AsyncGenerator[Delta, None]:
        return self.request.deltas(router, self.index)


def request_choices(prep: Prepared, n: int) -> list[Choice]:
    """The n choices of `prep`, served as one request."""
    prep = replace(prep, params=replace(prep.params, n=n))
    request = _Request(prep)
    return [Choice(prep, i, request) for i in range(n)]


class _Request:
    """Feeds each choice's queue from the request's one stream, which starts with the first
    reader and ends once every reader has ended (closing the last one cancels it)."""

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep
        self.queues: list[asyncio.Queue[Delta | BaseException]] = [
            asyncio.Queue() for _ in range(prep.params.n)
        ]
        self.readers = prep.params.n
        self.task: asyncio.Task[None] | None = None

    async def deltas(self, router: Router, index: int) -> AsyncGenerator[Delta, None]:
        if self.task is None:
            self.task = asyncio.create_task(self._feed(router))
        task = self.task
        try:
            while True:
                item = await self.queues[index].get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.readers -= 1
            if not self.readers:
                task.cancel()  # a no-op once it has ended; else the workers end the request
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _feed(self, router: Router) -> None:
        try:
            async with contextlib.aclosing(router.generate_choices(self.prep)) as deltas:
                async for index, delta in deltas:
                    self.queues[index].put_nowait(delta)
        except Exception as e:  # every reader raises it
            for queue in self.queues:
                queue.put_nowait(e)
