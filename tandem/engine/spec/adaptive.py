"""How many tokens to draft next: fewer when drafts get rejected, none when the batch is large.

Speculation pays while decode is memory-bound: verifying k extra tokens costs little at small
batch and real compute at large batch. Two limits, the smaller wins:

- acceptance: with a per-token acceptance rate a (a moving average per request), the k-th draft
  is reached and accepted with probability ~ a**k; drafting stops at the k where that falls below
  `min_accept_prob`. At least one token is still drafted, so a request whose acceptance recovers
  is noticed.
- batch: k shrinks linearly with the running batch and is 0 from `disable_batch_size` on.
"""

from __future__ import annotations

import math

ACCEPTANCE_EMA = 0.3  # weight of the newest step in a request's acceptance moving average
INITIAL_ACCEPTANCE = 0.6
MIN_ACCEPT_PROB = 0.25


def update_acceptance(average: float, num_drafts: int, num_accepted: int) -> float:
    return average + ACCEPTANCE_EMA * (num_accepted / num_drafts - average)


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
