"""SLO autoscaler: decides the size of the prefill and the decode pool from cluster metrics.

Prefill capacity sets TTFT, decode capacity sets TPOT, so each pool has its own signals:

    prefill pool   up: p90 TTFT above its SLO, or prefill queue per worker above `queue_high`
                   down: p90 TTFT under `down_fraction` of the SLO and the queue nearly empty
    decode pool    up: p90 TPOT above its SLO, or mean KV usage above `kv_high`
                   down: p90 TPOT under `down_fraction` of the SLO and KV usage under `kv_low`

Hysteresis and cooldown keep it from oscillating: a condition must hold for `up_after` (or
`down_after`) consecutive observations, a pool changes at most once per `up_cooldown_s` (or
`down_cooldown_s`, counted from that pool's last change in either direction), one worker per
decision, within [min, max]. A scale-down is carried out by draining a worker, never by killing
it. A pool's size counts its workers asked for and not serving yet (pending placement, or loading
the model): a pool never grows while some are pending (the capacity is on its way, and one more
would likely wait for the same resources). A size set by hand (`hold`) stands for
`manual_hold_s`: the autoscaler does not change that pool meanwhile, and its streaks restart.
`observe` is a pure function of the observations fed to it (time comes with each one), so
recorded metric series replay deterministically; every decision carries its inputs for the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AutoscalerConfig:
    ttft_p90_slo_s: float = 2.0
    tpot_p90_slo_s: float = 0.2
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    queue_high: float = 4.0  # waiting prefill requests per prefill worker
    queue_low: float = 0.5
    kv_high: float = 0.85  # mean KV usage of the decode pool
    kv_low: float = 0.4
    down_fraction: float = 0.5  # "well under the SLO"
    up_after: int = 2  # consecutive observations before acting
    down_after: int = 6
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 180.0
    manual_hold_s: float = 600.0  # a size set by hand stands this long

    def __post_init__(self) -> None:
        if not (
            1 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode <= self.max_decode
        ):
            raise ValueError("need 1 <= min <= max for both pools")
        if not 0 < self.down_fraction < 1:
            raise ValueError(f"down_fraction must be in (0, 1), got {self.down_fraction}")


@dataclass(frozen=True)
class ClusterMetrics:
    """One observation of the cluster (the router's histograms and the workers' gauges)."""

    time: float  # seconds, any monotonic origin
    num_prefill: int
    num_decode: int
    ttft_p90_s: float | None  # None: no finished requests in the window
    tpot_p90_s: float | None
    prefill_queue: int  # requests waiting on prefill workers
    decode_kv_usage: float  # mean over decode workers, 0..1
    pending_prefill: int = 0  # workers asked for, not serving yet (placing or loading)
    pending_decode: int = 0


@dataclass(frozen=True)
class Decision:
    time: float
    pool: str  # "prefill" | "decode"
    current: int
    target: int
    reason: str
    inputs: ClusterMetrics

    @property
    def drains(self) -> bool:
        return self.target < self.current


@dataclass
class _PoolState:
    up_streak: int = 0
    down_streak: int = 0
    last_change: float = field(default=float("-inf"))
    hold_until: float = field(default=float("-inf"))


class Autoscaler:
    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config or AutoscalerConfig()
        self._pools = {"prefill": _PoolState(), "decode": _PoolState()}

    def hold(self, pool: str, at: float) -> None:
        """An operator set `pool`'s size at time `at`: leave it alone for `manual_hold_s`."""
        s = self._pools[pool]
        s.hold_until, s.last_change = at + self.config.manual_hold_s, at
        s.up_streak = s.down_streak = 0

    def observe(self, m: ClusterMetrics) -> list[Decision]:
        """The decisions this observation triggers (at most one per pool)."""
        c = self.config
        decisions = []
        per_worker_queue = m.prefill_queue / max(m.num_prefill, 1)
        prefill = self._decide(
            "prefill",
            m,
            m.num_prefill,
            m.pending_prefill,
            c.min_prefill,
            c.max_prefill,
            up=_over(m.ttft_p90_s, c.ttft_p90_slo_s, "p90 TTFT")
            or (
                f"prefill queue {per_worker_queue:.1f}/worker"
                if per_worker_queue > c.queue_high
                else None
            ),
            down=_under(m.ttft_p90_s, c.ttft_p90_slo_s * c.down_fraction)
            and per_worker_queue <= c.queue_low,
        )
        decode = self._decide(
            "decode",
            m,
            m.num_decode,
            m.pending_decode,
            c.min_decode,
            c.max_decode,
            up=_over(m.tpot_p90_s, c.tpot_p90_slo_s, "p90 TPOT")
            or (f"KV usage {m.decode_kv_usage:.0%}" if m.decode_kv_usage > c.kv_high else None),
            down=_under(m.tpot_p90_s, c.tpot_p90_slo_s * c.down_fraction)
            and m.decode_kv_usage < c.kv_low,
        )
        for d in (prefill, decode):
            if d is not None:
                decisions.append(d)
        return decisions

    def _decide(
        self,
        pool: str,
        m: ClusterMetrics,
        serving: int,
        pending: int,
        lo: int,
        hi: int,
        up: str | None,
        down: bool,
    ) -> Decision | None:
        c, s = self.config, self._pools[pool]
        if m.time < s.hold_until:
            return None
        s.up_streak = s.up_streak + 1 if up else 0
        s.down_streak = s.down_streak + 1 if down and not up else 0
        since = m.time - s.last_change
        current = serving + pending
        grows = up and not pending and current < hi
        if grows and s.up_streak >= c.up_after and since >= c.up_cooldown_s:
            s.last_change, s.up_streak = m.time, 0
            return Decision(m.time, pool, current, current + 1, f"{up} for {c.up_after} obs", m)
        if s.down_streak >= c.down_after and since >= c.down_cooldown_s and current > lo:
            s.last_change, s.down_streak = m.time, 0
            reason = f"under {c.down_fraction:.0%} of SLO, idle capacity for {c.down_after} obs"
            return Decision(m.time, pool, current, current - 1, reason, m)
        return None


def _over(value: float | None, slo: float, name: str) -> str | None:
    if value is None or value <= slo:
        return None
    return f"{name} {value:.3f}s > SLO {slo:.3f}s"


def _under(value: float | None, bound: float) -> bool:
    """Well under the SLO; no data (an idle pool) counts as under."""
    return value is None or value < bound
