"""What `tandem bench serve` sends and when: seeded workloads, arrival processes and the driver.

Workloads (`build_workload`: a pool of `BenchRequest`s, written next to the results; a run sends
them in order and cycles through the pool when it needs more):

- `specbench[:category,...]`: the first turn of each Spec-Bench dev question (all categories, or
  the ones named) as one user chat message, in a seeded shuffle; `max_tokens` from `output_len`,
  EOS honoured unless `ignore_eos` is set.
- `random`: `num_requests` prompts of random token ids (uniform over the vocabulary) with input
  and output lengths drawn from `input_len` / `output_len`; EOS ignored so the output length is
  exact.
- `shared-prefix`: `num_groups` x `prompts_per_group` prompts; each group shares `prefix_len`
  random tokens, then each prompt has its own suffix of `input_len` tokens; seeded shuffle, tagged
  by group.
- `interference`: `num_requests` short prompts (`input_len` / `output_len`) of which exactly
  round(`long_fraction` x n), at seeded positions, are long (`long_input_len` /
  `long_output_len`): prefill interference on the short requests. Tagged short / long.
- `json-schema`: structured outputs against free text, side by side in one run: `num_requests`
  chat prompts in pairs, each asking for a record as JSON; one of a pair carries its own JSON
  schema (a record kind's fields plus a `category` enum of seeded words, so every schema
  differs and each is compiled once), tagged `schema`; the other the same prompt without one,
  tagged `free` (the two alternate in order, as the second finds the prompt in the prefix
  cache). EOS honoured (a schema ends at its closing brace); `max_tokens` from
  `output_len`. The per-tag summary compares TPOT with and without the grammar.
  `json-schema:forced` (gRPC only): a schema of long fixed keys and enums of long values, so
  that most output tokens are forced by the grammar, in triples: tagged `schema`, the same
  request again with `speculative` false, tagged `schema-nodrafts` (on a decode worker run with
  `--spec grammar` the forced tokens are its only drafts, so this is the request without them),
  and `free`, without a schema (the three rotate in order). The per-tag summary reports each
  tag's share of accepted draft tokens in its output and its decode rate.
- `trace:PATH`: JSONL rows `{"timestamp": s, "input_len": n, "output_len": m}`; random token ids
  of those lengths, sent at the row's timestamp relative to the first row (a `trace` load point,
  optionally capped at `concurrency`; given a rate, the trace's lengths arrive at that rate).

Lengths: `N` (fixed), `uniform(lo,hi)` (integers, both ends included) or
`normal(mean,std,min,max)` (rounded, then clipped to [min, max]).

Arrivals (`LoadPoint`): open loop at `rate` requests/s with gamma inter-arrival gaps of shape
`burstiness` and mean 1/rate (burstiness 1 is Poisson; below 1 burstier, above 1 more regular: the
squared coefficient of variation of the gaps is 1/burstiness), optionally capped at `concurrency`
requests in flight; or a closed loop at `concurrency`, where every request is ready at the start
and waits for a free slot. Ramp-up over `ramp_up_s`: the open-loop rate rises linearly from 0 to
`rate` (the arrival times of the constant-rate process are warped through the integrated rate);
closed-loop slot k of C opens at k x ramp_up_s / C. Client queue time = send time - arrival time
(the wait for a concurrency slot; in an uncapped open loop only the client's own scheduling
lag, ~1 ms here, which shows when the client falls behind its schedule).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.serving_metrics import Timeline
from tandem.data import SPECBENCH_CATEGORIES, SPECBENCH_PATH

WORKLOADS = ("specbench", "random", "shared-prefix", "interference", "json-schema", "trace")
DEFAULT_POOL = 100  # generated workloads without --num-requests


class WorkloadError(ValueError):
    """A workload or load point that cannot be built (the message says why)."""


# --- lengths ------------------------------------------------------------------------------

_DIST = re.compile(r"^\s*(uniform|normal)\s*\((.*)\)\s*$")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed N, uniform(lo,hi) or normal(mean,std,min,max)."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        text = text.strip()
        if text.isdigit():
            dist = cls("fixed", (float(text),))
        elif m := _DIST.match(text):
            try:
                params = tuple(float(p) for p in m.group(2).split(","))
            except ValueError:
                raise WorkloadError(f"bad length distribution {text!r}") from None
            dist = cls(m.group(1), params)
        else:
            raise WorkloadError(
                f"bad length distribution {text!r}: N, uniform(lo,hi) or normal(mean,std,min,max)"
            )
        dist._validate(text)
        return dist

    def _validate(self, text: str) -> None:
        arity = {"fixed": 1, "uniform": 2, "normal": 4}[self.kind]
        if len(self.params) != arity:
            raise WorkloadError(f"{text!r}: {self.kind} takes {arity} numbers")
        if self.lower < 1 or self.upper < self.lower:
            raise WorkloadError(f"{text!r}: lengths must satisfy 1 <= min <= max")
        if self.kind == "normal" and self.params[1] < 0:
            raise WorkloadError(f"{text!r}: std must be >= 0")

    @property
    def lower(self) -> int:
        return int(self.params[2] if self.kind == "normal" else self.params[0])

    @property
    def upper(self) -> int:
        return int(self.params[{"fixed": 0, "uniform": 1, "normal": 3}[self.kind]])

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return rng.randint(self.lower, self.upper)
        mean, std = self.params[0], self.params[1]
        return min(max(round(rng.gauss(mean, std)), self.lower), self.upper)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.params[0]))
        return f"{self.kind}({','.join(f'{p:g}' for p in self.params)})"


# --- requests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One input of the pool: token ids (random workloads) or chat messages (Spec-Bench)."""

    index: int  # position in the pool
    max_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    ignore_eos: bool = True
    tag: str = ""  # category, group, short/long: summaries are also given per tag
    source: str = ""  # e.g. "specbench:81"
    arrival_s: float | None = None  # trace replay: offset from the first row
    json_schema: str = ""  # a structured output's schema (JSON text); "": free text
    speculative: bool | None = None  # the request's override (gRPC only); None: the worker's

    def __post_init__(self) -> None:
        if bool(self.prompt_token_ids) == bool(self.messages):
            raise WorkloadError(f"request {self.index}: give token ids or messages, not both")
        if self.max_tokens < 1:
            raise WorkloadError(f"request {self.index}: max_tokens must be >= 1")

    @property
    def input_len(self) -> int | None:
        """Prompt tokens when known on the client (token-id prompts)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids else None

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "index": self.index,
            "tag": self.tag,
            "source": self.source,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.arrival_s is not None:
            row["arrival_s"] = self.arrival_s
        if self.speculative is not None:
            row["speculative"] = self.speculative
        if self.messages:
            row["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        else:
            row["input_len"] = len(self.prompt_token_ids)
            row["prompt_token_ids"] = list(self.prompt_token_ids)
        return row


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "random"  # specbench[:cat,...] | random | shared-prefix | interference | trace:PATH
    num_requests: int | None = None  # pool size of random / interference (default 100)
    input_len: str = "128"
    output_len: str = "128"
    num_groups: int = 4
    prompts_per_group: int = 8
    prefix_len: int = 256
    long_fraction: float = 0.1
    long_input_len: str = "2048"
    long_output_len: str = "16"
    ignore_eos: bool | None = None  # None: True except for specbench
    seed: int = 0
    specbench_path: str = str(SPECBENCH_PATH)

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise WorkloadError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name}")
        for name in ("input_len", "output_len", "long_input_len", "long_output_len"):
            LengthDist.parse(getattr(self, name))
        for name in ("num_groups", "prompts_per_group", "prefix_len"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise WorkloadError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if self.kind == "trace" and not self.argument:
            raise WorkloadError("trace needs a path: trace:PATH")
        if self.kind == "json-schema" and self.argument not in ("", "forced"):
            raise WorkloadError(f"json-schema takes no argument or forced, got {self.argument}")
        unknown = set(self.categories) - set(SPECBENCH_CATEGORIES)
        if unknown:
            raise WorkloadError(
                f"unknown Spec-Bench categories {sorted(unknown)}; "
                f"known: {', '.join(SPECBENCH_CATEGORIES)}"
            )

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def argument(self) -> str:
        return self.name.split(":", 1)[1] if ":" in self.name else ""

    @property
    def categories(self) -> tuple[str, ...]:
        if self.kind != "specbench":
            return ()
        return tuple(c.strip() for c in self.argument.split(",") if c.strip())

    @property
    def needs_vocab(self) -> bool:
        return self.kind not in ("specbench", "json-schema")


def build_workload(
    config: WorkloadConfig, vocab_size: int | None = None, max_model_len: int | None = None
) -> list[BenchRequest]:
    """The seeded pool of inputs; token workloads need the vocabulary size. Raises WorkloadError
    when a request cannot fit `max_model_len` (prompt + max_tokens)."""
    rng = random.Random(config.seed)
    if config.kind == "specbench":
        pool = specbench_requests(config, rng)
    elif config.kind == "json-schema":
        pool = json_schema_requests(config, rng)
    else:
        if vocab_size is None or vocab_size < 1:
            raise WorkloadError(f"the {config.kind} workload needs the vocabulary size")
        builders = {
            "random": _random_requests,
            "shared-prefix": _shared_prefix_requests,
            "interference": _interference_requests,
            "trace": _trace_requests,
        }
        pool = builders[config.kind](config, rng, vocab_size)
    if max_model_len is not None:
        for r in pool:
            if r.input_len is not None and r.input_len + r.max_tokens > max_model_len:
                raise WorkloadError(
                    f"request {r.index} ({r.tag or config.kind}): {r.input_len} prompt + "
                    f"{r.max_tokens} output tokens exceed the model's {max_model_len}"
                )
    return pool


def specbench_requests(config: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    path = Path(config.specbench_path)
    if not path.is_file():
        raise WorkloadError(f"Spec-Bench prompts not found: {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    wanted = set(config.categories)
    rows = [r for r in rows if not wanted or r["category"] in wanted]
    if not rows:
        raise WorkloadError(f"no Spec-Bench questions in {sorted(wanted)}")
    rows.sort(key=lambda r: int(r["question_id"]))
    rng.shuffle(rows)
    out_len = LengthDist.parse(config.output_len)
    ignore_eos = bool(config.ignore_eos)  # chat ends at EOS unless asked otherwise
    return [
        BenchRequest(
            index=i,
            max_tokens=out_len.sample(rng),
            messages=(("user", row["turns"][0]),),
            ignore_eos=ignore_eos,
            tag=row["category"],
            source=f"specbench:{row['question_id']}",
        )
        for i, row in enumerate(rows)
    ]


# A record kind: its fields and their JSON types.
_RECORDS: dict[str, dict[str, str]] = {
    "person": {"name": "string", "age": "integer", "city": "string", "employed": "boolean"},
    "product": {"title": "string", "price": "number", "in_stock": "boolean", "sku": "string"},
    "book": {"title": "string", "author": "string", "year": "integer", "pages": "integer"},
    "event": {"name": "string", "venue": "string", "day": "integer", "sold_out": "boolean"},
}
_CATEGORY_WORDS = [
    "alpha",
    "bravo",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "jasper",
    "koala",
    "lumen",
    "maple",
    "nova",
    "onyx",
    "pebble",
    "quartz",
    "raven",
    "sierra",
    "tundra",
    "umber",
    "violet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]


def json_schema_requests(config: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    out_len = LengthDist.parse(config.output_len)
    forced = config.argument == "forced"
    out: list[BenchRequest] = []
    for group in range(config.num_requests or DEFAULT_POOL):
        prompt, schema = (_forced_record if forced else _record)(group, rng)
        n_out = out_len.sample(rng)
        arms: list[tuple[str, str, bool | None]] = [("schema", schema, None), ("free", "", None)]
        if forced:
            arms.insert(1, ("schema-nodrafts", schema, False))
        # the first of a group computes the prompt, the others find it in the prefix cache:
        # each arm goes first as often as the others
        shift = group % len(arms)
        for tag, text, speculative in arms[shift:] + arms[:shift]:
            out.append(
                BenchRequest(
                    len(out),
                    n_out,
                    messages=(("user", prompt),),
                    ignore_eos=False,
                    tag=tag,
                    json_schema=text,
                    speculative=speculative,
                )
            )
        if len(out) >= (config.num_requests or DEFAULT_POOL):
            break
    return out[: config.num_requests or DEFAULT_POOL]


def _record(group: int, rng: random.Random) -> tuple[str, str]:
    """A prompt asking for a record, and its schema: the kind's fields and a category enum."""
    kind = rng.choice(sorted(_RECORDS))
    fields = _RECORDS[kind]
    categories = rng.sample(_CATEGORY_WORDS, 3)
    schema = {
        "type": "object",
        "properties": {
            **{name: {"type": t} for name, t in fields.items()},
            "category": {"enum": categories},
        },
        "required": [*fields, "category"],
        "additionalProperties": False,
    }
    prompt = (
        f"Invent a {kind} (record {group}) and answer in JSON with the fields "
        f"{', '.join(fields)} and a category, one of {', '.join(categories)}."
    )
    return prompt, json.dumps(schema)


