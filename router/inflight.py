"""This router's requests in flight per worker: the load the pick policies read.

A request counts on a worker from the moment a policy picks it, not from when the worker
answers, so that a burst of requests spreads: `pick` chooses and counts in one step, with no
await between. The count is a `Lease`, given back exactly once however the request ends: on
leaving its `with` block, by `release()`, or as the done callback of the task that holds it
(a callback fires for a task cancelled before it ran, where a `with` inside it never would).
`Lease` is the only code that changes the counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from router.policies import PickContext, Policy
from tandem.registry import WorkerRecord


class Lease:
    """One request's count on one worker."""

    def __init__(self, inflight: Counter[str], worker: WorkerRecord) -> None:
        self.worker = worker
        self._inflight = inflight
        self._held = True
        inflight[worker.worker_id] += 1

    def release(self, _task: object = None) -> None:
        """Give the count back; later calls do nothing. `_task`: as a task's done callback."""
        if self._held:
            self._held = False
            self._inflight[self.worker.worker_id] -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def pick(policy: Policy, workers: Sequence[WorkerRecord], ctx: PickContext) -> Lease:
    """The policy's choice among `workers` (non-empty), counted in `ctx.inflight` at once."""
    return Lease(ctx.inflight, policy.pick(workers, ctx))
