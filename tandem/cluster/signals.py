"""The autoscaler's inputs, read from the workers: p90 TTFT of the prefill pool and p90 TPOT of
the decode pool over the last window (from the deltas of their Prometheus histograms), the
prefill queue and the decode pool's KV usage (from the registry)."""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from tandem.cluster.autoscaler import ClusterMetrics
from tandem.registry import Registry, WorkerRecord

log = logging.getLogger(__name__)

Buckets = dict[float, float]  # upper bound -> cumulative count


def histogram_buckets(text: str, name: str) -> Buckets:
    """Cumulative buckets of the histogram `name` in a Prometheus text exposition."""
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                out[float(sample.labels["le"])] = sample.value
    return out


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile's bucket upper bound (None without observations), as Prometheus'
    histogram_quantile does without interpolation."""
    total = buckets.get(float("inf"), 0.0)
    if total <= 0:
        return None
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound if bound != float("inf") else max(b for b in buckets if b != float("inf"))
    return None


def _delta(now: Buckets, before: Buckets) -> Buckets:
    return {b: now[b] - before.get(b, 0.0) for b in now}


def _sum(many: Iterable[Buckets]) -> Buckets:
    out: Buckets = {}
    for buckets in many:
        for b, v in buckets.items():
            out[b] = out.get(b, 0.0) + v
    return out


class ClusterSignals:
    """Scrapes the workers each call; windows are the time between calls."""

    def __init__(self, registry: Registry, model: str, timeout_s: float = 1.0) -> None:
        self.registry = registry
        self.model = model
        self.timeout_s = timeout_s
        self._last: dict[tuple[str, str], Buckets] = {}  # (worker, histogram) -> buckets

    def _window(self, worker: WorkerRecord, name: str, text: str) -> Buckets:
        now = histogram_buckets(text, name)
        before = self._last.get((worker.worker_id, name), {})
        self._last[(worker.worker_id, name)] = now
        return _delta(now, before)

    def _scrape(self, workers: list[WorkerRecord], name: str) -> Buckets:
        windows = []
        for w in workers:
            if not w.metrics_url:
                continue
            try:
                with urllib.request.urlopen(w.metrics_url, timeout=self.timeout_s) as response:
                    text = response.read().decode()
            except OSError as e:
                log.info("cannot scrape %s: %s", w.worker_id, e)
                continue
            windows.append(self._window(w, name, text))
        return _sum(windows)

    def observe(self) -> ClusterMetrics:
        prefill = self.registry.workers(model=self.model, role="prefill")
        decode = self.registry.workers(model=self.model, role="decode")
        ttft = self._scrape(prefill, "tandem_worker_ttft_seconds")
        tpot = self._scrape(decode, "tandem_worker_tpot_seconds")
        usage = [w.kv_usage for w in decode]
        return ClusterMetrics(
            time=time.monotonic(),
            num_prefill=len(prefill),
            num_decode=len(decode),
            ttft_p90_s=quantile(ttft, 0.9),
            tpot_p90_s=quantile(tpot, 0.9),
            prefill_queue=sum(w.waiting for w in prefill),
            decode_kv_usage=sum(usage) / len(usage) if usage else 0.0,
        )


def worker_summary(metrics_url: str, timeout_s: float = 1.0) -> dict[str, float | None]:
    """A worker's p50 TTFT and TPOT since it started and its draft acceptance rate, read from
    its /metrics (empty when it cannot be reached)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return {}
    accepted = drafted = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_spec_accepted_tokens_total":
                accepted += sample.value
            elif sample.name == "tandem_spec_draft_tokens_total":
                drafted += sample.value
    return {
        "ttft_p50": quantile(histogram_buckets(text, "tandem_worker_ttft_seconds"), 0.5),
        "tpot_p50": quantile(histogram_buckets(text, "tandem_worker_tpot_seconds"), 0.5),
        "acceptance": accepted / drafted if drafted else None,
    }