def _forced_record(group: int, rng: random.Random) -> tuple[str, str]:
    """A prompt and a schema whose output the grammar mostly forces: long fixed keys, enums of
    long values that differ early, one short free string."""
    words = rng.sample(_CATEGORY_WORDS, 4)
    properties: dict[str, Any] = {
        "customer_reference_code_as_printed_on_the_invoice": {"type": "string", "maxLength": 12},
        "preferred_delivery_window_for_this_shipment": {
            "enum": [f"{words[0]}_weekday_mornings_before_noon", f"{words[1]}_weekend_afternoons"]
        },
        "subscription_tier_assigned_to_this_account": {
            "enum": [f"{words[2]}_basic_monthly_plan", f"{words[3]}_premium_annual_plan"]
        },
        "accepted_the_terms_and_conditions_of_service": {"type": "boolean"},
    }
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    prompt = f"Invent customer record {group} as JSON with the fields {', '.join(properties)}."
    return prompt, json.dumps(schema)


def _ignore_eos(config: WorkloadConfig) -> bool:
    return True if config.ignore_eos is None else config.ignore_eos


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def _random_requests(
    config: WorkloadConfig, rng: random.Random, vocab_size: int
) -> list[BenchRequest]:
    in_len, out_len = LengthDist.parse(config.input_len), LengthDist.parse(config.output_len)
    out = []
    for i in range(config.num_requests or DEFAULT_POOL):
        n_in, n_out = in_len.sample(rng), out_len.sample(rng)
        ids = _random_ids(rng, n_in, vocab_size)
        out.append(BenchRequest(i, n_out, ids, ignore_eos=_ignore_eos(config), tag="random"))
    return out


