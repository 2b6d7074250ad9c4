"""Transfer endpoints in child processes, driven over a pipe: the tests' separate machines.

A `WorkerProcess` is a fresh interpreter (the 'spawn' start method: nothing inherited from pytest)
hosting named objects -- a PrefillWorker, a DecodeWorker, or a bare KVSender / KVReceiver over
small random caches -- and runs commands on them: `proc.call("reserve", "d", "r0", prompt, 16)`.
Every call has a timeout after which the child is killed and the call raises, so a transfer that
hangs fails its test instead of the run. Tickets cross as KVTicket protos, as between real
workers; KV tensors come back pickled (on the CPU) for the tests to compare.

`TANDEM_TEST_DEVICE=cuda` puts every engine and bare cache of the children on the GPU (the
shared-memory plane is then CUDA IPC, the pair NCCL), so the same tests check the CUDA paths on a
machine that has one; the default is the CPU.

Each child also gets two events to hold a sender between layers: a sender built with
`pause_at=k` sets `reached` before layer k and waits for the test to set `gate`, so a test can
kill a process or cancel a request at an exact point of a transfer without sleeping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, TypeVar

import torch

from decode_worker.decode_core import DecodeWorker, OutputStream
from kv_transfer import Arrival, KVLayout, KVReceiver, KVSender, KVTicket, OutboundTransfer
from kv_transfer.fake import FaultyPlane, at_layer
from kv_transfer.layout import gather_tokens, slot_mapping
from kv_transfer.planes import DataPlane
from kv_transfer.shm import SharedCache, create_shared_cache
from kv_transfer.state import FailureCause, TransferError, TransferState
from prefill_worker.prefill_core import PrefillResult, PrefillWorker
from tandem.config import EngineConfig, TransferConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.kv_quant import encode
from tandem.engine.loop import EngineLoop
from tandem.sampling_params import SamplingParams
from tandem.v1 import kv_transfer_pb2 as pb

CALL_TIMEOUT_S = 30.0  # default for one command; tests pass less where they expect less
PAUSE_LIMIT_S = 20.0  # a paused sender goes on by itself after this (a test that forgot)
DEVICE = torch.device(os.environ.get("TANDEM_TEST_DEVICE", "cpu"))  # the children's engines

T = TypeVar("T")


def gather_kv(
    kv_caches: list[torch.Tensor], block_ids: list[int], num_tokens: int
) -> list[torch.Tensor]:
    """Per layer, the token-major KV [2, num_tokens, heads, slot_dim] of a block table."""
    block_size = kv_caches[0].shape[2]
    slots = slot_mapping(block_ids, block_size, num_tokens, kv_caches[0].device)
    return [gather_tokens(cache, slots).cpu() for cache in kv_caches]


def ticket_bytes(ticket: KVTicket) -> bytes:
    return ticket.to_proto().SerializeToString()


def ticket_of(data: bytes) -> KVTicket:
    return KVTicket.from_proto(pb.KVTicket.FromString(data))


def engine_config(model: str, **options: Any) -> EngineConfig:
    """The children's engine config: on DEVICE unless `options` name another device."""
    return EngineConfig.create(model, **{"device": str(DEVICE), **options})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def colocated_greedy(
    model: str, prompts: list[list[int]], max_tokens: int, **options: Any
) -> list[list[int]]:
    """What an engine in the default role generates for the prompts, greedily; `options` go to
    the engine config."""
    engine = EngineCore(engine_config(model, num_blocks=256, **options))
    reqs = [engine.add_request(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


# -- the test's side ---------------------------------------------------------------------------


class ChildDied(RuntimeError):
    pass


class WorkerProcess:
    """A child process hosting transfer endpoints; see the module docstring."""

    def __init__(self, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.reached = ctx.Event()  # set by the child: a sender paused before its layer
        self.gate = ctx.Event()  # set by the test: the paused sender goes on
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child_conn, self.reached, self.gate), name=name, daemon=True
        )
        self.process.start()
        child_conn.close()

    def call(self, command: str, *args: Any, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        """Run `command` in the child and return its result or raise its exception; after
        `timeout` seconds the child is killed and TimeoutError raised."""
        self._conn.send_bytes(pickle.dumps((command, args, kwargs)))
        if not self._conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"{self.name}: {command} did not answer within {timeout} s")
        try:
            ok, value = pickle.loads(self._conn.recv_bytes())
        except (EOFError, ConnectionResetError):
            self.process.join(5)
            code = self.process.exitcode
            raise ChildDied(f"{self.name} exited ({code}) during {command}") from None
        if ok:
            return value
        if isinstance(value, tuple):  # a TransferError, which does not survive pickling
            cause, text = value
            error = TransferError(FailureCause(cause), "")
            error.args = (text,)
            raise error
        raise value

    def wait_paused(self, timeout: float = 10.0) -> None:
        """Until a sender built with `pause_at` holds before its layer."""
        if not self.reached.wait(timeout):
            raise TimeoutError(f"{self.name}: no sender reached its pause within {timeout} s")

    def resume(self) -> None:
        self.gate.set()

    def kill(self) -> None:
        """SIGKILL, as a crash: no cleanup of any kind runs in the child."""
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        """Close what the child still hosts (shared-memory files included), then kill it: a
        clean interpreter exit with torch and gRPC loaded takes seconds and frees nothing more."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, TimeoutError, ChildDied):
                self.call("close_all", timeout=15.0)
        self.kill()
        self._conn.close()


# -- the child's side --------------------------------------------------------------------------


def _serve(conn: Connection, reached: Event, gate: Event) -> None:
    torch.set_num_threads(1)  # two cores for two processes; intra-op threads only contend
    host = _Host(reached, gate)
    while True:
        try:
            command, args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:  # the test process is gone
            break
        try:
            reply: tuple[bool, Any] = (True, getattr(host, command)(*args, **kwargs))
        except TransferError as e:
            reply = (False, (e.cause.value, str(e)))
        except BaseException as e:
            reply = (False, _portable(e))
        conn.send_bytes(pickle.dumps(reply))


def _portable(error: BaseException) -> BaseException:
    """The exception if it survives pickling, else a RuntimeError with the child's traceback."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return RuntimeError(f"in the child process:\n{text}")


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    # Polled: the conditions span several threads' state and have no event of their own.
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.005)


