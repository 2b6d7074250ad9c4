"""KV transfer between workers of different tensor-parallel sizes, and a TP worker's liveness.

Each prefill rank sends its own heads and each decode rank receives its own, one stream per rank
pair that share heads (docs/kv_transfer.md). SmolLM2-135M (3 KV heads): P TP 3 -> D TP 1
(fan-in), P TP 1 -> D TP 3 (fan-out) on the gRPC, shared-memory and pair planes, and P TP 3 -> D
TP 3 rank to rank with the plane left to choose ("auto": shm, the same host), give the colocated
TP 1 engine's greedy tokens (float32), and the ranks' byte counters show every rank moved its
own heads. Another model's layout is refused by decode rank 0 before any rank receives a byte,
failing both sides with a typed error and leaving no block held. The workers run in this process
(their other ranks are processes), so a test reads rank 0's block bookkeeping directly; the
other ranks keep none, and `check_integrity()` checks them against it.

The tiny model (4 heads, 2 KV heads) at P TP 2 -> D TP 4 and P TP 4 -> D TP 2 on every plane:
at TP 4 each KV head lives on two ranks (replicated: sent once, received by both), and the
output is still the TP 1 engine's.

A decode worker at TP 2 (tiny model) whose rank 1 is killed mid-decode: the request ends with an
error, the worker leaves the registry within its TTL and reports itself lost. A stream cut by
killing rank 1 on either side mid-transfer fails the transfer on both.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from decode_worker.decode_core import DecodeWorker, OutputStream
from kv_transfer.state import FailureCause, TransferError
from kv_transfer.ticket import KVTicket
from prefill_worker.prefill_core import PrefillResult, PrefillWorker
from prefill_worker.rank_senders import RankTransfer
from tandem.cluster.workers import build_worker
from tandem.config import FAULT_KV_TRAILER_DELAY, EngineConfig, TransferConfig, WorkerConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import TPExecutor
from tandem.engine.tp.ranks import TensorParallelError
from tandem.registry import Registry
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = dict(num_blocks=16, block_size=16, num_threads=1, dtype="float32")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = torch.randint(100, 40000, (37,), generator=torch.Generator().manual_seed(0)).tolist()
WAIT_S = 30.0


def _config(model: Path, tp: int) -> EngineConfig:
    return EngineConfig.create(str(model), tensor_parallel_size=tp, **OPTIONS)


def _colocated(model: Path, prompt: list[int]) -> list[int]:
    """The colocated TP 1 engine's greedy tokens."""
    engine = EngineCore(_config(model, 1))
    engine.add_request("r", prompt, GREEDY)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for d in engine.step() for t in d.new_token_ids]
    engine.close()
    return tokens


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> list[int]:
    return _colocated(smollm2_path, PROMPT)


@pytest.fixture(scope="module")
def workers(smollm2_path: Path) -> Iterator[dict[str, PrefillWorker | DecodeWorker]]:
    """P1, P3, D1, D3 by name; the prefill workers pick the plane each test asks for. Built at
    once: their ranks load side by side."""
    fail = TransferConfig(on_failure="fail")
    builders: dict[str, Callable[[], PrefillWorker | DecodeWorker]] = {}
    for tp in (3, 1):
        builders[f"P{tp}"] = functools.partial(PrefillWorker, _config(smollm2_path, tp))
        builders[f"D{tp}"] = functools.partial(
            DecodeWorker, _config(smollm2_path, tp), transfer=fail
        )
    with ThreadPoolExecutor(len(builders)) as pool:
        futures = {name: pool.submit(build) for name, build in builders.items()}
        made = {name: future.result() for name, future in futures.items()}
    for worker in made.values():
        worker.start()
    yield made
    for worker in made.values():
        worker.close()
        worker.engine.close()


def _transfer(
    prefill: PrefillWorker, decode: DecodeWorker, rid: str, channel: str, prompt: list[int]
) -> tuple[OutputStream, PrefillResult | Exception]:
    """One request through `decode` and `prefill` on `channel`; the prefill side's outcome."""
    prefill.sender.channel = channel
    ticket_future, stream = decode.reserve(rid, prompt, GREEDY)
    ticket = ticket_future.result(WAIT_S)
    assert isinstance(ticket, KVTicket)
    tp = decode.engine.config.model.tensor_parallel_size
    assert len(ticket.decode_ranks()) == tp
    result = prefill.submit(rid, prompt, GREEDY, ticket)
    try:
        return stream, result.result(WAIT_S)
    except Exception as e:
        return stream, e