def _shared_prefix_requests(
    config: WorkloadConfig, rng: random.Random, vocab_size: int
) -> list[BenchRequest]:
    in_len, out_len = LengthDist.parse(config.input_len), LengthDist.parse(config.output_len)
    prefixes = [_random_ids(rng, config.prefix_len, vocab_size) for _ in range(config.num_groups)]
    drafts: list[tuple[int, tuple[int, ...], int]] = []
    for g, prefix in enumerate(prefixes):
        for _ in range(config.prompts_per_group):
            suffix = _random_ids(rng, in_len.sample(rng), vocab_size)
            drafts.append((g, prefix + suffix, out_len.sample(rng)))
    rng.shuffle(drafts)
    return [
        BenchRequest(i, n_out, ids, ignore_eos=_ignore_eos(config), tag=f"group{g}")
        for i, (g, ids, n_out) in enumerate(drafts)
    ]


def _interference_requests(
    config: WorkloadConfig, rng: random.Random, vocab_size: int
) -> list[BenchRequest]:
    n = config.num_requests or DEFAULT_POOL
    long_at = set(rng.sample(range(n), round(config.long_fraction * n)))
    short = (LengthDist.parse(config.input_len), LengthDist.parse(config.output_len))
    long = (LengthDist.parse(config.long_input_len), LengthDist.parse(config.long_output_len))
    out = []
    for i in range(n):
        tag = "long" if i in long_at else "short"
        in_len, out_len = long if tag == "long" else short
        n_in, n_out = in_len.sample(rng), out_len.sample(rng)
        ids = _random_ids(rng, n_in, vocab_size)
        out.append(BenchRequest(i, n_out, ids, ignore_eos=_ignore_eos(config), tag=tag))
    return out