def _in_thread(fn: Callable[[], T], within: float) -> T:
    """fn() on a thread of its own, so that a wait with no timeout of its own gets one."""
    result: Future[T] = Future()

    def run() -> None:
        try:
            result.set_result(fn())
        except BaseException as e:
            result.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return result.result(within)


class _Recorder(DataPlane):
    """Wraps a plane and keeps, per layer, the token-major KV it was asked to send."""

    def __init__(self, inner: DataPlane, sent: dict[int, torch.Tensor]) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.sent = sent

    def fill_header(self, header: pb.TransferHeader) -> None:
        self.inner.fill_header(header)

    def send_layers(
        self, layers: range, kv_caches: list[torch.Tensor], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        for layer in layers:  # read as the plane reads: blocks held
            self.sent[layer] = gather_tokens(kv_caches[layer], slots)
        yield from self.inner.send_layers(layers, kv_caches, slots, deadline)

    def flush(self, timeout_s: float) -> None:
        self.inner.flush(timeout_s)


class _RecordingSender(KVSender):
    """A KVSender that keeps each transfer's plane, and what the plane read from the source
    blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.planes: dict[str, str] = {}
        self.sent: dict[str, dict[int, torch.Tensor]] = {}

    def choose_plane(
        self, ticket: KVTicket, device: torch.device, heads: range | None = None
    ) -> DataPlane:
        plane = super().choose_plane(ticket, device, heads)
        self.planes[ticket.request_key] = _plane_name(plane)
        return _Recorder(plane, self.sent.setdefault(ticket.request_key, {}))


def _plane_name(plane: DataPlane) -> str:
    return pb.DataPlane.Name(plane.kind).removeprefix("DATA_PLANE_").lower()


class _RecordingDecodeWorker(DecodeWorker):
    """Keeps each request's prompt KV as it arrived: the one moment its blocks hold exactly the
    transferred KV (decoding appends to them next)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received: dict[str, list[torch.Tensor]] = {}
        self.extras: dict[str, dict[str, tuple[int, ...]]] = {}  # request -> name -> shape
        self.used_on_arrival: dict[str, int] = {}  # request -> blocks in use once it arrived

    def _arrived(self, a: Arrival) -> None:
        self.extras[a.request_key] = {name: tuple(t.shape) for name, t in a.extras.items()}
        req = self.engine.scheduler.parked.get(a.request_key)
        if a.state == TransferState.SUCCESS and req is not None:
            table = self.engine.kv_cache.block_table(a.request_key)
            caches = self.engine.runner.kv_caches
            self.received[a.request_key] = gather_kv(caches, table, req.num_prompt_tokens)
        super()._arrived(a)
        kv_cache = self.engine.kv_cache
        self.used_on_arrival[a.request_key] = kv_cache.num_blocks - kv_cache.num_free_blocks


@dataclasses.dataclass
class _Bare:
    """A KVSender or KVReceiver over its own caches, without an engine."""

    endpoint: KVSender | KVReceiver
    kv_caches: list[torch.Tensor]
    shm: SharedCache | None = None
    outcomes: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)


