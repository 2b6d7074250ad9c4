"""A worker call that ended before its handler ran leaves nothing behind. gRPC runs a handler for
a call that arrived even when the call ended meanwhile (its client cancelled it while the
worker's process was stopped, say), and then registers no termination callback: the decode
worker must free the request it would park waiting for a KV transfer that never comes (it held
its blocks until the ticket's timeout, seen after a SIGSTOP/SIGCONT in tests/chaos), the prefill
worker must abort the prefill and its transfer.

Real servicers over real workers on the tiny model, in this process; `EndedCall` is the test
double of the ended call's context, since gRPC's cannot be made to end between a call's arrival
and its handler on cue (tests/chaos stops a whole worker process instead).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import grpc
import pytest
from harness import engine_config, greedy

from decode_worker.decode_core import DecodeWorker
from decode_worker.decode_servicer import DecodeServicer
from prefill_worker.prefill_core import PrefillWorker
from prefill_worker.prefill_servicer import PrefillServicer
from tandem.engine.loop import EngineLoop
from tandem.messages import sampling_to_proto
from tandem.v1 import worker_pb2 as wpb

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]

PROMPT = list(range(3, 43))


class Aborted(Exception):
    """What `EndedCall.abort` raises, as gRPC's context raises to end the handler."""


class EndedCall:
    """The context of a call that ended before its handler ran: it registers no callback."""

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(f"{code.name}: {details}")


def worker_request(rid: str) -> wpb.WorkerRequest:
    return wpb.WorkerRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_proto(greedy(8))
    )


def wait_idle(worker: EngineLoop, within: float = 10.0) -> None:
    """Until the worker holds no request and no block."""
    engine = worker.engine

    def left() -> dict[str, int]:
        return {
            "requests": len(engine.scheduler.requests),
            "used_blocks": engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks,
        }

    deadline = time.monotonic() + within
    while any((last := worker.call(left).result(5)).values()):
        assert time.monotonic() < deadline, f"the worker still holds {last}"
        time.sleep(0.02)


@pytest.fixture
def decode(tiny_llama_path: Path) -> Iterator[DecodeWorker]:
    worker = DecodeWorker(engine_config(str(tiny_llama_path)))
    worker.start()
    yield worker
    worker.close()


def test_a_decode_call_that_ended_before_its_handler_frees_its_request(
    decode: DecodeWorker,
) -> None:
    servicer = DecodeServicer(decode, "tiny")
    responses = servicer.Decode(wpb.DecodeRequest(request=worker_request("r")), EndedCall())
    assert isinstance(responses, Generator)
    next(responses, None)  # gRPC's one attempt to send on an ended call
    responses.close()
    wait_idle(decode, within=5.0)  # well before the ticket's timeout
    assert len(decode.receiver) == 0


def test_a_prefill_call_that_ended_before_its_handler_aborts_its_transfer(
    tiny_llama_path: Path, decode: DecodeWorker
) -> None:
    """The ticket is a real decode worker's: the transfer ends failed on both sides, at once."""
    prefill = PrefillWorker(engine_config(str(tiny_llama_path)))
    prefill.start()
    try:
        ticket_future, _ = decode.reserve("r", PROMPT, greedy(8))
        ticket = ticket_future.result(5)
        assert ticket is not None
        request = wpb.PrefillRequest(request=worker_request("r"), ticket=ticket.to_proto())
        with pytest.raises(Aborted, match="CANCELLED"):
            PrefillServicer(prefill, "tiny").Prefill(request, EndedCall())
        wait_idle(prefill, within=5.0)
        assert len(prefill.sender) == 0
        decode.cancel("r")  # as the router does once its prefill failed for good
        wait_idle(decode, within=5.0)
    finally:
        prefill.close()
