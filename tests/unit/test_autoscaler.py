"""The SLO autoscaler on recorded metric series: no clocks, no Ray, deterministic replays."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from tandem.cluster.autoscaler import Autoscaler, AutoscalerConfig, ClusterMetrics, Decision

CONFIG = AutoscalerConfig(
    ttft_p90_slo_s=1.0,
    tpot_p90_slo_s=0.1,
    max_prefill=4,
    max_decode=4,
    up_after=2,
    down_after=4,
    up_cooldown_s=30,
    down_cooldown_s=120,
)
STEP_S = 10.0  # one observation every 10 s


def quiet(t: float, p: int = 1, d: int = 1) -> ClusterMetrics:
    return ClusterMetrics(
        t, p, d, ttft_p90_s=0.3, tpot_p90_s=0.04, prefill_queue=0, decode_kv_usage=0.2
    )


def replay(series: list[ClusterMetrics], config: AutoscalerConfig = CONFIG) -> list[Decision]:
    """Feed the series, applying each decision to the pool sizes of later observations, as the
    controller would."""
    scaler = Autoscaler(config)
    sizes = {"prefill": series[0].num_prefill, "decode": series[0].num_decode}
    decisions = []
    for m in series:
        m = ClusterMetrics(
            m.time, sizes["prefill"], sizes["decode"], m.ttft_p90_s, m.tpot_p90_s,
            m.prefill_queue, m.decode_kv_usage,
        )  # fmt: skip
        for d in scaler.observe(m):
            sizes[d.pool] = d.target
            decisions.append(d)
    return decisions


def series(n: int, make, start: float = 0.0) -> list[ClusterMetrics]:  # type: ignore[no-untyped-def]
    return [make(start + i * STEP_S) for i in range(n)]


def test_a_step_in_long_prompts_scales_the_prefill_pool_only() -> None:
    def long_prompts(t: float) -> ClusterMetrics:
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=2.5, tpot_p90_s=0.05, prefill_queue=9, decode_kv_usage=0.3
        )

    decisions = replay(series(3, quiet) + series(6, long_prompts, start=30))
    assert [(d.pool, d.current, d.target) for d in decisions] == [
        ("prefill", 1, 2),
        ("prefill", 2, 3),  # still over the SLO after the 30 s cooldown
    ]
    first = decisions[0]
    assert first.time == 40  # the second consecutive observation over the SLO
    assert "TTFT" in first.reason and first.inputs.ttft_p90_s == 2.5


def test_long_generations_scale_the_decode_pool_on_tpot_or_kv_usage() -> None:
    def slow_decode(t: float) -> ClusterMetrics:
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=0.4, tpot_p90_s=0.25, prefill_queue=0, decode_kv_usage=0.5
        )

    def kv_full(t: float) -> ClusterMetrics:
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=0.4, tpot_p90_s=0.08, prefill_queue=0, decode_kv_usage=0.95
        )

    for make, cause in ((slow_decode, "TPOT"), (kv_full, "KV usage")):
        decisions = replay(series(2, quiet) + series(3, make, start=20))
        assert [(d.pool, d.target) for d in decisions] == [("decode", 2)]
        assert cause in decisions[0].reason


def test_steady_load_near_the_thresholds_does_not_flap() -> None:
    # TTFT alternates just above and below the SLO: never two consecutive breaches, and never
    # long enough under half the SLO to scale down.
    def jitter(t: float) -> ClusterMetrics:
        over = int(t / STEP_S) % 2 == 0
        return ClusterMetrics(
            t, 2, 2, ttft_p90_s=1.05 if over else 0.9, tpot_p90_s=0.09, prefill_queue=2,
            decode_kv_usage=0.6,
        )  # fmt: skip

    assert replay(series(200, jitter)) == []


def test_scale_down_waits_for_the_cooldown_then_drains_one_worker_at_a_time() -> None:
    def burst(t: float) -> ClusterMetrics:
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=3.0, tpot_p90_s=0.05, prefill_queue=12, decode_kv_usage=0.3
        )

    decisions = replay(series(2, burst) + series(60, quiet, start=20))
    up, *downs = decisions
    assert (up.pool, up.target, up.time) == ("prefill", 2, 10)
    assert downs, "idle capacity was never given back"
    down = downs[0]
    assert (down.pool, down.current, down.target) == ("prefill", 2, 1)
    assert down.drains
    assert down.time - up.time >= CONFIG.down_cooldown_s  # not before the cooldown
    assert all(d.pool == "prefill" for d in downs) and len(downs) == 1  # and never below min


def test_bounds_hold() -> None:
    def overload(t: float) -> ClusterMetrics:
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=9.0, tpot_p90_s=0.9, prefill_queue=50, decode_kv_usage=0.99
        )

    decisions = replay(series(100, overload))
    assert max(d.target for d in decisions if d.pool == "prefill") == CONFIG.max_prefill
    assert max(d.target for d in decisions if d.pool == "decode") == CONFIG.max_decode
    times = [d.time for d in decisions if d.pool == "decode"]
    assert all(b - a >= CONFIG.up_cooldown_s for a, b in itertools.pairwise(times))


def test_no_data_is_not_a_breach() -> None:
    def idle(t: float) -> ClusterMetrics:
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=None, tpot_p90_s=None, prefill_queue=0, decode_kv_usage=0.0
        )

    assert replay(series(50, idle)) == []


@pytest.mark.parametrize(
    "kwargs", [{"min_prefill": 0}, {"min_decode": 3, "max_decode": 2}, {"down_fraction": 1.5}]
)
def test_bad_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AutoscalerConfig(**kwargs)


def test_replay_is_deterministic() -> None:
    def wave(t: float) -> ClusterMetrics:
        x = math.sin(t / 300)
        return ClusterMetrics(
            t, 1, 1, ttft_p90_s=1 + 1.5 * x, tpot_p90_s=0.1 + 0.1 * x,
            prefill_queue=max(0, int(8 * x)), decode_kv_usage=0.5 + 0.4 * x,
        )  # fmt: skip

    assert replay(series(300, wave)) == replay(series(300, wave))


def overloaded(t: float, pending_prefill: int = 0) -> ClusterMetrics:
    return ClusterMetrics(
        t, 1, 1, ttft_p90_s=3.0, tpot_p90_s=0.05, prefill_queue=12, decode_kv_usage=0.3,
        pending_prefill=pending_prefill,
    )  # fmt: skip


def test_pending_workers_count_and_the_pool_does_not_grow_while_they_wait() -> None:
    scaler = Autoscaler(CONFIG)
    # One prefill worker serves, one more waits for a placement: no second one is asked for.
    assert [d for t in range(0, 200, 10) for d in scaler.observe(overloaded(t, 1))] == []
    # Once it serves (2 of them, still over the SLO), the pool grows from 2, not from 1.
    (d,) = [d for t in (200, 210) for d in scaler.observe(replace(overloaded(t), num_prefill=2))]
    assert (d.pool, d.current, d.target) == ("prefill", 2, 3)
    # A scale-down counts the pending ones too: 1 serving + 1 pending -> 1.
    scaler = Autoscaler(CONFIG)
    downs = [
        d for t in range(0, 100, 10) for d in scaler.observe(replace(quiet(t), pending_decode=1))
    ]
    assert [(d.pool, d.current, d.target) for d in downs] == [("decode", 2, 1)]


def test_a_manual_size_holds_the_autoscaler_off_that_pool_for_its_hold_time() -> None:
    scaler = Autoscaler(CONFIG)
    scaler.hold("prefill", at=0.0)
    held = [
        d for t in range(0, int(CONFIG.manual_hold_s), 10) for d in scaler.observe(overloaded(t))
    ]
    assert held == []
    # After the hold, the usual streak of breaches: the second observation acts.
    start = CONFIG.manual_hold_s
    (d,) = [d for t in (start, start + 10) for d in scaler.observe(overloaded(t))]
    assert (d.pool, d.time) == ("prefill", start + 10)
    # The other pool was never held: an overloaded decode pool grows during a prefill hold.
    scaler = Autoscaler(CONFIG)
    scaler.hold("prefill", at=0.0)
    slow = [replace(overloaded(t), tpot_p90_s=0.5) for t in (0, 10)]
    assert [d.pool for m in slow for d in scaler.observe(m)] == ["decode"]
