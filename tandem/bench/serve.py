"""`tandem bench serve` and `tandem bench sla`: a load generator against a running cluster.

Method
------
One asyncio client sends the workload (`tandem.bench.workloads`: inputs, arrival processes) to
the router's OpenAI HTTP API (streaming, `stream_options.include_usage`; token-id prompts go to
/v1/completions with a token-id list, chat messages to /v1/chat/completions) or, with `--grpc`,
to `tandem.v1.Tandem/Generate` (token ids as `prompt_token_ids`, chat as `chat`). Greedy by
default; token-id workloads set `ignore_eos` so output lengths are exact. Each load point (one
rate or concurrency of a sweep) runs the same seeded inputs.

Per request the client records a `Timeline` (`tandem.bench.serving_metrics`): send time (the
moment the request is written; after any wait for a concurrency slot, which is the client queue
time), the arrival of every streamed chunk with its token count, the server's usage, the outcome.
All times are `time.perf_counter()` in this process.

Tokens per chunk:

- gRPC: exact, `len(token_ids)` of each message (speculative decoding sends several).
- HTTP: the stream carries text, not token ids. With `--http-chunk-tokens events` (default) every
  event holding a choice is a chunk of 1 token: Tandem's router sends one event per decode-worker
  step, and each step has >= 1 token even when its text is empty (held back: an incomplete UTF-8
  character, a possible stop string). With `text`, only events with non-empty text count (for
  servers that send role-only or empty keep-alive chunks). Either way output_tokens is the
  server's `usage.completion_tokens`, so TPOT, throughput and goodput are exact; TTFT and chunk
  ITL are exact in `events` mode on Tandem; token ITL equals chunk ITL unless every chunk held
  one token (use gRPC for per-token ITL under speculative decoding). The client's own count is
  kept per request (`streamed_tokens`) as the cross-check BENCHMARKS.md asks for.

Errors: an HTTP status (e.g. "429"), the status in an error event after the stream started, a
gRPC status name (e.g. "UNAVAILABLE"), "abort" (finish_reason abort), "incomplete" (the stream
ended without a finish) or the transport exception's class name.

Server side: before and after each point the router's /metrics (tandem_router_*) and every
worker's /metrics (workers from the admin gRPC `ListWorkers`, which gives each one's
metrics_url; without a gRPC target, the router's HTTP /admin/workers) are scraped; the report has
the deltas over the whole point (warm-up and cool-down included): requests by outcome, router
TTFT/TPOT/E2E means, local prefills, prefill retries; per worker speculative acceptance (rate =
accepted / draft tokens, mean acceptance length = 1 + accepted / drafts, per-position rates when
the worker exports tandem_spec_{drafted,accepted}_per_position_total{position}), KV transfers,
bytes, seconds and GB/s, prefix-cache hits; and the KV leak check: after the point, the workers
are polled until every one has tandem_kv_blocks_free == tandem_kv_blocks_total and no request
left (OK), or `leak_wait_s` passes (LEAK). It assumes this client is the cluster's only traffic.
Over gRPC the last message's timings add the exposed KV transfer time per request (prefill end
to decode admission) and per-request draft/accepted tokens.

Statistics: `summarize` over the measured window (`measured`: sent after the warm-up, finished
before the cool-down): count, mean, std, min, max, p50/p90/p95/p99 by linear interpolation
between closest ranks. Goodput counts requests meeting every SLO given.

`bench sla` sweeps rates (given, or doubling from a start until the SLO breaks, then bisecting)
and reports the operating point: the highest rate whose p99 TTFT and p99 TPOT meet the SLO with
no failed request.

Outputs with `--out DIR`: results.json (config, machine, git commit, model, per-point summaries,
server deltas, leak checks), requests.jsonl (every request of every point), inputs.jsonl (the
exact pool of inputs), summary.csv (one row per point) and PNG plots.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import Progress

from tandem import hub
from tandem.bench.common import BenchError
from tandem.bench.machine import machine_info
from tandem.bench.serve_config import PointResult, ServeConfig
from tandem.bench.serve_report import print_tables, sla_table, write_outputs
from tandem.bench.serving_metrics import Stats, Timeline, measured, summarize
from tandem.bench.workloads import (
    BenchRequest,
    LoadPoint,
    Sent,
    WorkloadError,
    build_workload,
    drive,
    plan,
)
from tandem.config import GRPC_OPTIONS
from tandem.model_config import load_config
from tandem.progress import progress_bar
from tandem.v1 import admin_pb2, admin_pb2_grpc, api_pb2, api_pb2_grpc

_SCRAPE_TIMEOUT_S = 5.0
_LEAK_POLL_S = 0.2


# --- clients ------------------------------------------------------------------------------


class HttpClient:
    """OpenAI streaming over httpx: completions for token ids, chat completions for messages."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.client = httpx.AsyncClient(
            base_url=config.url.rstrip("/"),
            timeout=httpx.Timeout(config.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
            trust_env=False,  # loopback benchmarks must not go through a proxy
        )

    def body(self, request: BenchRequest) -> tuple[str, dict[str, Any]]:
        c = self.config
        body: dict[str, Any] = {
            "model": c.model,
            "max_tokens": request.max_tokens,
            "temperature": c.temperature,
            "ignore_eos": request.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if c.temperature > 0:
            body["seed"] = c.seed + request.index
        if request.json_schema:
            schema = {"name": "record", "schema": json.loads(request.json_schema), "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if request.messages:
            body["messages"] = [{"role": r, "content": t} for r, t in request.messages]
            return "/v1/chat/completions", body
        body["prompt"] = list(request.prompt_token_ids)
        return "/v1/completions", body

    async def send(self, request: BenchRequest, timeline: Timeline) -> dict[str, Any]:
        path, body = self.body(request)
        extra: dict[str, Any] = {"finish_reason": None, "events": 0}
        timeline.send_time = time.perf_counter()
        try:
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    timeline.error = str(response.status_code)
                else:
                    async for line in response.aiter_lines():
                        if self._event(line, time.perf_counter(), timeline, extra):
                            break
        except httpx.HTTPError as e:
            timeline.error = type(e).__name__
        except ValueError:  # an event that is not JSON
            timeline.error = "invalid_event"
        _finish(timeline, extra)
        return extra

    def _event(self, line: str, now: float, timeline: Timeline, extra: dict[str, Any]) -> bool:
        """Record one SSE line; True at [DONE]."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        event = json.loads(data)
        if "error" in event:
            timeline.error = str(event["error"].get("code") or "stream_error")
            return False
        usage = event.get("usage")
        if usage:
            timeline.prompt_tokens = int(usage.get("prompt_tokens", 0))
            timeline.output_tokens = int(usage.get("completion_tokens", 0))
        for choice in event.get("choices") or ():
            extra["events"] += 1
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content") or ""
            events = self.config.http_chunk_tokens == "events"
            timeline.chunks.append((now, 1 if events or text else 0))
            if choice.get("finish_reason"):
                extra["finish_reason"] = choice["finish_reason"]
        return False

    async def get_text(self, url: str) -> str:
        headers = {}
        if self.config.admin_token:
            headers["authorization"] = f"Bearer {self.config.admin_token}"
        response = await self.client.get(url, timeout=_SCRAPE_TIMEOUT_S, headers=headers)
        response.raise_for_status()
        return response.text

    async def close(self) -> None:
        await self.client.aclose()


class GrpcClient:
    """`tandem.v1.Tandem/Generate`: exact token counts per streamed message."""

    def __init__(self, config: ServeConfig) -> None:
        assert config.grpc is not None
        self.config = config
        self.channel = grpc.aio.insecure_channel(config.grpc, options=GRPC_OPTIONS)
        self.stub = api_pb2_grpc.TandemStub(self.channel)

    def message(self, request: BenchRequest) -> api_pb2.GenerateRequest:
        c = self.config
        sampling = api_pb2.SamplingOptions(
            max_tokens=request.max_tokens, temperature=c.temperature, ignore_eos=request.ignore_eos
        )
        if c.temperature > 0:
            sampling.seed = c.seed + request.index
        if request.json_schema:
            sampling.structured_output.json_schema = request.json_schema
        msg = api_pb2.GenerateRequest(model=c.model, sampling=sampling)
        if request.speculative is not None:
            msg.speculative = request.speculative
        if request.messages:
            msg.chat.messages.extend(
                api_pb2.ChatMessage(role=r, content=t) for r, t in request.messages
            )
        else:
            msg.prompt_token_ids.ids.extend(request.prompt_token_ids)
        return msg

    keep_token_ids = False  # also return each request's output token ids (extra["token_ids"])

    async def send(self, request: BenchRequest, timeline: Timeline) -> dict[str, Any]:
        msg = self.message(request)
        extra: dict[str, Any] = {"finish_reason": None}
        tokens: list[int] = []
        timeline.send_time = time.perf_counter()
        try:
            async for response in self.stub.Generate(msg, timeout=self.config.timeout_s):
                timeline.chunks.append((time.perf_counter(), len(response.token_ids)))
                if self.keep_token_ids:
                    tokens.extend(response.token_ids)
                if response.finish_reason:
                    extra["finish_reason"] = response.finish_reason
                    timeline.prompt_tokens = response.usage.prompt_tokens
                    timeline.output_tokens = response.usage.completion_tokens
                    extra["server"] = _timings(response.timings)
        except grpc.aio.AioRpcError as e:
            timeline.error = e.code().name
        if self.keep_token_ids:
            extra["token_ids"] = tokens
        _finish(timeline, extra)
        return extra

    async def close(self) -> None:
        await self.channel.close()


def _timings(t: api_pb2.Timings) -> dict[str, Any]:
    return {
        "queue_s": t.queue_s,
        "ttft_s": t.ttft_s,
        "e2e_s": t.e2e_s,
        "tpot_s": t.tpot_s,
        "transfer_s": t.transfer_s,
        "prefill_worker": t.prefill_worker,
        "decode_worker": t.decode_worker,
        "draft_tokens": t.draft_tokens,
        "accepted_tokens": t.accepted_tokens,
    }


def _finish(timeline: Timeline, extra: dict[str, Any]) -> None:
    extra["streamed_tokens"] = sum(n for _, n in timeline.chunks)
    if timeline.error is None and extra["finish_reason"] is None:
        timeline.error = "incomplete"
    elif timeline.error is None and extra["finish_reason"] == "abort":
        timeline.error = "abort"


# --- server-side metrics ------------------------------------------------------------------

Sample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[Sample]:
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric(samples: Sequence[Sample], name: str) -> float | None:
    """The sum of the samples named `name` over all labels; None when absent."""
    values = [v for n, _, v in samples if n == name]
    return sum(values) if values else None


def by_label(samples: Sequence[Sample], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n == name and label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


def _delta(after: Sequence[Sample], before: Sequence[Sample], name: str) -> float | None:
    a = metric(after, name)
    return None if a is None else a - (metric(before, name) or 0.0)


def _label_delta(
    after: Sequence[Sample], before: Sequence[Sample], name: str, label: str
) -> dict[str, float]:
    a, b = by_label(after, name, label), by_label(before, name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def router_delta(before: Sequence[Sample], after: Sequence[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": _label_delta(after, before, "tandem_router_requests_total", "outcome"),
        "local_prefills": _delta(after, before, "tandem_router_local_prefills"),
        "prefill_retries": _delta(after, before, "tandem_router_prefill_retries"),
        "inflight_end": metric(after, "tandem_router_inflight"),
        "queued_end": metric(after, "tandem_router_queued"),
    }
    for h in ("ttft", "tpot", "e2e"):
        base = f"tandem_router_{h}_seconds"
        count = _delta(after, before, f"{base}_count")
        out[f"{h}_count"] = count
        out[f"{h}_mean_s"] = _ratio(_delta(after, before, f"{base}_sum"), count)
    return out


def worker_delta(before: Sequence[Sample], after: Sequence[Sample]) -> dict[str, Any]:
    d = {
        name: _delta(after, before, f"tandem_{name}_total")
        for name in (
            "spec_drafts",
            "spec_draft_tokens",
            "spec_accepted_tokens",
            "kv_transfers",
            "kv_transfer_bytes",
            "kv_transfer_seconds",
            "prefix_cache_hit_tokens",
            "prefix_cache_query_tokens",
        )
    }
    accepted, drafts = d["spec_accepted_tokens"], d["spec_drafts"]
    return {
        "spec": {
            "drafts": drafts,
            "draft_tokens": d["spec_draft_tokens"],
            "accepted_tokens": accepted,
            "acceptance_rate": _ratio(accepted, d["spec_draft_tokens"]),
            "mean_acceptance_length": 1 + accepted / drafts
            if accepted is not None and drafts
            else None,
            "per_position": per_position(before, after),
        },
        "transfer": {
            "count": d["kv_transfers"],
            "bytes": d["kv_transfer_bytes"],
            "seconds": d["kv_transfer_seconds"],
            "gb_s": _ratio(
                d["kv_transfer_bytes"] and d["kv_transfer_bytes"] / 1e9, d["kv_transfer_seconds"]
            ),
            "mean_s": _ratio(d["kv_transfer_seconds"], d["kv_transfers"]),
            "failures": _label_delta(after, before, "tandem_kv_transfer_failures_total", "cause"),
        },
        "prefix_cache": {
            "hit_tokens": d["prefix_cache_hit_tokens"],
            "query_tokens": d["prefix_cache_query_tokens"],
            "hit_rate": _ratio(d["prefix_cache_hit_tokens"], d["prefix_cache_query_tokens"]),
        },
        "kv_blocks_total": metric(after, "tandem_kv_blocks_total"),
        "kv_blocks_free": metric(after, "tandem_kv_blocks_free"),
        "requests_end": sum(
            metric(after, f"tandem_requests_{s}") or 0.0 for s in ("running", "waiting", "parked")
        ),
    }


def per_position(before: Sequence[Sample], after: Sequence[Sample]) -> list[float] | None:
    """Acceptance rate per draft position, when the worker exports
    tandem_spec_{drafted,accepted}_per_position_total{position="i"}."""
    drafted = _label_delta(after, before, "tandem_spec_drafted_per_position_total", "position")
    accepted = _label_delta(after, before, "tandem_spec_accepted_per_position_total", "position")
    if not drafted:
        return None
    positions = sorted(drafted, key=int)
    return [accepted.get(p, 0.0) / drafted[p] for p in positions]


@dataclass
class WorkerScrape:
    worker_id: str
    role: str
    metrics_url: str
    samples: list[Sample] | None  # None: could not be scraped
    error: str | None = None


@dataclass
class ClusterScrape:
    router: list[Sample] | None
    workers: dict[str, WorkerScrape]
    router_error: str | None = None


class ServerMetrics:
    """Scrapes the router's and the workers' Prometheus endpoints."""

    def __init__(self, config: ServeConfig, http: HttpClient) -> None:
        self.config = config
        self.http = http
        target = config.admin or config.grpc
        self.channel = grpc.aio.insecure_channel(target) if target else None

    async def workers(self) -> list[dict[str, Any]]:
        """worker_id, role, metrics_url of every registered worker (admin ListWorkers)."""
        if self.channel is None:
            text = await self.http.get_text("/admin/workers")
            return list(json.loads(text)["workers"])
        stub = admin_pb2_grpc.AdminStub(self.channel)
        token = self.config.admin_token
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        reply = await stub.ListWorkers(
            admin_pb2.ListWorkersRequest(), metadata=metadata, timeout=_SCRAPE_TIMEOUT_S
        )
        return [
            {"worker_id": w.worker_id, "role": w.role, "metrics_url": w.metrics_url}
            for w in reply.workers
        ]

    async def _text(self, url: str) -> tuple[list[Sample] | None, str | None]:
        try:
            return parse_metrics(await self.http.get_text(url)), None
        except (httpx.HTTPError, ValueError) as e:
            return None, f"{type(e).__name__}: {e}"

    async def scrape(self) -> ClusterScrape:
        router, router_error = await self._text("/metrics")
        try:
            workers = await self.workers()
        except (grpc.aio.AioRpcError, httpx.HTTPError, ValueError, KeyError) as e:
            return ClusterScrape(router, {}, f"cannot list workers: {type(e).__name__}: {e}")
        texts = await asyncio.gather(*(self._text(w["metrics_url"]) for w in workers))
        scraped = {
            w["worker_id"]: WorkerScrape(
                w["worker_id"], w["role"], w["metrics_url"], samples, error
            )
            for w, (samples, error) in zip(workers, texts, strict=True)
        }
        return ClusterScrape(router, scraped, router_error)

    async def settle(self, wait_s: float) -> tuple[ClusterScrape, dict[str, Any]]:
        """Scrape until every worker is idle with all KV blocks free, or wait_s passes."""
        deadline = time.perf_counter() + wait_s
        start = time.perf_counter()
        while True:
            scrape = await self.scrape()
            check = leak_check(scrape)
            if check["status"] != "LEAK" or time.perf_counter() >= deadline:
                check["waited_s"] = time.perf_counter() - start
                return scrape, check
            await asyncio.sleep(_LEAK_POLL_S)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


def leak_check(scrape: ClusterScrape) -> dict[str, Any]:
    """OK when every worker reports free == total KV blocks and no request left; LEAK when one
    does not; unknown when no worker could be read."""
    workers: dict[str, Any] = {}
    leaked = False
    for wid, w in sorted(scrape.workers.items()):
        if w.samples is None:
            workers[wid] = {"role": w.role, "error": w.error}
            continue
        total = metric(w.samples, "tandem_kv_blocks_total")
        free = metric(w.samples, "tandem_kv_blocks_free")
        left = sum(
            metric(w.samples, f"tandem_requests_{s}") or 0.0
            for s in ("running", "waiting", "parked")
        )
        ok = total is not None and free == total and left == 0
        leaked |= not ok
        workers[wid] = {
            "role": w.role,
            "blocks_total": total,
            "blocks_free": free,
            "requests": left,
        }
    readable = any("error" not in w for w in workers.values())
    status = "LEAK" if leaked else ("OK" if readable else "unknown")
    return {"status": status, "workers": workers}


def server_deltas(before: ClusterScrape, after: ClusterScrape) -> dict[str, Any]:
    router = router_delta(before.router or [], after.router) if after.router is not None else None
    workers = {}
    for wid, w in sorted(after.workers.items()):
        prior = before.workers.get(wid)
        if w.samples is None:
            workers[wid] = {"role": w.role, "error": w.error}
            continue
        base = prior.samples if prior is not None and prior.samples is not None else []
        workers[wid] = {"role": w.role, **worker_delta(base, w.samples)}
    return {
        "router": router,
        "router_error": after.router_error,
        "workers": workers,
        "totals": _totals(workers),
    }


def _totals(workers: dict[str, Any]) -> dict[str, Any]:
    """Acceptance over the decode workers, transfers as the decode side counted them."""
    decode = [w for w in workers.values() if w.get("role") == "decode" and "spec" in w]

    def total(group: str, key: str) -> float:
        return sum(w[group][key] or 0.0 for w in decode)

    drafts, draft_tokens = total("spec", "drafts"), total("spec", "draft_tokens")
    accepted = total("spec", "accepted_tokens")
    nbytes, seconds = total("transfer", "bytes"), total("transfer", "seconds")
    return {
        "spec_drafts": drafts,
        "spec_draft_tokens": draft_tokens,
        "spec_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "kv_transfers": total("transfer", "count"),
        "kv_transfer_bytes": nbytes,
        "kv_transfer_seconds": seconds,
        "kv_transfer_gb_s": nbytes / 1e9 / seconds if seconds else None,
    }


# --- one load point -----------------------------------------------------------------------


def summarize_point(
    point: LoadPoint, sents: list[Sent], config: ServeConfig, start: float
) -> PointResult:
    timelines = [s.timeline for s in sents]
    kept_ids = {id(t) for t in measured(timelines, config.warmup_s, config.cooldown_s)}
    kept = [s for s in sents if id(s.timeline) in kept_ids]
    summary = summarize([s.timeline for s in kept], config.slo_given)
    report: dict[str, Any] = {
        "label": point.label,
        "point": asdict(point),
        "sent": len(sents),
        "measured": len(kept),
        "summary": asdict(summary),
        "checks": client_checks(kept),
        "server_timings": grpc_timings(kept),
    }
    tags = sorted({s.request.tag for s in kept})
    if len(tags) > 1:
        report["by_tag"] = {
            tag: tag_summary([s for s in kept if s.request.tag == tag], config) for tag in tags
        }
    report["requests"] = [request_record(s, start, id(s.timeline) in kept_ids) for s in sents]
    return PointResult(point, sents, kept, summary, report)


def tag_summary(sents: Sequence[Sent], config: ServeConfig) -> dict[str, Any]:
    """One tag's summary, with its share of accepted draft tokens in its output tokens (over
    gRPC; on a `--spec grammar` worker, the grammar's forced tokens) and its mean decode rate
    per request, (output tokens - 1) / (E2E - TTFT)."""
    timelines = [s.timeline for s in sents]
    ok = [s for s in sents if s.timeline.ok and s.timeline.tpot]
    out = sum(s.timeline.n_out for s in ok)
    accepted = sum(s.extra.get("server", {}).get("accepted_tokens", 0) for s in ok)
    return {
        **asdict(summarize(timelines, config.slo_given)),
        "output_tokens": out,
        "accepted_tokens": accepted,
        "accepted_share": accepted / out if out else None,
        "decode_tok_s": sum(1 / (s.timeline.tpot or 1) for s in ok) / len(ok) if ok else None,
    }


def client_checks(kept: Sequence[Sent]) -> dict[str, int]:
    """Cross-checks of the server's counts: the client's re-count of streamed tokens (exact on
    gRPC; a lower bound on HTTP) and exact output lengths where EOS was ignored."""
    ok = [s for s in kept if s.timeline.ok]
    return {
        "streamed_token_mismatches": sum(
            s.extra.get("streamed_tokens") != s.timeline.n_out for s in ok
        ),
        "length_mismatches": sum(
            s.request.ignore_eos and s.timeline.n_out != s.request.max_tokens for s in ok
        ),
    }


def grpc_timings(kept: Sequence[Sent]) -> dict[str, Any] | None:
    """From gRPC's last messages: exposed KV transfer time (prefill end to decode admission) of
    requests that went through a prefill worker, and acceptance summed over requests."""
    server = [s.extra["server"] for s in kept if s.timeline.ok and "server" in s.extra]
    if not server:
        return None
    remote = [t for t in server if t["prefill_worker"]]
    draft = sum(t["draft_tokens"] for t in server)
    accepted = sum(t["accepted_tokens"] for t in server)
    exposed = Stats.of([t["transfer_s"] for t in remote])
    return {
        "requests": len(server),
        "via_prefill_worker": len(remote),
        "exposed_transfer_s": asdict(exposed) if exposed else None,
        "draft_tokens": draft,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft if draft else None,
    }


def request_record(s: Sent, start: float, in_window: bool) -> dict[str, Any]:
    """One line of requests.jsonl; times in seconds from the start of the point."""
    t = s.timeline
    return {
        "seq": s.seq,
        "measured": in_window,
        "input_index": s.request.index,
        "tag": s.request.tag,
        "source": s.request.source,
        "arrival_s": s.arrival - start,
        "send_s": t.send_time - start,
        "queue_s": t.queue_s,
        "ttft_s": t.ttft,
        "tpot_s": t.tpot,
        "e2e_s": t.e2e,
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.n_out,
        "max_tokens": s.request.max_tokens,
        "error": t.error,
        "chunks": [[round(at - start, 6), n] for at, n in t.chunks],
        **s.extra,
    }


async def run_point(
    config: ServeConfig,
    pool: Sequence[BenchRequest],
    point: LoadPoint,
    client: HttpClient | GrpcClient,
    server: ServerMetrics | None,
    progress: Progress,
) -> PointResult:
    before = await server.scrape() if server is not None else None
    max_requests = config.max_requests
    if max_requests is None and config.duration_s is None:
        max_requests = len(pool)
    task = progress.add_task(point.label, total=max_requests)
    start = time.perf_counter()
    sents = await drive(
        plan(pool, point, max_requests, config.duration_s, config.seed),
        client.send,
        point,
        config.duration_s,
        on_done=lambda _: progress.advance(task),
    )
    result = summarize_point(point, sents, config, start)
    if server is not None and before is not None:
        progress.update(task, description=f"{point.label}: server metrics")
        after, check = await server.settle(config.leak_wait_s)
        result.report["server"] = server_deltas(before, after)
        result.report["kv_leak_check"] = check
    progress.update(task, description=point.label)
    return result


# --- the run ------------------------------------------------------------------------------


@dataclass
class ModelInfo:
    id: str
    max_model_len: int | None
    vocab_size: int | None


async def model_info(
    config: ServeConfig, http: HttpClient, client: HttpClient | GrpcClient
) -> ModelInfo:
    if isinstance(client, GrpcClient):
        reply = await client.stub.ListModels(api_pb2.ListModelsRequest(), timeout=30)
        card = reply.models[0]
        model_id, max_len = card.id, int(card.max_model_len) or None
    else:
        reply_json = json.loads(await http.get_text("/v1/models"))
        card_json = reply_json["data"][0]
        model_id, max_len = card_json["id"], card_json.get("max_model_len")
    vocab = config.vocab_size
    if vocab is None and config.workload.needs_vocab:
        vocab = local_vocab_size(model_id)
        if vocab is None:
            raise BenchError(
                f"cannot find the vocabulary size of {model_id!r} on this machine: "
                "give --vocab-size"
            )
    return ModelInfo(model_id, max_len, vocab)


def local_vocab_size(model_id: str) -> int | None:
    """The vocabulary of the served model when its id is a local path or a pulled catalogue
    model (the ids Tandem serves under)."""
    path = Path(model_id).expanduser()
    entry = hub.CATALOGUE.get(model_id)
    if not path.exists() and entry is not None:
        path = hub.models_dir() / entry.filename
    if not path.exists():
        return None
    try:
        return int(load_config(path).vocab_size)
    except (OSError, ValueError, KeyError):
        return None


@asynccontextmanager
async def _clients(config: ServeConfig) -> Any:
    http = HttpClient(config)
    client: HttpClient | GrpcClient = GrpcClient(config) if config.grpc else http
    server = ServerMetrics(config, http) if config.server_metrics else None
    try:
        yield http, client, server
    finally:
        if server is not None:
            await server.close()
        if isinstance(client, GrpcClient):
            await client.close()
        await http.close()


async def _run_points(
    config: ServeConfig, points: Sequence[LoadPoint], console: Console
) -> tuple[ModelInfo, list[BenchRequest], list[PointResult]]:
    async with _clients(config) as (http, client, server):
        info = await model_info(config, http, client)
        pool = build_workload(config.workload, info.vocab_size, info.max_model_len)
        results: list[PointResult] = []
        with progress_bar(console) as progress:
            for point in points:
                results.append(await run_point(config, pool, point, client, server, progress))
        return info, pool, results


def run_serve_bench(config: ServeConfig, console: Console) -> dict[str, Any]:
    """Run every load point; print the tables; write the outputs when config.out is set."""
    console.print(_header(config))
    try:
        info, pool, results = asyncio.run(_run_points(config, config.points, console))
    except (httpx.HTTPError, grpc.aio.AioRpcError, WorkloadError) as e:
        raise BenchError(_connect_error(config, e)) from None
    report = build_report(config, info, pool, results)
    print_tables(console, config, results)
    if config.out:
        write_outputs(Path(config.out), report, pool, results, config.plots)
        console.print(f"[dim]wrote {config.out}[/dim]")
    return report


def _connect_error(config: ServeConfig, e: BaseException) -> str:
    if isinstance(e, WorkloadError):
        return str(e)
    if isinstance(e, grpc.aio.AioRpcError):
        return f"gRPC {config.grpc}: {e.code().name}: {e.details()}"
    return f"HTTP {config.url}: {type(e).__name__}: {e}"


def _header(config: ServeConfig) -> str:
    target = f"gRPC {config.grpc}" if config.grpc else f"HTTP {config.url}"
    if config.duration_s is not None:
        limit = f"{config.duration_s:g} s" + (
            f" or {config.max_requests} requests" if config.max_requests else ""
        )
    else:
        limit = f"{config.max_requests} requests" if config.max_requests else "the whole pool"
    return (
        f"[bold]bench serve[/bold] {target}: workload {config.workload.name}, "
        f"{len(config.points)} point(s), {limit} per point, seed {config.seed}"
    )


def build_report(
    config: ServeConfig, info: ModelInfo, pool: Sequence[BenchRequest], results: list[PointResult]
) -> dict[str, Any]:
    return {
        "benchmark": "serve",
        "config": config.to_json(),
        "machine": {**machine_info(), "loadavg_end": os.getloadavg()},
        "model": asdict(info),
        "inputs": {"count": len(pool), "file": "inputs.jsonl"},
        "percentiles": "linear interpolation between closest ranks (numpy 'linear')",
        "points": [{k: v for k, v in r.report.items() if k != "requests"} for r in results],
    }


# --- bench sla ----------------------------------------------------------------------------


def meets(result: PointResult, ttft_p99_s: float, tpot_p99_s: float) -> bool:
    """No failed request, and p99 TTFT and TPOT within the SLO."""
    s = result.summary
    if s.num_requests == 0 or s.num_ok < s.num_requests or s.ttft is None:
        return False
    tpot_ok = s.tpot is None or s.tpot.p99 <= tpot_p99_s
    return s.ttft.p99 <= ttft_p99_s and tpot_ok


def next_sla_rate(
    history: Sequence[tuple[float, bool]], start: float, max_rate: float, bisect_steps: int
) -> float | None:
    """The next rate of the search: double from `start` while the SLO holds (up to max_rate),
    then bisect between the highest passing and lowest failing rate `bisect_steps` times."""
    if not history:
        return start
    failed = [r for r, ok in history if not ok]
    if not failed:
        nxt = history[-1][0] * 2
        return nxt if nxt <= max_rate else None
    first_fail = next(i for i, (_, ok) in enumerate(history) if not ok)
    if len(history) - first_fail - 1 >= bisect_steps:
        return None
    hi = min(failed)
    lo = max((r for r, ok in history if ok and r < hi), default=0.0)
    return (lo + hi) / 2


def operating_point(
    history: Sequence[tuple[float, bool]],
) -> float | None:
    """The highest rate that met the SLO."""
    return max((r for r, ok in history if ok), default=None)


async def _sla_search(
    config: ServeConfig,
    console: Console,
    ttft_p99_s: float,
    tpot_p99_s: float,
    rates: Sequence[float],
    start_rate: float,
    max_rate: float,
    bisect_steps: int,
) -> tuple[ModelInfo, list[BenchRequest], list[PointResult], list[tuple[float, bool]]]:
    template = config.points[0]
    history: list[tuple[float, bool]] = []
    results: list[PointResult] = []
    async with _clients(config) as (http, client, server):
        info = await model_info(config, http, client)
        pool = build_workload(config.workload, info.vocab_size, info.max_model_len)
        queue = sorted(rates)
        with progress_bar(console) as progress:
            while True:
                rate = queue.pop(0) if rates and queue else None
                if not rates:
                    rate = next_sla_rate(history, start_rate, max_rate, bisect_steps)
                if rate is None:
                    break
                point = replace(template, rate=rate)
                result = await run_point(config, pool, point, client, server, progress)
                ok = meets(result, ttft_p99_s, tpot_p99_s)
                result.report["meets_slo"] = ok
                history.append((rate, ok))
                results.append(result)
    return info, pool, results, history


def run_sla_bench(
    config: ServeConfig,
    console: Console,
    ttft_p99_s: float,
    tpot_p99_s: float,
    rates: Sequence[float] = (),
    start_rate: float = 1.0,
    max_rate: float = 1024.0,
    bisect_steps: int = 3,
) -> dict[str, Any]:
    """Sweep request rates and report the operating point (highest rate meeting the SLO)."""
    console.print(_header(config))
    console.print(
        f"SLO: p99 TTFT <= {ttft_p99_s * 1e3:g} ms, p99 TPOT <= {tpot_p99_s * 1e3:g} ms, "
        "no failed request"
    )
    try:
        info, pool, results, history = asyncio.run(
            _sla_search(
                config, console, ttft_p99_s, tpot_p99_s, rates, start_rate, max_rate, bisect_steps
            )
        )
    except (httpx.HTTPError, grpc.aio.AioRpcError, WorkloadError) as e:
        raise BenchError(_connect_error(config, e)) from None
    results.sort(key=lambda r: r.point.load)
    report = build_report(config, info, pool, results)
    best = operating_point(history)
    report["sla"] = {
        "ttft_p99_s": ttft_p99_s,
        "tpot_p99_s": tpot_p99_s,
        "search": "given rates" if rates else "doubling, then bisection",
        "history": [{"rate": r, "meets": ok} for r, ok in history],
        "operating_point_rate": best,
    }
    print_tables(console, config, results)
    console.print(sla_table(report, results))
    verdict = f"[green]{best:g} req/s[/green]" if best is not None else "[red]none[/red]"
    console.print(f"operating point (highest rate meeting the SLO): {verdict}")
    if config.out:
        write_outputs(Path(config.out), report, pool, results, config.plots)
        console.print(f"[dim]wrote {config.out}[/dim]")
    return report
