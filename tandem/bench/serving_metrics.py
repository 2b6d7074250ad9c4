"""Serving metrics over client-side request timelines, exactly as defined in BENCHMARKS.md.

A `Timeline` is what a load generator records for one request: when it was sent, when each
streamed chunk arrived and how many tokens it carried (speculative decoding sends several), the
server's token counts, and the outcome. `summarize` turns a run's timelines into the report:

    TTFT           first chunk holding >= 1 token - send time
    TPOT           (t_last_token - t_first_token) / (n_out - 1), per request, when n_out > 1
    ITL (chunk)    gaps between consecutive chunks with tokens, pooled over requests
    ITL (token)    each chunk gap divided by the tokens in that chunk
    E2E            t_last_token - send time
    client queue   time waiting behind the client's own concurrency limit (reported apart)
    throughput     requests/s, output tokens/s, total tokens/s over the measured window
    goodput        requests/s that met every SLO given; failed requests are never good

Latency statistics: count, mean, std (population), min, max and p50/p90/p95/p99, percentiles by
linear interpolation between closest ranks (numpy's default "linear" method).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Timeline:
    send_time: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    prompt_tokens: int = 0  # server-reported usage
    output_tokens: int | None = None  # server-reported; None: count the streamed tokens
    queue_s: float = 0.0  # waited behind the client's concurrency limit before send_time
    error: str | None = None  # status code name / HTTP status when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def token_chunks(self) -> list[tuple[float, int]]:
        return [(t, n) for t, n in self.chunks if n > 0]

    @property
    def n_out(self) -> int:
        streamed = sum(n for _, n in self.chunks)
        return self.output_tokens if self.output_tokens is not None else streamed

    @property
    def ttft(self) -> float | None:
        chunks = self.token_chunks
        return chunks[0][0] - self.send_time if chunks else None

    @property
    def e2e(self) -> float | None:
        chunks = self.token_chunks
        return chunks[-1][0] - self.send_time if chunks else None

    @property
    def tpot(self) -> float | None:
        chunks = self.token_chunks
        if not chunks or self.n_out <= 1:
            return None
        return (chunks[-1][0] - chunks[0][0]) / (self.n_out - 1)

    def itl_chunk(self) -> list[float]:
        times = [t for t, _ in self.token_chunks]
        return [b - a for a, b in itertools.pairwise(times)]

    def itl_token(self) -> list[float]:
        chunks = self.token_chunks
        return [(b - a) / n for (a, _), (b, n) in itertools.pairwise(chunks)]


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float
    std: float
    min: float
    max: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats | None:
        if not values:
            return None
        n = len(values)
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
        p = [percentile(values, q) for q in PERCENTILES]
        return cls(n, mean, std, min(values), max(values), *p)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, t: Timeline) -> bool:
        if not t.ok:
            return False
        for limit, value in ((self.ttft_s, t.ttft), (self.tpot_s, t.tpot), (self.e2e_s, t.e2e)):
            if limit is not None and (value is None or value > limit):
                return False
        return True


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    errors: dict[str, int]
    window_s: float
    request_throughput: float  # requests/s (completed ok)
    output_throughput: float  # output tokens/s
    total_throughput: float  # (prompt + output) tokens/s
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    ttft: Stats | None
    tpot: Stats | None
    itl_chunk: Stats | None
    itl_token: Stats | None
    e2e: Stats | None
    client_queue: Stats | None


def measured(timelines: Sequence[Timeline], warmup_s: float, cooldown_s: float) -> list[Timeline]:
    """Requests sent after the warm-up and finished before the cool-down of the run."""
    if not timelines:
        return []
    start = min(t.send_time for t in timelines) + warmup_s
    ends = [t.chunks[-1][0] if t.chunks else t.send_time for t in timelines]
    stop = max(ends) - cooldown_s
    return [
        t for t, end in zip(timelines, ends, strict=True) if t.send_time >= start and end <= stop
    ]


def summarize(timelines: Sequence[Timeline], slo: SLO | None = None) -> Summary:
    """The report over these timelines (already cut to the measured window)."""
    ok = [t for t in timelines if t.ok]
    if timelines:
        first = min(t.send_time for t in timelines)
        last = max(t.chunks[-1][0] if t.chunks else t.send_time for t in timelines)
        window = last - first
    else:
        window = 0.0

    def rate(x: float) -> float:
        return x / window if window > 0 else 0.0

    out_tokens = sum(t.n_out for t in ok)
    all_tokens = out_tokens + sum(t.prompt_tokens for t in ok)
    return Summary(
        num_requests=len(timelines),
        num_ok=len(ok),
        errors=dict(Counter(t.error for t in timelines if t.error is not None)),
        window_s=window,
        request_throughput=rate(len(ok)),
        output_throughput=rate(out_tokens),
        total_throughput=rate(all_tokens),
        goodput=rate(sum(slo.met(t) for t in timelines)) if slo is not None else None,
        ttft=Stats.of([v for t in ok if (v := t.ttft) is not None]),
        tpot=Stats.of([v for t in ok if (v := t.tpot) is not None]),
        itl_chunk=Stats.of([g for t in ok for g in t.itl_chunk()]),
        itl_token=Stats.of([g for t in ok for g in t.itl_token()]),
        e2e=Stats.of([v for t in ok if (v := t.e2e) is not None]),
        client_queue=Stats.of([t.queue_s for t in timelines]),
    )
