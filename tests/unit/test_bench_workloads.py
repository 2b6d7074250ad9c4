"""`tandem bench serve` inputs and arrivals: seeded workload generators, length distributions,
Poisson and gamma arrivals, ramp-up, the plan, and the driver's concurrency limit."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import pytest

from tandem.bench.serve_config import ServeConfig
from tandem.bench.serving_metrics import Timeline
from tandem.bench.workloads import (
    BenchRequest,
    LengthDist,
    LoadPoint,
    WorkloadConfig,
    WorkloadError,
    arrival_offsets,
    build_workload,
    drive,
    interarrival_gaps,
    plan,
    ramp_warp,
    slot_open_times,
)
from tandem.data import SPECBENCH_PATH
from tandem.structured import StructuredOutput

# --- lengths ------------------------------------------------------------------------------


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("64").sample(rng) == 64
    uniform = LengthDist.parse("uniform(3,6)")
    drawn = {uniform.sample(rng) for _ in range(500)}
    assert drawn == {3, 4, 5, 6}  # both ends included
    normal = LengthDist.parse("normal(100, 30, 80, 110)")
    values = [normal.sample(rng) for _ in range(2000)]
    assert min(values) == 80 and max(values) == 110  # clipped
    assert (normal.lower, normal.upper, str(normal)) == (80, 110, "normal(100,30,80,110)")


@pytest.mark.parametrize(
    "text", ["", "abc", "uniform(5)", "uniform(6,5)", "normal(1,2,3)", "0", "normal(5,-1,1,9)"]
)
def test_bad_length_distributions(text: str) -> None:
    with pytest.raises(WorkloadError):
        LengthDist.parse(text)


# --- workloads ----------------------------------------------------------------------------


def test_random_workload_is_seeded_and_in_range() -> None:
    config = WorkloadConfig("random", num_requests=50, input_len="uniform(8,32)", output_len="4")
    pool = build_workload(config, vocab_size=100)
    assert len(pool) == 50
    assert pool == build_workload(config, vocab_size=100)
    other = build_workload(WorkloadConfig("random", 50, "uniform(8,32)", "4", seed=1), 100)
    assert pool != other
    for r in pool:
        assert r.input_len is not None and 8 <= r.input_len <= 32
        assert r.max_tokens == 4 and r.ignore_eos and not r.messages
        assert all(0 <= t < 100 for t in r.prompt_token_ids)
    assert [r.index for r in pool] == list(range(50))


def test_token_workloads_need_the_vocabulary_and_fit_the_context() -> None:
    with pytest.raises(WorkloadError, match="vocabulary"):
        build_workload(WorkloadConfig("random"))
    with pytest.raises(WorkloadError, match="exceed"):
        build_workload(WorkloadConfig("random", 3, "100", "20"), 256, max_model_len=110)
    assert len(build_workload(WorkloadConfig("random", 3, "100", "10"), 256, 110)) == 3


def test_shared_prefix_groups() -> None:
    config = WorkloadConfig(
        "shared-prefix",
        input_len="5",
        output_len="3",
        num_groups=3,
        prompts_per_group=4,
        prefix_len=20,
    )
    pool = build_workload(config, vocab_size=1000)
    assert len(pool) == 12
    groups: dict[str, list[BenchRequest]] = {}
    for r in pool:
        groups.setdefault(r.tag, []).append(r)
    assert sorted(groups) == ["group0", "group1", "group2"]
    prefixes = set()
    for members in groups.values():
        assert len(members) == 4
        heads = {r.prompt_token_ids[:20] for r in members}
        assert len(heads) == 1  # one common prefix per group
        prefixes |= heads
        assert len({r.prompt_token_ids[20:] for r in members}) == 4  # own suffixes
        assert all(len(r.prompt_token_ids) == 25 for r in members)
    assert len(prefixes) == 3
    assert [r.tag for r in pool] != sorted(r.tag for r in pool)  # interleaved by the shuffle


def test_interference_mixes_an_exact_share_of_long_prompts() -> None:
    config = WorkloadConfig(
        "interference",
        num_requests=40,
        input_len="16",
        output_len="8",
        long_fraction=0.25,
        long_input_len="300",
        long_output_len="2",
    )
    pool = build_workload(config, vocab_size=50)
    long = [r for r in pool if r.tag == "long"]
    short = [r for r in pool if r.tag == "short"]
    assert len(long) == 10 and len(short) == 30
    assert all(r.input_len == 300 and r.max_tokens == 2 for r in long)
    assert all(r.input_len == 16 and r.max_tokens == 8 for r in short)


def test_trace_replay(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [(105.5, 10, 3), (100.0, 4, 2), (101.25, 7, 5)]
    trace.write_text(
        "\n".join(json.dumps({"timestamp": t, "input_len": i, "output_len": o}) for t, i, o in rows)
    )
    pool = build_workload(WorkloadConfig(f"trace:{trace}"), vocab_size=64)
    assert [(r.arrival_s, r.input_len, r.max_tokens) for r in pool] == [
        (0.0, 4, 2),
        (1.25, 7, 5),
        (5.5, 10, 3),
    ]
    planned = list(plan(pool, LoadPoint(trace=True), 4, None, seed=0))
    assert [offset for offset, _ in planned] == [0.0, 1.25, 5.5, 5.5 + 2.75]  # cycled
    assert [t for t, _ in plan(pool, LoadPoint(trace=True), None, 3.0, seed=0)] == [0.0, 1.25]
    poisson = [t for t, _ in plan(pool, LoadPoint(rate=10.0), 3, None, seed=0)]
    assert poisson != [0.0, 1.25, 5.5]  # a rate overrides the trace's times
    with pytest.raises(WorkloadError, match="needs a trace workload"):
        next(plan(_pool(3), LoadPoint(trace=True), 3, None, seed=0))
    with pytest.raises(WorkloadError, match="no rate"):
        LoadPoint(rate=1.0, trace=True)
    with pytest.raises(WorkloadError, match="trace needs a path"):
        WorkloadConfig("trace")


def test_specbench_first_turns_as_chat() -> None:
    config = WorkloadConfig("specbench:qa,math", output_len="32")
    pool = build_workload(config)
    assert len(pool) == 30  # 20 qa + 10 MT-bench math
    assert {r.tag for r in pool} == {"qa", "math"}
    assert pool == build_workload(config)
    rows = {
        f"specbench:{row['question_id']}": row
        for row in map(json.loads, SPECBENCH_PATH.read_text().splitlines())
    }
    for r in pool:
        assert len(r.messages) == 1 and r.messages[0] == ("user", rows[r.source]["turns"][0])
        assert r.max_tokens == 32 and not r.ignore_eos and not r.prompt_token_ids
    assert len(build_workload(WorkloadConfig("specbench"))) == 180
    with pytest.raises(WorkloadError, match="unknown Spec-Bench categories"):
        WorkloadConfig("specbench:poetry")


# --- arrivals -----------------------------------------------------------------------------


def _gaps(rate: float, burstiness: float, n: int, seed: int = 0) -> list[float]:
    gaps = interarrival_gaps(rate, burstiness, random.Random(seed))
    return [next(gaps) for _ in range(n)]


def test_poisson_interarrival_mean_and_variance() -> None:
    gaps = _gaps(rate=5.0, burstiness=1.0, n=20000)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.2, rel=0.03)
    cv2 = statistics.pvariance(gaps) / mean**2
    assert cv2 == pytest.approx(1.0, rel=0.08)  # exponential
    assert gaps == _gaps(rate=5.0, burstiness=1.0, n=20000)  # seeded


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_changes_the_variance_not_the_mean(burstiness: float) -> None:
    gaps = _gaps(rate=10.0, burstiness=burstiness, n=40000)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.04)
    cv2 = statistics.pvariance(gaps) / mean**2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.12)


def test_ramp_up_rises_linearly_then_holds_the_rate() -> None:
    assert ramp_warp(0.0, 10.0) == 0.0
    assert ramp_warp(5.0, 10.0) == pytest.approx(10.0)  # continuous at the end of the ramp
    assert ramp_warp(7.0, 10.0) == pytest.approx(12.0)
    assert ramp_warp(3.0, 0.0) == 3.0
    offsets = arrival_offsets(LoadPoint(rate=200.0, ramp_up_s=10.0), seed=3)
    times = [next(offsets) for _ in range(6000)]
    in_ramp = sum(t < 10.0 for t in times)
    assert in_ramp == pytest.approx(200 * 10 / 2, rel=0.05)  # integral of the linear ramp
    first_half = sum(t < 5.0 for t in times)
    assert first_half == pytest.approx(200 * 5 * 5 / 10 / 2, rel=0.1)
    steady = sum(10.0 <= t < 20.0 for t in times)
    assert steady == pytest.approx(2000, rel=0.05)


def test_closed_loop_arrivals_and_slots() -> None:
    offsets = arrival_offsets(LoadPoint(concurrency=4), seed=0)
    assert [next(offsets) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert slot_open_times(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert slot_open_times(3, 0.0) == [0.0, 0.0, 0.0]


def test_load_point_validation_and_labels() -> None:
    assert LoadPoint(concurrency=8).label == "conc 8"
    assert LoadPoint(rate=4.0).label == "4 rps"
    assert LoadPoint(rate=4.0, concurrency=16, burstiness=0.5).label == "4 rps b0.5 cap 16"
    assert LoadPoint(trace=True).label == "trace" and not LoadPoint(trace=True).closed
    for bad in (
        {},
        {"rate": 0.0},
        {"concurrency": 0},
        {"rate": 1.0, "burstiness": 0.0},
        {"concurrency": 1, "ramp_up_s": -1.0},
    ):
        with pytest.raises(WorkloadError):
            LoadPoint(**bad)  # type: ignore[arg-type]


def test_plan_cycles_the_pool_and_stops() -> None:
    pool = build_workload(WorkloadConfig("random", 3, "4", "2"), vocab_size=10)
    planned = list(plan(pool, LoadPoint(concurrency=2), 7, None, seed=0))
    assert [r.index for _, r in planned] == [0, 1, 2, 0, 1, 2, 0]
    timed = list(plan(pool, LoadPoint(rate=100.0), None, 2.0, seed=0))
    assert 150 < len(timed) < 250 and all(t <= 2.0 for t, _ in timed)
    offsets = [t for t, _ in timed]
    assert offsets == sorted(offsets)
    assert timed == list(plan(pool, LoadPoint(rate=100.0), None, 2.0, seed=0))
    with pytest.raises(WorkloadError, match="needs max_requests or duration_s"):
        next(plan(pool, LoadPoint(rate=100.0), None, None, seed=0))


# --- the driver ---------------------------------------------------------------------------


class FakeServer:
    """A sender that holds each request for a seeded few milliseconds and counts in-flight."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.inflight = 0
        self.max_inflight = 0
        self.sent: list[float] = []

    async def send(self, request: BenchRequest, timeline: Timeline) -> dict[str, object]:
        timeline.send_time = time.perf_counter()
        self.sent.append(timeline.send_time)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(self.rng.uniform(0.001, 0.006))
            timeline.chunks.append((time.perf_counter(), 1))
            timeline.output_tokens = 1
        finally:
            self.inflight -= 1
        return {"finish_reason": "length"}


