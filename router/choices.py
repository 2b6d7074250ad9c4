"""n choices per request (OpenAI's `n`): the router fans one request out as n requests and merges
their deltas, each tagged with its choice index.

Choice i is the request with the id `<request_id>/c<i>` (so an Abort of the request id ends
every choice, `Router.abort`) and, when the request has a seed, the seed `seed + i` (wrapped to
64 bits): the choices differ, and the same request gives the same n choices again. The n run
concurrently, each with its own admission slot, route and relay; the prompt's KV is reused across
them only where one copy finds another's full blocks in a worker's prefix cache (a copy that
starts after another's prefill on the same worker); concurrent copies each compute it. Closing
the merged stream (a client that leaves, an error in one choice) ends all n on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

from router.core import CHOICE_SUFFIX, Prepared
from router.relay import Delta
from tandem.sampling_params import MAX_N, derived_seed

__all__ = ["MAX_N", "choice_preps", "derived_seed", "merged"]


def choice_preps(prep: Prepared, n: int) -> list[Prepared]:
    """The n requests of `prep`'s choices (`prep` itself when n is 1)."""
    if n == 1:
        return [prep]
    return [
        replace(
            prep,
            request_id=f"{prep.request_id}{CHOICE_SUFFIX}{i}",
            params=replace(prep.params, seed=derived_seed(prep.params.seed, i)),
        )
        for i in range(n)
    ]


async def merged(
    generate: Callable[[Prepared], AsyncGenerator[Delta, None]], preps: list[Prepared]
) -> AsyncGenerator[tuple[int, Delta], None]:
    """(choice index, delta) from every choice as they come; the first error ends them all."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def run(index: int, prep: Prepared) -> None:
        try:
            async with contextlib.aclosing(generate(prep)) as deltas:
                async for d in deltas:
                    await queue.put((index, d))
            await queue.put((index, None))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((index, e))

    tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(preps)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()  # a no-op for an ended choice; the others end on their workers
        await asyncio.gather(*tasks, return_exceptions=True)
