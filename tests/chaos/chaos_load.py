"""Concurrent streaming load for the chaos scenarios, the reference outputs, and the checks every
scenario ends with.

`Load` runs client threads that send greedy streaming requests back to back, over gRPC and over
HTTP (SSE), each with its own deadline (sent as the request's `timeout` too), optionally
cancelling each one at a random point; every request's `Outcome` is kept. `check_outcomes` then
asserts what a fault may never cost: a request that did not end, a client that waited past its
deadline, an error outside the scenario's allowed ones (never INVALID_ARGUMENT for a server-side
failure), a completed greedy output that differs from the offline engine's.
`check_no_process_left` and `running_clean` check by pid that a cluster leaves no process behind
(`cluster_processes`: every process naming its registry).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import psutil
from cluster_helpers import generate_request, grpc_stream, redis_pid, running, sse_events, wait_for

from router.router_server import RouterAddress
from tandem.cluster.local_cluster import LocalCluster
from tandem.v1 import api_pb2_grpc

WORKER_ARGS = ["--kv-memory-gib", "0.05", "--num-threads", "1"]
TTL_S = 1.5  # a killed worker leaves the registry this long after its last heartbeat
MAX_TOKENS = 12
DEADLINE_S = 30.0  # each request's own, on the client and in the router
DEADLINE_SLACK_S = 2.0  # a client may see the end this much after its deadline (a busy machine)
CANCELLED = "cancelled by the client"
CONNECTION_LOST = "http connection lost"
# A call that gRPC's own server ended as it stopped, before any handler had taken it: CANCELLED
# with gRPC's bare details, and no token (grpc/grpc#41785, open; a bare grpc.aio server that
# refuses every call does it in about 1 stop in 10 under four clients). A handler's error, or
# the server's cancel of calls still in flight past its grace, is UNAVAILABLE.
UNHANDLED_AT_STOP = "CANCELLED by gRPC's stop before any handler took it"


def prompt_ids(i: int) -> list[int]:
    """One of PROMPTS distinct prompts of 40 byte tokens: longer than the router's
    local-prefill threshold, so that each one goes through a prefill worker."""
    return list(f"{i % PROMPTS} chaos under load: every request ends well ".encode()[:40])


PROMPTS = 4

Reference = dict[int, tuple[list[int], str]]  # prompt: greedy tokens, the text the router makes


@dataclass(frozen=True)
class Outcome:
    api: str  # "grpc" | "http"
    prompt: int
    token_ids: tuple[int, ...]  # gRPC: every token received
    text: str  # the text received
    error: str | None  # None: completed; else the gRPC code, HTTP status or SSE error type
    seconds: float  # from the send to the end
    route: str = ""  # gRPC: the request id and its last prefill -> decode workers; HTTP: its id
    sent: float = 0.0  # time.monotonic() at the send


class Load:
    """`clients` threads (alternately gRPC and HTTP) sending requests back to back until
    `stop()`. With `cancel_rate`, that share of requests is cancelled by its client after a
    random number of tokens (0: before the first), from a seeded generator."""

    def __init__(
        self,
        address: Any,
        clients: int = 4,
        cancel_rate: float = 0.0,
        seed: int = 0,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self.address = address
        self.clients = clients
        self.cancel_rate = cancel_rate
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(c, random.Random(seed * 1000 + c)))
            for c in range(clients)
        ]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(DEADLINE_S + 2 * DEADLINE_SLACK_S)
        assert not any(t.is_alive() for t in self._threads), "a request never ended"
        return list(self.outcomes)

    def ended(self, completed_only: bool = True) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.error is None or not completed_only)

    def _client(self, c: int, rng: random.Random) -> None:
        i = c
        while not self._stop.is_set():
            cancel_after = (
                rng.randrange(self.max_tokens) if rng.random() < self.cancel_rate else None
            )
            run = self._grpc if c % 2 == 0 else self._http
            outcome = run(i % PROMPTS, cancel_after)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.error not in (None, CANCELLED):
                self._stop.wait(0.05)  # a refused client retries soon, not in a tight loop
            i += 1

    def _grpc(self, prompt: int, cancel_after: int | None) -> Outcome:
        req = generate_request(
            ids=prompt_ids(prompt), max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True
        )
        req.timeout_s = DEADLINE_S
        tokens: list[int] = []
        text = route = ""
        error: str | None = None
        start = time.monotonic()
        with grpc.insecure_channel(self.address.grpc_target) as channel:
            call = api_pb2_grpc.TandemStub(channel).Generate(req, timeout=DEADLINE_S)
            try:
                for msg in call:
                    if cancel_after is not None and len(tokens) >= cancel_after:
                        call.cancel()
                        error = CANCELLED
                        break
                    tokens.extend(msg.token_ids)
                    text += msg.text
                    if msg.finish_reason:
                        timings = msg.timings
                        route = f"{msg.request_id} {timings.prefill_worker or 'local'}"
                        route += f" -> {timings.decode_worker}"
                        break
                else:
                    error = "the stream ended without a final message"
            except grpc.RpcError as e:
                error = e.code().name
                cancelled = e.code() == grpc.StatusCode.CANCELLED
                if cancelled and e.details() == "CANCELLED" and not tokens:
                    error = UNHANDLED_AT_STOP
            finally:
                call.cancel()
        seconds = time.monotonic() - start
        return Outcome("grpc", prompt, tuple(tokens), text, error, seconds, route, start)

    def _http(self, prompt: int, cancel_after: int | None) -> Outcome:
        body = {
            "prompt": prompt_ids(prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "timeout": DEADLINE_S,
        }
        text = route = ""
        error: str | None = None
        start = time.monotonic()
        url = f"{self.address.http_url}/v1/completions"
        try:
            with httpx.stream("POST", url, json=body, timeout=DEADLINE_S) as r:
                if r.status_code != 200:
                    r.read()
                    error = f"http {r.status_code}"
                else:
                    error = "the stream ended without a final chunk"
                    for n, event in enumerate(sse_events(r.iter_lines())):
                        if cancel_after is not None and n >= cancel_after:
                            error = CANCELLED  # leaving the block closes the connection
                            break
                        if "error" in event:
                            error = event["error"]["type"]
                            break
                        choice = event["choices"][0]
                        text, route = text + choice["text"], event["id"]
                        if choice["finish_reason"] is not None:
                            error = None
        except httpx.TimeoutException:
            error = "the client's timeout"
        except httpx.TransportError:  # refused, or cut mid-stream: the router is gone
            error = CONNECTION_LOST
        return Outcome("http", prompt, (), text, error, time.monotonic() - start, route, start)


def sigterm_under_load(
    launcher: subprocess.Popen[bytes], load: Load, stop_timeout_s: float, log: Path
) -> list[Outcome]:
    """SIGTERM `launcher` once every client of `load` has completed a request; it must exit 0
    within `stop_timeout_s` (its output, `log`, shown otherwise). The load's outcomes, where
    an UNHANDLED_AT_STOP call must have ended after the SIGTERM (when the router stopped)."""
    try:
        wait_for(lambda: load.ended() >= load.clients, 60.0, "the load to flow")
        signalled = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(stop_timeout_s) == 0, log.read_text()
    finally:
        outcomes = load.stop()
    early = [o for o in outcomes if o.error == UNHANDLED_AT_STOP and o.sent + o.seconds < signalled]
    assert not early, f"CANCELLED before the SIGTERM (at {signalled}): {early}"
    return outcomes


def check_outcomes(
    outcomes: list[Outcome],
    reference: Reference,
    allowed_errors: frozenset[str] = frozenset(),
) -> Counter[str]:
    """Every request ended in time, as allowed, and each completed one as the offline engine's
    greedy output (gRPC: its token ids; HTTP: the text the router made of them). Returns the
    outcomes by kind."""
    assert outcomes, "no request was sent"
    kinds = Counter(o.error or "completed" for o in outcomes)
    late = [o for o in outcomes if o.seconds > DEADLINE_S + DEADLINE_SLACK_S]
    assert not late, f"clients waited past their deadline: {late[:3]}"
    unexpected = {k for k in kinds if k not in allowed_errors | {"completed", CANCELLED}}
    odd = [o for o in outcomes if o.error in unexpected][:3]
    first = {k: min(o.sent for o in outcomes if (o.error or "completed") == k) for k in kinds}
    assert not unexpected, f"unexpected outcomes {dict(kinds)}: {odd}; first sent: {first}"
    for o in outcomes:
        if o.error is not None:
            continue
        tokens, text = reference[o.prompt]
        if o.api == "grpc":
            assert list(o.token_ids) == tokens, f"prompt {o.prompt}: {o}"
        assert o.text == text, f"prompt {o.prompt} over {o.api}: {o.text!r} != {text!r}"
    return kinds


def reference_of(address: RouterAddress | None, offline: dict[int, list[int]]) -> Reference:
    """Each prompt's greedy tokens and the text the router makes of them, from one request to
    the undisturbed cluster's router, whose tokens must equal the offline engine's."""
    assert address is not None
    reference: Reference = {}
    for i, tokens in offline.items():
        got: list[int] = []
        text = ""
        with grpc_stream(
            address.grpc_target, ids=prompt_ids(i), max_tokens=MAX_TOKENS,
            temperature=0.0, ignore_eos=True,
        ) as call:  # fmt: skip
            for msg in call:
                got.extend(msg.token_ids)
                text += msg.text
        assert got == tokens, f"prompt {i}: the cluster's greedy output is not the offline one"
        reference[i] = (tokens, text)
    return reference


def cluster_processes(registry_url: str) -> set[int]:
    """The pids of every live process that names this cluster's registry on its command line:
    its worker processes (`--redis URL`), a `tandem router` on it, and the embedded redis-server
    (whose title names its socket). After a scenario these are exactly the cluster's current
    processes; after it stops, none: nothing is left behind."""
    key = registry_url.removeprefix("unix://")
    found = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(key in arg for arg in p.info["cmdline"] or []):
            found.add(p.pid)
    return found


def check_no_process_left(cluster: LocalCluster) -> None:
    """The cluster's processes are its live workers and its Redis: no killed worker survives,
    no stray one runs beside its replacement."""
    assert cluster.registry is not None
    url = cluster.registry.url
    expected = {w.process.pid for w in cluster.workers if w.process.poll() is None}
    expected.add(redis_pid(url) or -1)
    assert cluster_processes(url) == expected


@contextlib.contextmanager
def running_clean(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """`running` (start; stop however the block ends), then no process of it left."""
    with running(cluster):
        assert cluster.registry is not None
        url = cluster.registry.url
        yield cluster
    wait_for(lambda: not cluster_processes(url), 20.0, "every process of the cluster to end")