def _no_block_held(*ws: PrefillWorker | DecodeWorker) -> None:
    for worker in ws:
        kv = worker.engine.kv_cache
        deadline = time.monotonic() + WAIT_S
        while kv.num_free_blocks != kv.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop frees a finished request's blocks between steps
        worker.call(worker.engine.check_integrity).result(WAIT_S)  # every rank
        assert kv.num_free_blocks == kv.num_blocks


def _rank_bytes(prefill: PrefillWorker, decode: DecodeWorker) -> tuple[list[int], list[int]]:
    """Bytes each prefill rank sent and each decode rank received so far (per-rank transfer)."""
    return list(prefill.outbound.rank_bytes), list(decode.receiver.rank_bytes)


def _every_rank_moved(
    before: tuple[list[int], list[int]], prefill: PrefillWorker, decode: DecodeWorker
) -> None:
    """Each decode rank received bytes of its own, and each prefill rank that holds a head no
    lower rank holds sent some: the ranks, not rank 0, moved them."""
    sent, received = _rank_bytes(prefill, decode)
    assert all(now > then for now, then in zip(received, before[1], strict=True)), received
    heads = [range(0, 0)] + [prefill.outbound.prefill_heads[r] for r in range(len(sent))]
    senders = [r for r in range(len(sent)) if heads[r + 1].start >= heads[r].stop]
    assert all(sent[r] > before[0][r] for r in senders), sent


@pytest.mark.parametrize(
    ("sides", "channel"),
    [
        (("P3", "D1"), "grpc"),
        (("P1", "D3"), "grpc"),
        (("P3", "D1"), "shm"),
        (("P1", "D3"), "shm"),
        (("P3", "D1"), "pair"),
        (("P1", "D3"), "pair"),
        (("P3", "D3"), "auto"),  # shm: the same host
    ],
)
def test_greedy_tokens_across_tp_sizes(
    workers: dict[str, PrefillWorker | DecodeWorker],
    reference: list[int],
    sides: tuple[str, str],
    channel: str,
) -> None:
    """Each prefill rank sends its heads, each decode rank receives its own (fan-in into D TP
    1, fan-out from P TP 1, rank to rank at equal sizes), on every plane."""
    prefill, decode = workers[sides[0]], workers[sides[1]]
    assert isinstance(prefill, PrefillWorker) and isinstance(decode, DecodeWorker)
    before = _rank_bytes(prefill, decode)
    stream, outcome = _transfer(prefill, decode, f"{'-'.join(sides)}-{channel}", channel, PROMPT)
    assert isinstance(outcome, PrefillResult), outcome
    assert outcome.data_plane == (channel if channel != "auto" else "shm")
    assert stream.tokens() == reference
    _every_rank_moved(before, prefill, decode)
    _no_block_held(prefill, decode)


@pytest.mark.parametrize("channel", ["grpc", "shm"])
def test_unconvertible_layout_fails_both_sides(
    workers: dict[str, PrefillWorker | DecodeWorker], tiny_llama_path: Path, channel: str
) -> None:
    """The tiny model's 2 KV heads and 2 layers into SmolLM2's at TP 3 (on shm, into decode
    rank 0's cache, opened before the header is refused: nothing is written): decode rank 0
    refuses the header and no rank receives a byte."""
    decode = workers["D3"]
    assert isinstance(decode, DecodeWorker)
    received = list(decode.receiver.rank_bytes)
    prefill = PrefillWorker(EngineConfig.create(str(tiny_llama_path), **OPTIONS))
    prefill.start()
    try:
        rid = f"bad-layout-{channel}"
        stream, error = _transfer(prefill, decode, rid, channel, list(range(5, 40)))
        assert isinstance(error, TransferError) and error.cause == FailureCause.BAD_METADATA
        with pytest.raises(TransferError) as decode_error:
            stream.tokens()
        assert decode_error.value.cause == FailureCause.BAD_METADATA
        assert decode.receiver.rank_bytes == received
        _no_block_held(prefill, decode)
    finally:
        prefill.close()
        prefill.engine.close()


@pytest.mark.parametrize("sides", [(2, 4), (4, 2)])
def test_replicated_kv_heads_across_tp_sizes(tiny_llama_path: Path, sides: tuple[int, int]) -> None:
    """Every plane between one pair of workers: every decode rank receives its head (a
    replicated one from the prefill rank that sends it), each head sent once."""
    prompt = list(range(5, 42))
    fail = TransferConfig(on_failure="fail")
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(PrefillWorker, _config(tiny_llama_path, sides[0]), transfer=fail)
        d = pool.submit(DecodeWorker, _config(tiny_llama_path, sides[1]), transfer=fail)
        prefill, decode = p.result(), d.result()
    try:
        prefill.start()
        decode.start()
        reference = _colocated(tiny_llama_path, prompt)
        for channel in ("grpc", "pair", "shm"):
            before = _rank_bytes(prefill, decode)
            stream, outcome = _transfer(prefill, decode, f"tiny-{sides}-{channel}", channel, prompt)
            assert isinstance(outcome, PrefillResult), outcome
            assert outcome.data_plane == channel
            assert stream.tokens() == reference
            _every_rank_moved(before, prefill, decode)
            _no_block_held(prefill, decode)
    finally:
        for worker in (prefill, decode):
            worker.close()
            worker.engine.close()


