"""Fixtures of the transfer tests: a prefill-side and a decode-side process for the whole session
(spawning one costs seconds of imports), each emptied after every test, and fresh processes for
the tests that kill one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from harness import DEVICE, WorkerProcess


@pytest.fixture(autouse=True)
def _pair_needs_two_gpus(request: pytest.FixtureRequest) -> None:
    """On CUDA the pair plane is NCCL, which cannot put both ranks on one GPU."""
    params = getattr(request.node, "callspec", None)
    channel = params.params.get("channel") if params is not None else None
    if DEVICE.type == "cuda" and channel == "pair" and torch.cuda.device_count() < 2:
        pytest.skip("an NCCL pair needs two GPUs")


@pytest.fixture(scope="session")
def _long_lived() -> Iterator[dict[str, WorkerProcess]]:
    procs: dict[str, WorkerProcess] = {}
    yield procs
    for proc in procs.values():
        proc.close()


def _lend(procs: dict[str, WorkerProcess], role: str) -> Iterator[WorkerProcess]:
    proc = procs.get(role)
    if proc is None or not proc.process.is_alive():  # a failed test may have killed it
        proc = procs[role] = WorkerProcess(role)
    yield proc
    proc.resume()  # a sender still paused would hold its worker's close
    if proc.process.is_alive():
        proc.call("close_all", timeout=20.0)


@pytest.fixture
def prefill_proc(_long_lived: dict[str, WorkerProcess]) -> Iterator[WorkerProcess]:
    """The prefill side: PrefillWorkers and bare KVSenders."""
    yield from _lend(_long_lived, "prefill")


@pytest.fixture
def decode_proc(_long_lived: dict[str, WorkerProcess]) -> Iterator[WorkerProcess]:
    """The decode side: DecodeWorkers and bare KVReceivers."""
    yield from _lend(_long_lived, "decode")


@pytest.fixture
def spawn() -> Iterator[Callable[[str], WorkerProcess]]:
    """Fresh processes, for a test that kills one; all are gone after the test."""
    made: list[WorkerProcess] = []

    def make(name: str) -> WorkerProcess:
        made.append(WorkerProcess(name))
        return made[-1]

    yield make
    for proc in made:
        proc.kill()