class _Host:
    """The child's objects and the commands on them (each public method is a command)."""

    def __init__(self, reached: Event, gate: Event) -> None:
        self.reached = reached
        self.gate = gate
        self.objects: dict[str, Any] = {}
        self.tokens_of: dict[str, OutputStream] = {}  # request -> the DecodeWorker's stream
        self.results: dict[str, Future[PrefillResult]] = {}  # request -> PrefillWorker's future

    def _get(self, name: str, kind: type[T]) -> T:
        obj = self.objects[name]
        assert isinstance(obj, kind), f"{name} is a {type(obj).__name__}, not a {kind.__name__}"
        return obj

    def colocated(
        self, model: str, prompts: list[list[int]], max_tokens: int, **options: Any
    ) -> list[list[int]]:
        # Here rather than in the test process: a process that loaded the model before parses
        # a GGUF file's metadata (seconds) only once.
        return colocated_greedy(model, prompts, max_tokens, **options)

    def close(self, name: str) -> None:
        obj = self.objects.pop(name)
        if isinstance(obj, _Bare):
            obj.endpoint.close()
            if obj.shm is not None:
                obj.shm.close()
        else:
            obj.close()

    def close_all(self) -> None:
        for name in list(self.objects):
            self.close(name)
        self.tokens_of.clear()
        self.results.clear()

    # -- engines in their roles --------------------------------------------------------------

    def prefill_worker(
        self,
        name: str,
        model: str,
        channel: str = "auto",
        fingerprint: str | None = None,
        pause_at: int | None = None,
        **options: Any,
    ) -> None:
        """A started PrefillWorker (see use_sender for the sender's options); the rest go to
        the engine config."""
        worker = PrefillWorker(engine_config(model, **options))
        self.objects[name] = worker
        worker.start()
        self.use_sender(name, channel, fingerprint, pause_at)

    def use_sender(
        self,
        name: str,
        channel: str,
        fingerprint: str | None = None,
        pause_at: int | None = None,
    ) -> None:
        """Give the prefill worker a new sender: forced `channel`, another model `fingerprint`,
        or a plane that pauses before layer `pause_at` (see WorkerProcess.wait_paused)."""
        worker = self._get(name, PrefillWorker)
        self.reached.clear()
        self.gate.clear()
        wrap = None
        if pause_at is not None:
            wrap = FaultyPlane.around(at_layer(pause_at, self._pause))
        sender = _RecordingSender(
            fingerprint or worker.fingerprint, channel=channel, wrap_plane=wrap
        )

        def swap() -> None:  # on the loop thread, which polls the sender between steps
            worker.sender.close()
            worker.sender = sender

        worker.call(swap).result(10)

    def _pause(self) -> None:
        self.reached.set()
        self.gate.wait(PAUSE_LIMIT_S)

    def submit(
        self,
        name: str,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        ticket: bytes,
        params: SamplingParams | None = None,
    ) -> None:
        """`params`: greedy(max_tokens) unless given."""
        worker = self._get(name, PrefillWorker)
        params = params or greedy(max_tokens)
        self.results[rid] = worker.submit(rid, prompt, params, ticket_of(ticket))

    def prefill_result(self, rid: str, within: float = 10.0) -> dict[str, Any]:
        """The PrefillResult's fields once the transfer is final; raises its TransferError."""
        return dataclasses.asdict(self.results.pop(rid).result(within))

    def sent(self, name: str, rid: str) -> list[torch.Tensor]:
        layers = self._recording_sender(name).sent[rid]
        return [layers[i].cpu() for i in range(len(layers))]

    def plane(self, name: str, rid: str) -> str:
        """The data plane the prefill worker's sender chose for the request."""
        return self._recording_sender(name).planes[rid]

    def _recording_sender(self, name: str) -> _RecordingSender:
        sender = self._get(name, PrefillWorker).sender
        assert isinstance(sender, _RecordingSender)
        return sender

    def decode_worker(self, name: str, model: str, **options: Any) -> None:
        """A started DecodeWorker; DecodeWorker's own keywords pass through, the rest go to the
        engine config."""
        own = ("shared_memory", "enable_pairs")
        kwargs = {k: options.pop(k) for k in own if k in options}
        transfer_fields = {"transfer_timeout_s": "timeout_s", "on_transfer_failure": "on_failure"}
        transfer = TransferConfig(
            **{f: options.pop(k) for k, f in transfer_fields.items() if k in options}
        )
        worker = _RecordingDecodeWorker(
            engine_config(model, **options), transfer=transfer, **kwargs
        )
        self.objects[name] = worker
        worker.start()

    def reserve(
        self,
        name: str,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        within: float = 10.0,
        params: SamplingParams | None = None,
    ) -> bytes:
        """`params`: greedy(max_tokens) unless given."""
        ticket_future, stream = self._get(name, DecodeWorker).reserve(
            rid, prompt, params or greedy(max_tokens)
        )
        self.tokens_of[rid] = stream
        ticket = ticket_future.result(within)
        assert ticket is not None
        return ticket_bytes(ticket)

    def tokens(self, rid: str, within: float = 10.0) -> tuple[list[int], str | None]:
        """The request's tokens and finish reason; raises the TransferError that ended it."""
        stream = self.tokens_of.pop(rid)

        def read() -> tuple[list[int], str | None]:
            chunks = list(stream)
            return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason

        return _in_thread(read, within)

    def choices(self, rid: str, within: float = 10.0) -> list[tuple[list[int], str | None]]:
        """Per choice of the request (n > 1), in index order: its tokens and finish reason."""
        stream = self.tokens_of.pop(rid)

        def read() -> list[tuple[list[int], str | None]]:
            out: list[tuple[list[int], str | None]] = [([], None) for _ in stream.choice_ids]
            for c in stream:
                tokens, _ = out[c.index]
                out[c.index] = (tokens + c.token_ids, c.finish_reason)
            return out

        return _in_thread(read, within)

    def colocated_choices(
        self, model: str, prompt: list[int], params: SamplingParams
    ) -> list[list[int]]:
        """What each of the n choices generates as a request of its own (seed + i)."""
        engine = EngineCore(engine_config(model, num_blocks=256))
        reqs = [engine.add_request(f"r{i}", prompt, params.choice(i)) for i in range(params.n)]
        while engine.has_unfinished():
            engine.step()
        return [r.output_token_ids for r in reqs]

    def received(self, name: str, rid: str) -> list[torch.Tensor]:
        return self._get(name, _RecordingDecodeWorker).received[rid]

    def used_on_arrival(self, name: str, rid: str) -> int:
        """The decode worker's blocks in use right after the request's KV arrived."""
        return self._get(name, _RecordingDecodeWorker).used_on_arrival[rid]

    def spec_counts(self, name: str) -> tuple[int, int, int]:
        """A worker's (drafts, draft tokens, accepted tokens) so far."""
        stats = self._get(name, DecodeWorker).engine.scheduler.spec_stats
        return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens

    def extras(self, name: str, rid: str) -> dict[str, tuple[int, ...]]:
        """The shapes of the proposer state that arrived with the request's KV."""
        return self._get(name, _RecordingDecodeWorker).extras[rid]

    def cancel(self, name: str, rid: str) -> None:
        worker = self._get(name, DecodeWorker)
        worker.cancel(rid)
        worker.call(lambda: None).result(10)  # calls run in order: the cancel has run

    def failures(self, name: str) -> dict[str, int]:
        """The decode worker's failed transfers by cause."""
        metrics = self._get(name, DecodeWorker).transfer_metrics
        return {cause.value: n for cause, n in metrics.failures.items()}

    def kv_nonzero(self, name: str) -> list[int]:
        """Per layer, how many values of the worker's KV cache are not zero."""
        caches = self._get(name, EngineLoop).engine.runner.kv_caches
        return [int(c.count_nonzero()) for c in caches]

    def wait_idle(self, name: str, within: float = 10.0) -> dict[str, int]:
        """Wait until the worker holds no request, block or transfer, then check its block
        manager; AssertionError names what is left. Returns the block counts."""
        worker = self._get(name, EngineLoop)
        engine = worker.engine

        def leftovers() -> dict[str, int]:  # on the loop thread: the engine is single-threaded
            left = {
                "requests": len(engine.scheduler.requests),
                "parked": len(engine.scheduler.parked),
                "used_blocks": engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks,
            }
            if isinstance(worker, DecodeWorker):
                left["reservations"] = len(worker.receiver)
            if isinstance(worker, PrefillWorker):
                left["transfers"] = len(worker.sender)
            return left

        last: dict[str, int] = {}

        def idle() -> bool:
            nonlocal last
            last = worker.call(leftovers).result(5)
            return not any(last.values())

        try:
            _wait_for(idle, within, "idle")
        except AssertionError as e:
            raise AssertionError(f"{name} still holds {last}") from e
        worker.call(engine.check_integrity).result(5)
        return {"free": engine.kv_cache.num_free_blocks, "blocks": engine.kv_cache.num_blocks}

    # -- bare endpoints over small caches ----------------------------------------------------

    def kv_receiver(self, name: str, layout: KVLayout, num_blocks: int, shm: bool = False) -> str:
        """A KVReceiver over zeroed caches (shared when `shm`); its endpoint."""
        cache = create_shared_cache(layout, num_blocks, DEVICE) if shm else None
        if cache is not None:
            kv_caches = cache.kv_caches
        else:
            shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.slot_dim)
            kv_caches = [
                torch.zeros(shape, dtype=layout.torch_dtype, device=DEVICE)
                for _ in range(layout.num_layers)
            ]
        shared = cache.locator if cache is not None else ""
        receiver = KVReceiver(kv_caches, "bare-model", shared_cache=shared)
        self.objects[name] = _Bare(receiver, kv_caches, cache)
        return receiver.endpoint

    def expect(
        self, name: str, requests: list[tuple[str, list[int], int]], timeout_s: float = 10.0
    ) -> list[bytes]:
        """Reserve (request, block ids, num tokens) each; their tickets."""
        receiver = self._get(name, _Bare).endpoint
        assert isinstance(receiver, KVReceiver)
        return [
            ticket_bytes(receiver.expect(rid, blocks, n, timeout_s)) for rid, blocks, n in requests
        ]

    def kv_sender(
        self,
        name: str,
        layout: KVLayout,
        num_blocks: int,
        seed: int,
        channel: str,
        fingerprint: str = "bare-model",
    ) -> None:
        """A KVSender over caches of random values (quantized ones with their scales)."""
        g = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        kv_caches = [
            encode(torch.randn(shape, generator=g), layout.torch_dtype).to(DEVICE)
            for _ in range(layout.num_layers)
        ]
        self.objects[name] = _Bare(KVSender(fingerprint, channel=channel), kv_caches)

    def send(self, name: str, tickets: list[bytes], block_ids: list[list[int]]) -> None:
        """Begin a transfer per ticket from the given source blocks, all layers ready at once;
        the first token is the request's index."""
        bare = self._get(name, _Bare)
        sender = bare.endpoint
        assert isinstance(sender, KVSender)
        transfers: list[OutboundTransfer] = []
        for data in tickets:
            transfers.append(sender.begin(ticket_of(data), bare.kv_caches))
        for i, (transfer, blocks) in enumerate(zip(transfers, block_ids, strict=True)):
            transfer.set_source(blocks)
            transfer.all_layers_ready()
            transfer.finish(i)

    def outcomes(self, name: str, count: int, within: float = 10.0) -> dict[str, Any]:
        """Wait until `count` transfers are final: request -> (state, failure cause or None,
        then the first token for a receiver's arrivals, the data plane for a sender's)."""
        bare = self._get(name, _Bare)
        results = bare.outcomes  # kept across calls: poll() reports each transfer once

        def collect() -> bool:
            if isinstance(bare.endpoint, KVReceiver):
                for a in bare.endpoint.poll():
                    cause = a.error.cause.value if a.error else None
                    results[a.request_key] = (a.state.value, cause, a.first_token)
            else:
                for t in bare.endpoint.poll():
                    cause = t.status.error.cause.value if t.status.error else None
                    results[t.ticket.request_key] = (t.status.state.value, cause, t.plane_name)
            return len(results) >= count

        _wait_for(collect, within, f"{count} transfers final")
        assert len(bare.endpoint) == 0, f"{name} still tracks {len(bare.endpoint)} transfers"
        bare.outcomes = {}
        return results

    def gather(self, name: str, tables: list[tuple[list[int], int]]) -> list[list[torch.Tensor]]:
        """Per (block ids, num tokens): its token-major KV, per layer."""
        kv_caches = self._get(name, _Bare).kv_caches
        return [gather_kv(kv_caches, blocks, n) for blocks, n in tables]


def unlink_shm(path: str) -> None:
    """Remove a killed decode worker's shared-memory cache (nobody else will; a CUDA cache
    went with its process)."""
    if path.startswith("/"):
        Path(path).unlink(missing_ok=True)