def _pool(n: int) -> list[BenchRequest]:
    return build_workload(WorkloadConfig("random", n, "4", "1"), vocab_size=10)


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_closed_loop_never_exceeds_its_concurrency(concurrency: int) -> None:
    server = FakeServer()
    point = LoadPoint(concurrency=concurrency)
    pool = _pool(40)
    sents = asyncio.run(drive(plan(pool, point, 40, None, 0), server.send, point))
    assert len(sents) == 40 and [s.seq for s in sents] == list(range(40))
    assert server.max_inflight == concurrency
    assert all(s.timeline.ok and s.timeline.queue_s >= 0 for s in sents)
    # Everyone is ready at the start: later requests waited longer for a slot.
    assert sents[-1].timeline.queue_s > sents[concurrency].timeline.queue_s
    assert all(s.timeline.queue_s < 0.5 for s in sents[:concurrency])  # no wait for a slot


def test_open_loop_with_a_cap_and_a_duration() -> None:
    server = FakeServer()
    point = LoadPoint(rate=2000.0, concurrency=2)
    pool = _pool(10)
    sents = asyncio.run(drive(plan(pool, point, 60, None, 0), server.send, point))
    assert len(sents) == 60 and server.max_inflight <= 2
    assert max(s.timeline.queue_s for s in sents) > 0.001  # arrivals outpace 2 slots

    server = FakeServer()
    closed = LoadPoint(concurrency=2)
    start = time.perf_counter()
    sents = asyncio.run(
        drive(plan(pool, closed, None, 0.3, 0), server.send, closed, duration_s=0.3)
    )
    elapsed = time.perf_counter() - start
    assert 0.3 <= elapsed < 2.0  # stops soon after the duration (generous: a loaded machine)
    sent_at = [s.timeline.send_time for s in sents]
    assert len(sents) > 10 and max(sent_at) - min(sent_at) < 0.3  # nothing sent after it