def _trace_requests(
    config: WorkloadConfig, rng: random.Random, vocab_size: int
) -> list[BenchRequest]:
    path = Path(config.argument)
    if not path.is_file():
        raise WorkloadError(f"trace not found: {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["timestamp"]), int(row["input_len"]), int(row["output_len"])))
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{path}:{number}: needs timestamp, input_len, output_len") from e
    if not rows:
        raise WorkloadError(f"empty trace: {path}")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out = []
    for i, (ts, n_in, n_out) in enumerate(rows):
        if n_in < 1 or n_out < 1:
            raise WorkloadError(f"{path}: row {i} needs input_len and output_len >= 1")
        ids = _random_ids(rng, n_in, vocab_size)
        out.append(
            BenchRequest(
                i, n_out, ids, ignore_eos=_ignore_eos(config), tag="trace", arrival_s=ts - t0
            )
        )
    return out


# --- arrivals -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPoint:
    """Open loop at `rate` req/s (capped at `concurrency` in flight when given), a closed loop
    at `concurrency` when rate is None, or a trace's own arrival times (`trace`, optionally
    capped at `concurrency`)."""

    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    ramp_up_s: float = 0.0
    trace: bool = False

    def __post_init__(self) -> None:
        if self.trace and self.rate is not None:
            raise WorkloadError("a trace keeps its own arrival times: no rate")
        if self.rate is None and self.concurrency is None and not self.trace:
            raise WorkloadError("a load point needs a rate or a concurrency")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.burstiness > 0:
            raise WorkloadError(f"burstiness must be > 0, got {self.burstiness}")
        if self.ramp_up_s < 0:
            raise WorkloadError(f"ramp_up_s must be >= 0, got {self.ramp_up_s}")

    @property
    def closed(self) -> bool:
        return self.rate is None and not self.trace

    @property
    def label(self) -> str:
        """Short: "conc 8" (closed loop), "4 rps", "4 rps b0.5 cap 16", "trace cap 4"."""
        if self.trace:
            return "trace" + (f" cap {self.concurrency}" if self.concurrency else "")
        if self.rate is None:
            return f"conc {self.concurrency}"
        burst = f" b{self.burstiness:g}" if self.burstiness != 1.0 else ""
        cap = f" cap {self.concurrency}" if self.concurrency else ""
        return f"{self.rate:g} rps{burst}{cap}"

    @property
    def load(self) -> float:
        """The x of latency-vs-load plots: the offered rate, or the concurrency."""
        return float(self.rate if self.rate is not None else self.concurrency or 0)


def interarrival_gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Gamma(shape=burstiness, scale=1/(rate*burstiness)) gaps: mean 1/rate, CV^2 1/burstiness."""
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def ramp_warp(u: float, ramp_up_s: float) -> float:
    """Arrival time under a rate rising linearly from 0 to full over ramp_up_s, for the arrival
    at time u of the constant full-rate process (inverse of the integrated rate)."""
    if ramp_up_s <= 0:
        return u
    if u < ramp_up_s / 2:
        return math.sqrt(2 * ramp_up_s * u)
    return u + ramp_up_s / 2


def arrival_offsets(point: LoadPoint, seed: int) -> Iterator[float]:
    """Seconds from the start of each arrival (all 0 in a closed loop); endless."""
    if point.rate is None or point.trace:
        while True:
            yield 0.0
    rng = random.Random(seed)
    u = 0.0
    for gap in interarrival_gaps(point.rate, point.burstiness, rng):
        u += gap
        yield ramp_warp(u, point.ramp_up_s)


def slot_open_times(concurrency: int, ramp_up_s: float) -> list[float]:
    """When each of the `concurrency` slots opens (seconds from the start)."""
    return [k * ramp_up_s / concurrency for k in range(concurrency)]


def plan(
    pool: Sequence[BenchRequest],
    point: LoadPoint,
    max_requests: int | None,
    duration_s: float | None,
    seed: int,
) -> Iterator[tuple[float, BenchRequest]]:
    """(arrival offset, request) in arrival order: the pool cycled, until `max_requests` are
    planned or arrivals pass `duration_s` (a closed loop stops on the driver's clock). A trace
    point sends at the requests' own arrival times, the trace repeating after its span plus one
    mean gap."""
    if max_requests is None and duration_s is None:
        raise WorkloadError("a plan needs max_requests or duration_s")
    if not pool:
        return
    if point.trace and any(r.arrival_s is None for r in pool):
        raise WorkloadError("a trace point needs a trace workload (arrival times)")
    offsets = arrival_offsets(point, seed)
    span = pool[-1].arrival_s or 0.0
    period = span + (span / (len(pool) - 1) if len(pool) > 1 else 1.0)  # a cycled trace
    count = 0
    while max_requests is None or count < max_requests:
        request = pool[count % len(pool)]
        if point.trace:
            offset = (count // len(pool)) * period + (request.arrival_s or 0.0)
        else:
            offset = next(offsets)
        if duration_s is not None and offset > duration_s:
            return
        yield offset, request
        count += 1


# --- the driver ---------------------------------------------------------------------------


@dataclass
class Sent:
    """One request the driver sent: its place in the run, the input, and what came back."""

    seq: int
    request: BenchRequest
    arrival: float  # clock time it arrived (was ready to send)
    timeline: Timeline
    extra: dict[str, Any] = field(default_factory=dict)  # finish reason, server timings, ...


# Fills the timeline: send_time when the request leaves, then chunks, usage, error.
Sender = Callable[[BenchRequest, Timeline], Awaitable[dict[str, Any]]]


class Slots:
    """The client's concurrency limit; with a ramp-up, slot k opens at open_at[k]."""

    def __init__(self, open_at: Sequence[float], start: float) -> None:
        opened = sum(1 for t in open_at if t <= 0)
        self._sem = asyncio.Semaphore(opened)
        later = [t for t in open_at if t > 0]
        self._opener = asyncio.create_task(self._open(later, start)) if later else None

    async def _open(self, times: list[float], start: float) -> None:
        for t in times:
            await _sleep_until(start + t)
            self._sem.release()

    async def acquire(self) -> None:
        await self._sem.acquire()

    def release(self) -> None:
        self._sem.release()

    def close(self) -> None:
        if self._opener is not None:
            self._opener.cancel()


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def drive(
    planned: Iterable[tuple[float, BenchRequest]],
    send: Sender,
    point: LoadPoint,
    duration_s: float | None = None,
    on_done: Callable[[Sent], None] | None = None,
) -> list[Sent]:
    """Send each planned request at its arrival time, holding a concurrency slot while it runs
    (when the point has a concurrency), until the plan ends or `duration_s` has passed."""
    start = time.perf_counter()
    slots = (
        Slots(slot_open_times(point.concurrency, point.ramp_up_s if point.closed else 0.0), start)
        if point.concurrency is not None
        else None
    )

    def expired() -> bool:
        return duration_s is not None and time.perf_counter() - start >= duration_s

    async def one(seq: int, request: BenchRequest, arrival: float) -> Sent:
        timeline = Timeline(send_time=arrival)
        try:
            extra = await send(request, timeline)
        finally:
            if slots is not None:
                slots.release()
        timeline.queue_s = max(timeline.send_time - arrival, 0.0)
        sent = Sent(seq, request, arrival, timeline, extra)
        if on_done is not None:
            on_done(sent)
        return sent

    tasks: list[asyncio.Task[Sent]] = []
    try:
        for offset, request in planned:
            arrival = start + offset
            await _sleep_until(arrival)
            if expired():
                break
            if slots is not None:
                await slots.acquire()
                if expired():
                    slots.release()
                    break
            tasks.append(asyncio.create_task(one(len(tasks), request, arrival)))
        return list(await asyncio.gather(*tasks))
    finally:
        if slots is not None:
            slots.close()
        for t in tasks:
            t.cancel()
