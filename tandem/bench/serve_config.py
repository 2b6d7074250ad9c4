"""What `tandem bench serve` and `bench sla` run and what one load point yields: the run's
config (`ServeConfig`), its load points (`sweep_points`) and a point's result (`PointResult`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tandem.bench.serving_metrics import SLO, Summary
from tandem.bench.workloads import LoadPoint, Sent, WorkloadConfig, WorkloadError

HTTP_CHUNK_TOKENS = ("events", "text")


@dataclass(frozen=True)
class ServeConfig:
    url: str = "http://127.0.0.1:8000"  # the router's HTTP API (and its /metrics)
    grpc: str | None = None  # send over the gRPC API at this target instead of HTTP
    admin: str | None = None  # admin gRPC target for ListWorkers (default: `grpc`)
    admin_token: str | None = None
    model: str = ""  # the request's model field ("" = the cluster's)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    points: tuple[LoadPoint, ...] = (LoadPoint(concurrency=1),)
    max_requests: int | None = None  # per point; None: the pool (or unbounded with duration_s)
    duration_s: float | None = None  # per point: stop sending after this
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    slo: SLO = field(default_factory=SLO)
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request, on the client
    vocab_size: int | None = None  # token workloads; None: from the served model's config
    http_chunk_tokens: str = "events"
    server_metrics: bool = True
    leak_wait_s: float = 10.0
    out: str | None = None
    plots: bool = True

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("no load point")
        if self.http_chunk_tokens not in HTTP_CHUNK_TOKENS:
            raise ValueError(f"http_chunk_tokens must be one of {HTTP_CHUNK_TOKENS}")
        for name in ("warmup_s", "cooldown_s", "leak_wait_s", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.workload.name == "json-schema:forced" and not self.grpc:
            raise ValueError("json-schema:forced sets `speculative` per request: it needs --grpc")

    @property
    def api(self) -> str:
        return "grpc" if self.grpc else "http"

    @property
    def seed(self) -> int:
        return self.workload.seed

    @property
    def slo_given(self) -> SLO | None:
        s = self.slo
        return s if (s.ttft_s, s.tpot_s, s.e2e_s) != (None, None, None) else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["admin_token"] = "***" if self.admin_token else None
        out["api"] = self.api
        return out


def parse_list(text: str | None, kind: Callable[[str], Any]) -> list[Any]:
    """'1,2,4' -> [1, 2, 4] (empty or None -> [])."""
    return [kind(x.strip()) for x in (text or "").split(",") if x.strip()]


def sweep_points(
    rate: float | None,
    concurrency: int | None,
    rates: Sequence[float] = (),
    concurrencies: Sequence[int] = (),
    burstiness: float = 1.0,
    ramp_up_s: float = 0.0,
    trace: bool = False,
) -> tuple[LoadPoint, ...]:
    """The load points of a run: one per rate of `rates` (each capped at `concurrency`) or per
    concurrency of `concurrencies` (each at `rate`, or closed loop); else the single point. A
    trace without a rate replays its own arrival times (capped at `concurrency` when given)."""
    if rates and concurrencies:
        raise WorkloadError("give --rates or --concurrencies, not both")
    if rates:
        return tuple(LoadPoint(r, concurrency, burstiness, ramp_up_s) for r in rates)
    if concurrencies:
        if trace and rate is None:
            return tuple(LoadPoint(None, c, trace=True) for c in concurrencies)
        return tuple(LoadPoint(rate, c, burstiness, ramp_up_s) for c in concurrencies)
    if trace and rate is None:
        return (LoadPoint(None, concurrency, trace=True),)
    if rate is None and concurrency is None:
        concurrency = 1
    return (LoadPoint(rate, concurrency, burstiness, ramp_up_s),)


@dataclass
class PointResult:
    point: LoadPoint
    sents: list[Sent]
    kept: list[Sent]  # in the measured window
    summary: Summary
    report: dict[str, Any]