def test_closed_loop_ramp_up_opens_slots_over_time() -> None:
    server = FakeServer()
    point = LoadPoint(concurrency=4, ramp_up_s=0.4)
    sents = asyncio.run(drive(plan(_pool(200), point, None, 0.6, 0), server.send, point, 0.6))
    start = min(s.timeline.send_time for s in sents)
    early = [s for s in sents if s.timeline.send_time - start < 0.02]
    assert early and server.max_inflight == 4

    # Before 0.1 s only one slot is open: no two of those requests overlap.
    def overlap(a: Timeline, b: Timeline) -> bool:
        return a.send_time < b.chunks[-1][0] and b.send_time < a.chunks[-1][0]

    timelines = [s.timeline for s in early]
    assert not any(overlap(a, b) for i, a in enumerate(timelines) for b in timelines[i + 1 :])


def test_json_schema_pairs_a_schema_request_with_the_same_prompt_free() -> None:
    config = WorkloadConfig("json-schema", num_requests=6, output_len="48")
    pool = build_workload(config)
    assert pool == build_workload(config) and len(pool) == 6
    assert [r.tag for r in pool] == ["schema", "free", "free", "schema", "schema", "free"]
    schemas = set()
    pairs = [sorted(pool[i : i + 2], key=lambda r: r.tag, reverse=True) for i in (0, 2, 4)]
    for with_schema, free in pairs:
        assert with_schema.messages == free.messages and not free.json_schema
        assert not with_schema.ignore_eos and with_schema.max_tokens == 48
        schema = json.loads(with_schema.json_schema)
        StructuredOutput.json_schema(schema, "bench").validate()
        assert schema["properties"]["category"]["enum"][0] in with_schema.messages[0][1]
        schemas.add(with_schema.json_schema)
    assert len(schemas) == 3, "every request has its own schema"


def test_json_schema_forced_adds_the_same_schema_request_without_drafts() -> None:
    pool = build_workload(WorkloadConfig("json-schema:forced", num_requests=6, output_len="90"))
    assert [r.tag for r in pool[:3]] == ["schema", "schema-nodrafts", "free"]
    assert [r.tag for r in pool[3:]] == ["schema-nodrafts", "free", "schema"]
    for triple in (pool[:3], pool[3:]):
        by_tag = {r.tag: r for r in triple}
        assert by_tag["schema"].json_schema == by_tag["schema-nodrafts"].json_schema
        assert (by_tag["schema"].speculative, by_tag["schema-nodrafts"].speculative) == (
            None,
            False,
        )
        assert len({r.messages for r in triple}) == 1 and not by_tag["free"].json_schema
        StructuredOutput.json_schema(json.loads(by_tag["schema"].json_schema), "b").validate()
    with pytest.raises(ValueError, match="needs --grpc"):
        ServeConfig(workload=WorkloadConfig("json-schema:forced"))
    with pytest.raises(WorkloadError, match="forced"):
        WorkloadConfig("json-schema:other")
