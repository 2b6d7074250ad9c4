"""Several delta streams read as one: (position, delta) from each as they come."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from router.relay import Delta

T = TypeVar("T")


async def merged(
    generate: Callable[[T], AsyncGenerator[Delta, None]], items: list[T]
) -> AsyncGenerator[tuple[int, Delta], None]:
    """(position in `items`, delta) from `generate(item)` of every item, concurrently, as they
    come; the first error ends them all, and so does closing this generator."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def run(position: int, item: T) -> None:
        try:
            async with contextlib.aclosing(generate(item)) as deltas:
                async for d in deltas:
                    await queue.put((position, d))
            await queue.put((position, None))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((position, e))

    tasks = [asyncio.create_task(run(i, item)) for i, item in enumerate(items)]
    try:
        running = len(tasks)
        while running:
            position, got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield position, got
    finally:
        for t in tasks:
            t.cancel()  # a no-op for an ended stream; the others end on their workers
        await asyncio.gather(*tasks, return_exceptions=True)
