"""Simulated engine (`engine="sim"`): the real scheduler and KV block accounting, a modelled clock.

Only the model runner is replaced. `SimRunner` sleeps for the step time a `SimProfile` predicts
from the step's scheduled tokens, then returns deterministic tokens (a hash of the prompt and the
position, never an EOS id), so a simulated cluster answers reproducibly. Its KV caches are real
tensors of a tiny layout (`sim_layers` x [2, num_blocks, block_size, 1, 1]), so KV transfers run
through the real planes at almost no cost; a decode worker sees each arrival once the modelled
transfer time (`transfer_s`) has passed (`HeldArrivals`). The number of KV blocks follows the real
model's KV bytes per token, so admission and preemption see the real model's capacity. The sim
plugs in where the real engine is built (executor.py); nothing else tells them apart.

The step-time model (fitted by `tandem bench calibrate` on the real engine):

    step_s = step_overhead_s + prefill_s_per_token * prefill_tokens
             + decode_s_per_seq * decode_batch + decode_s_per_context_token * decode_context

where a request scheduled for more than its one next token (a prompt chunk, a recompute, or
speculative drafts) counts its extra tokens as prefill tokens, and decode_context is the sum of
the context lengths of the decoding requests.
"""

from __future__ import annotations

import json
import time
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from tandem.engine.request import Request
from tandem.engine.runner import StepResult
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.model_config import ModelConfig

__all__ = [
    "ArrivalSource",
    "HeldArrivals",
    "SimModel",
    "SimProfile",
    "SimRunner",
    "TimedArrival",
    "sim_token",
]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SimProfile:
    """Timing model of one engine (seconds and bytes); all-zero costs by default."""

    step_overhead_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_seq: float = 0.0
    decode_s_per_context_token: float = 0.0
    kv_bytes_per_token: int = 0  # 0: the real model's layout in the engine's dtype
    transfer_bytes_per_s: float = 0.0  # 0: no modelled transfer time
    transfer_latency_s: float = 0.0
    sim_layers: int = 1  # layers of the tiny KV layout that travels (layer-wise streaming)
    source: dict[str, Any] = field(default_factory=dict)  # what it was calibrated on
    samples: list[dict[str, float]] = field(default_factory=list)  # the measurements fitted

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        if self.sim_layers < 1:
            raise ValueError(f"sim_layers must be >= 1, got {self.sim_layers}")

    # -- the model ----------------------------------------------------------------------------

    def time_of(self, prefill_tokens: float, decode_batch: float, decode_context: float) -> float:
        if not (prefill_tokens or decode_batch):
            return 0.0
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_batch
            + self.decode_s_per_context_token * decode_context
        )

    def step_time(self, scheduled: Sequence[ScheduledRequest]) -> float:
        return self.time_of(*step_shape(scheduled))

    def transfer_s(self, num_tokens: int) -> float:
        """Modelled time to move `num_tokens` tokens of KV from a prefill to a decode worker."""
        if not self.transfer_bytes_per_s:
            return self.transfer_latency_s if num_tokens else 0.0
        nbytes = self.kv_bytes_per_token * num_tokens
        return self.transfer_latency_s + nbytes / self.transfer_bytes_per_s

    # -- files --------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sim profile keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path | None) -> SimProfile:
        """A profile file; None (or "zero") gives the all-zero profile."""
        if path is None or str(path) == "zero":
            return cls()
        return cls.from_dict(json.loads(Path(path).read_text()))


def step_shape(scheduled: Sequence[ScheduledRequest]) -> tuple[int, int, int]:
    """(prefill tokens, decode batch, decode context tokens) of a step."""
    prefill = batch = context = 0
    for s in scheduled:
        r = s.request
        if s.num_new_tokens == 1 and r.num_computed_tokens >= r.num_prompt_tokens:
            batch += 1
            context += r.num_computed_tokens + 1
        elif r.num_computed_tokens >= r.num_prompt_tokens and s.draft_token_ids:
            batch += 1  # a decode with drafts: the drafts cost like prompt tokens
            context += r.num_computed_tokens + s.num_new_tokens
            prefill += s.num_new_tokens - 1
        else:
            prefill += s.num_new_tokens
    return prefill, batch, context


def fit_profile(samples: Sequence[dict[str, float]], **extra: Any) -> SimProfile:
    """Least squares of the relative error of `step_s ~ 1 + prefill + batch + context` over
    measured steps (dicts with prefill_tokens, decode_batch, decode_context, step_s); terms that
    come out negative are dropped and the rest refitted."""
    rows = [[1.0, s["prefill_tokens"], s["decode_batch"], s["decode_context"]] for s in samples]
    y = torch.tensor([s["step_s"] for s in samples], dtype=torch.float64)
    x = torch.tensor(rows, dtype=torch.float64)
    weight = 1.0 / y.clamp(min=1e-6)  # relative error: short steps count as much as long ones
    x, y = x * weight.unsqueeze(1), y * weight
    active = [i for i in range(4) if bool((x[:, i] != 0).any())]  # no data, no term
    coef = torch.zeros(4, dtype=torch.float64)
    while active:
        sol = torch.linalg.lstsq(x[:, active], y.unsqueeze(1)).solution.squeeze(1)
        coef = torch.zeros(4, dtype=torch.float64)
        coef[active] = sol
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active = [i for i in active if i not in negative]
        coef = torch.zeros(4, dtype=torch.float64)
    c = [max(float(v), 0.0) for v in coef]
    return SimProfile(
        step_overhead_s=c[0],
        prefill_s_per_token=c[1],
        decode_s_per_seq=c[2],
        decode_s_per_context_token=c[3],
        samples=[dict(s) for s in samples],
        **extra,
    )