def test_killed_rank_takes_the_worker_out(tiny_llama_path: Path) -> None:
    # the test's own reads wait out a stalled machine (a 1 s read once timed out here under
    # load, two pytest processes on two cores); the worker's timeouts stay the default
    registry = Registry(timeout_s=5.0)
    ttl = 3.0
    config = EngineConfig.create(
        str(tiny_llama_path), tensor_parallel_size=2, tp_timeout_s=ttl / 2, **OPTIONS
    )
    server = build_worker(
        "decode", WorkerConfig(config, registry_url=registry.url, heartbeat_ttl_s=ttl)
    )
    try:
        assert [w.worker_id for w in registry.workers()] == [server.worker_id]
        worker = server.worker
        assert isinstance(worker, DecodeWorker)
        params = SamplingParams(max_tokens=240, ignore_eos=True)  # 16 blocks of 16 tokens
        ticket, stream = worker.reserve("r", [5, 6, 7], params, local=True)
        assert ticket.result(WAIT_S) is None
        chunks = iter(stream)
        next(chunks)  # decoding
        executor = worker.engine.executor
        assert isinstance(executor, TPExecutor)
        executor.ranks.handles[0].kill()
        killed = time.monotonic()
        ended = threading.Event()
        errors: list[BaseException] = []

        def read() -> None:
            try:
                list(chunks)
            except BaseException as e:
                errors.append(e)
            ended.set()

        threading.Thread(target=read, daemon=True).start()
        assert ended.wait(WAIT_S), "the request hangs"
        assert errors and isinstance(errors[0], TensorParallelError), errors
        while registry.workers() and time.monotonic() - killed < ttl:
            time.sleep(0.05)
        assert registry.workers() == [], f"still registered {ttl} s after the kill"
        assert server.lost.wait(ttl)
    finally:
        server.stop()
        server.worker.engine.close()
        registry.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_rank_stream_lost_fails_the_transfer(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    """P TP 2 -> D TP 2, rank 1's stream cut mid-transfer (the trailer held back, the
    rank's process killed): the whole transfer fails on both sides with a typed error, and the
    side whose rank lives holds no block on any rank."""
    monkeypatch.setenv(FAULT_KV_TRAILER_DELAY, "3")
    fail = TransferConfig(on_failure="fail")
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(PrefillWorker, _config(tiny_llama_path, 2), transfer=fail)
        d = pool.submit(DecodeWorker, _config(tiny_llama_path, 2), transfer=fail)
        prefill, decode = p.result(), d.result()
    try:
        prefill.start()
        decode.start()
        prompt = list(range(5, 42))
        ticket_future, stream = decode.reserve("cut", prompt, GREEDY)
        ticket = ticket_future.result(WAIT_S)
        assert isinstance(ticket, KVTicket)
        result = prefill.submit("cut", prompt, GREEDY, ticket)
        deadline = time.monotonic() + WAIT_S
        transfer = prefill.call(lambda: prefill._transfers["cut"]).result(WAIT_S)
        assert isinstance(transfer, RankTransfer)
        while not transfer.local[0].nbytes:  # rank 0's layers are out
            assert time.monotonic() < deadline, "no layer went out"
            time.sleep(0.01)
        time.sleep(0.3)  # rank 1's too; the trailer is held back: every stream is open
        victim = prefill if side == "prefill" else decode
        executor = victim.engine.executor
        assert isinstance(executor, TPExecutor)
        executor.ranks.handles[0].kill()
        with pytest.raises(Exception) as decode_error:  # either kind: it must not hang
            stream.tokens()
        if side == "prefill":  # the decode worker lives: its rank 1's stream broke
            assert isinstance(decode_error.value, TransferError), decode_error.value
            assert decode_error.value.cause == FailureCause.PEER_LOST
            _no_block_held(decode)
        else:  # the prefill worker lives: its rank 1's stream into the dead rank broke
            error = result.exception(WAIT_S)
            assert isinstance(error, TransferError), error
            assert error.cause == FailureCause.PEER_LOST
            _no_block_held(prefill)
    finally:
        for worker in (prefill, decode):
            worker.close()
            worker.engine.close()
