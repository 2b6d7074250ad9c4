"""Cost-aware draft length: draft only as much as the measured step times pay for.

Speculation is a trade: a verify step of b requests with k drafts each computes b * (k + 1)
positions (plus the proposer's work) and yields, per request with per-token acceptance a,
E(k) = 1 + a + ... + a**k tokens on average. Plain decoding computes b positions for b tokens.
Whether the trade pays depends on the hardware and the model: on a GPU a few extra positions cost
almost nothing while decode is memory-bound, on a CPU the linear layers are compute-bound after a
few rows and a weak proposer loses time even at batch 1. So the engine measures instead of
assuming (the goodput criterion of SmartSpec, Liu et al. 2024): it keeps the seconds of recent
decode steps by the number of positions they computed and the proposer's seconds per drafted
position, and each step picks the k that maximizes expected tokens per second, k = 0 (plain
decoding) included.

The acceptance and batch limits of `adaptive.py` still cap k. Until both a plain and a verify step
have been timed, and in one of every `PROBE_PERIOD` decisions, the other side is tried, so a cost
that changes (another batch size, another prompt) is noticed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

COST_EMA = 0.2  # weight of the newest sample in each moving average
PROBE_PERIOD = 32  # one decision in this many measures the side not chosen


class StepCosts:
    """Moving averages of decode-step seconds by positions computed, and proposer seconds per
    drafted position."""

    def __init__(self) -> None:
        self.step_s: dict[int, float] = {}  # positions computed in a decode step -> seconds
        self.propose_s_per_draft: float | None = None

    def observe_step(self, num_positions: int, seconds: float) -> None:
        old = self.step_s.get(num_positions)
        self.step_s[num_positions] = seconds if old is None else old + COST_EMA * (seconds - old)

    def observe_propose(self, max_drafts: int, seconds: float) -> None:
        """A proposer call that drafted up to `max_drafts` tokens per request took `seconds`."""
        if max_drafts < 1:
            return
        sample = seconds / max_drafts
        old = self.propose_s_per_draft
        self.propose_s_per_draft = sample if old is None else old + COST_EMA * (sample - old)

    def step_seconds(self, num_positions: int) -> float | None:
        """Seconds of a decode step over `num_positions`: measured, else interpolated (or
        extrapolated) between the nearest measured sizes; None with fewer than two."""
        known = self.step_s.get(num_positions)
        if known is not None:
            return known
        sizes = sorted(self.step_s)
        if len(sizes) < 2:
            return None
        i = min(max(bisect.bisect(sizes, num_positions), 1), len(sizes) - 1)
        x0, x1 = sizes[i - 1], sizes[i]
        y0, y1 = self.step_s[x0], self.step_s[x1]
        return max(y0 + (y1 - y0) * (num_positions - x0) / (x1 - x0), 0.0)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step with k drafts yields on average at per-token acceptance a."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(sum(a**i for i in range(k + 1)))


class DraftLengthControl:
    """Each step's draft length by the measured costs (one per engine)."""

    def __init__(self) -> None:
        self.costs = StepCosts()
        self.decisions = 0

    def choose(self, acceptances: Sequence[float], caps: Sequence[int], num_decoding: int) -> int:
        """The draft length for a step of `num_decoding` decoding requests, of which those that
        speculate may draft up to `caps` tokens each (0: plain decoding). A cost not measured
        yet is measured first (the proposer's and a verify step's by drafting, a plain step's
        by not), and one decision in PROBE_PERIOD takes the side not chosen, so the costs stay
        current."""
        most = max(caps, default=0)
        best = best_draft_length(self.costs, acceptances, caps, num_decoding)
        self.decisions += 1
        if best is None:
            plain_known = self.costs.step_seconds(num_decoding) is not None
            return most if plain_known or self.costs.propose_s_per_draft is None else 0
        if self.decisions % PROBE_PERIOD == 0:
            return most if best == 0 else 0
        return best


def best_draft_length(
    costs: StepCosts, acceptances: Sequence[float], caps: Sequence[int], num_decoding: int
) -> int | None:
    """The k (0 = no drafts) that maximizes expected tokens per second for a step of
    `num_decoding` requests, of which those with `caps` would draft min(k, cap) tokens each;
    None while a needed cost is unmeasured."""
    plain = costs.step_seconds(num_decoding)
    per_draft = costs.propose_s_per_draft
    if plain is None or per_draft is None or plain <= 0:
        return None
    others = num_decoding - len(caps)  # decoding without speculation: one token each
    best_k, best_rate = 0, num_decoding / plain
    for k in range(1, max(caps, default=0) + 1):
        drafts = [min(k, cap) for cap in caps]
        seconds = costs.step_seconds(num_decoding + sum(drafts))
        if seconds is None:
            return None
        tokens = others + sum(
            expected_tokens(a, d) for a, d in zip(acceptances, drafts, strict=True)
        )
        rate = tokens / (seconds + per_draft * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