def sim_token(seed: int, position: int, vocab_size: int, avoid: frozenset[int]) -> int:
    """A deterministic token for a position of a request (splitmix64 of the two), not in
    `avoid` (the EOS ids)."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    token = (x ^ (x >> 31)) % vocab_size
    while token in avoid and len(avoid) < vocab_size:
        token = (token + 1) % vocab_size
    return token


def prompt_seed(prompt_token_ids: Sequence[int]) -> int:
    return zlib.crc32(array("q", prompt_token_ids).tobytes())


@dataclass(frozen=True)
class SimModel:
    """Stands in for the model: its config is the real one with the tiny KV layout, so the
    transfer fingerprint differs from the real model's (a real and a sim worker never pair)."""

    cfg: ModelConfig

    @classmethod
    def of(cls, real: ModelConfig, layers: int) -> SimModel:
        cfg = replace(
            real,
            num_layers=layers,
            num_heads=1,
            num_kv_heads=1,
            head_dim=1,
            hidden_size=1,
            intermediate_size=1,
        )
        return cls(cfg)


class SimRunner:
    """The ModelRunner interface (`execute`, `kv_caches`, `use_kv_caches`, `device`) on a
    modelled clock."""

    def __init__(
        self,
        profile: SimProfile,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.profile = profile
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self.avoid = frozenset(eos_token_ids)
        self.sleep = sleep
        shape = (2, num_blocks, block_size, 1, 1)
        self.kv_caches = [torch.zeros(shape) for _ in range(profile.sim_layers)]
        self.busy_s = 0.0  # modelled seconds slept so far

    def use_kv_caches(self, make: Callable[[], list[torch.Tensor]]) -> None:
        kv_caches = make()
        if [(c.shape, c.dtype) for c in kv_caches] != [(c.shape, c.dtype) for c in self.kv_caches]:
            raise ValueError("KV caches must match the sim engine's layout")
        self.kv_caches = kv_caches

    def token(self, request: Request, position: int) -> int:
        return sim_token(
            prompt_seed(request.prompt_token_ids), position, self.vocab_size, self.avoid
        )

    def execute(
        self,
        out: SchedulerOutput,
        block_tables: dict[str, list[int]],
        after_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        seconds = self.profile.step_time(out.scheduled)
        if seconds > 0:
            self.sleep(seconds)
            self.busy_s += seconds
        if after_layer is not None:
            for layer in range(len(self.kv_caches)):
                after_layer(layer)
        result = StepResult()
        for s in out.scheduled:
            if not s.samples:
                continue
            r = s.request
            seed = prompt_seed(r.prompt_token_ids)
            pos = r.num_tokens  # the next token's position
            tokens: list[int] = []
            for i, draft in enumerate(s.draft_token_ids):
                t = sim_token(seed, pos + i, self.vocab_size, self.avoid)
                tokens.append(t)
                if t != draft:
                    break
            else:
                tokens.append(
                    sim_token(seed, pos + len(s.draft_token_ids), self.vocab_size, self.avoid)
                )
            result.tokens[r.request_id] = tokens
            if r.forking:  # its other choices: the modelled first token too
                result.tokens.update((f.request_id, tokens[:1]) for f in r.forks)
        return result


class TimedArrival(Protocol):
    """A finished KV transfer as a receiver reports it (kv_transfer's `Arrival`)."""

    @property
    def request_key(self) -> str: ...

    @property
    def seconds(self) -> float: ...  # from the sender's header to the last byte


A = TypeVar("A", bound=TimedArrival)


class ArrivalSource(Protocol[A]):
    """What a decode worker polls for the KV transfers that finished (its receiver)."""

    def poll(self) -> list[A]: ...


class HeldArrivals(Generic[A]):
    """A simulated decode worker's KV arrivals, each held back until the modelled time of its
    transfer (`SimProfile.transfer_s` of the request's prompt) has passed since it began: the
    sim's KV is tiny and lands almost at once."""

    def __init__(
        self,
        source: ArrivalSource[A],
        profile: SimProfile,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.profile = profile
        self.scheduler = scheduler  # its parked requests: the prompts in flight
        self.clock = clock
        self._held: list[tuple[float, A]] = []  # (due, arrival)

    def poll(self) -> list[A]:
        now = self.clock()
        for a in self.source.poll():
            req = self.scheduler.parked.get(a.request_key)
            tokens = req.num_prompt_tokens if req is not None else 0
            self._held.append((now + max(self.profile.transfer_s(tokens) - a.seconds, 0.0), a))
        due = [a for t, a in self._held if t <= now]
        self._held = [(t, a) for t, a in self._held if t > now]
        return due
