"""Autoscaler inputs from Prometheus text: histogram buckets, quantiles, windows."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tandem.cluster.signals import histogram_buckets, quantile

BUCKETS = (0.1, 0.5, 1.0, 5.0)


def exposition(values: list[float]) -> str:
    registry = CollectorRegistry()
    h = Histogram("tandem_worker_ttft_seconds", "TTFT", buckets=BUCKETS, registry=registry)
    for v in values:
        h.observe(v)
    return generate_latest(registry).decode()


def test_buckets_are_read_cumulatively() -> None:
    buckets = histogram_buckets(exposition([0.05, 0.3, 0.3, 2.0]), "tandem_worker_ttft_seconds")
    assert buckets == {0.1: 1, 0.5: 3, 1.0: 3, 5.0: 4, float("inf"): 4}


def test_quantile_is_the_upper_bound_of_its_bucket() -> None:
    buckets = histogram_buckets(exposition([0.05] * 8 + [0.7, 3.0]), "tandem_worker_ttft_seconds")
    assert quantile(buckets, 0.5) == 0.1
    assert quantile(buckets, 0.9) == 1.0
    assert quantile(buckets, 1.0) == 5.0


def test_no_observations_means_no_quantile() -> None:
    assert quantile(histogram_buckets(exposition([]), "tandem_worker_ttft_seconds"), 0.9) is None
    assert quantile({}, 0.9) is None


def test_values_past_the_last_bound_report_the_last_finite_bound() -> None:
    buckets = histogram_buckets(exposition([9.0, 9.0]), "tandem_worker_ttft_seconds")
    assert quantile(buckets, 0.9) == 5.0
