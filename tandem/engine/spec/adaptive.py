"""How many tokens to draft next: fewer when drafts get rejected, none when the batch is large.

Speculation pays while decode is memory-bound: verifying k extra tokens costs little at small
batch and real compute at large batch. Two limits, the smaller wins:

- acceptance: with a per-token acceptance rate a (a moving average per request, `Acceptance`),
  the k-th draft is reached and accepted with probability ~ a**k; drafting stops at the k where
  that falls below `min_accept_prob`. At least one token is still drafted, so a request whose
  acceptance recovers is noticed.
- batch: k shrinks linearly with the running batch and is 0 from `disable_batch_size` on. Its
  default depends on the device (`DISABLE_BATCH_SIZE`): on a GPU a verify step of a few extra
  rows per request costs about a decode step until the batch is large; on a CPU the linear layers
  are compute-bound after a few rows, so verification stops paying early. Measured on this
  project's 2-core CPU (SmolLM2, `tandem bench spec` / `tandem bench quant`, 3 Dec, n-gram with
  the schedule running up to 32): float32 0.87x at batch 4, 0.90x at 8, 0.96x at 16 (1.06x at
  batch 1); bfloat16 at batch 16 0.73-0.84x across weight formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ACCEPTANCE_EMA = 0.3  # weight of the newest step in a request's acceptance moving average
INITIAL_ACCEPTANCE = 0.6
MIN_ACCEPT_PROB = 0.25
DISABLE_BATCH_SIZE = {"cpu": 4}  # by device type; others (CUDA) take DEFAULT_DISABLE_BATCH_SIZE
DEFAULT_DISABLE_BATCH_SIZE = 32


def disable_batch_size(configured: int | None, device: torch.device) -> int:
    """The running batch size from which no request drafts."""
    if configured is not None:
        return configured
    return DISABLE_BATCH_SIZE.get(device.type, DEFAULT_DISABLE_BATCH_SIZE)


@dataclass
class Acceptance:
    """A request's per-token acceptance rate a: the chance that a draft is accepted once the
    drafts before it were. A verify step that accepts j of k drafts tried j + 1 of them (j
    successes and the rejection) when j < k, and k when all were accepted; the rate is the ratio
    of the moving averages of successes and tries. (accepted / drafted would count the drafts
    after the first rejection as failures too: at a = 0.6 and k = 5 it reads 0.28.)"""

    accepted: float = INITIAL_ACCEPTANCE
    tried: float = 1.0

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        tried = num_accepted + (num_accepted < num_drafts)
        self.accepted += ACCEPTANCE_EMA * (num_accepted - self.accepted)
        self.tried += ACCEPTANCE_EMA * (tried - self.tried)


def num_draft_tokens(
    k_max: int, acceptance: float, batch_size: int, disable_batch_size: int
) -> int:
    if batch_size >= disable_batch_size:
        return 0
    k_batch = math.ceil(k_max * (1 - batch_size / disable_batch_size))
    if acceptance >= 1.0:
        k_accept = k_max
    elif acceptance <= 0.0:
        k_accept = 1
    else:
        k_accept = max(1, math.floor(math.log(MIN_ACCEPT_PROB) / math.log(acceptance)))
    return min(k_max, k_batch, k_accept)
