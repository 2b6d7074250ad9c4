"""The router's request lifecycle, independent of the API that carried the request.

prepare      tokenize (chat template), validate -> Prepared      INVALID_ARGUMENT, NOT_FOUND
admit        a dispatch slot from a bounded queue                  RESOURCE_EXHAUSTED
pick         a decode worker D, and a prefill worker P unless the prompt is short
             (conditional disaggregation: D prefills it)           UNAVAILABLE
Decode(D)    D reserves blocks and answers with the KV ticket
Prefill(P)   in the background: P computes the prompt and pushes its KV to D. A P that fails
             is retried once on another P; then D prefills locally (`on_prefill_failure`)
relay        D's token chunks -> incremental detokenizer (stop strings) -> the client
end          usage and timings; a stop string, an Abort, a client that leaves, or the
             deadline cancels both calls, and the workers free the request's blocks
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from router.admission import Admission
from router.errors import ErrorKind, RouterError, invalid
from router.policies import PickContext, make_policy
from tandem import hub
from tandem.config import RouterConfig
from tandem.detokenizer import IncrementalDetokenizer
from tandem.messages import logprobs_from_proto, sampling_to_proto
from tandem.model_config import load_config
from tandem.outputs import TokenLogprobs
from tandem.registry import RegistrySnapshot, WorkerRecord
from tandem.sampling_params import SamplingParams, validate_prompt_token_ids
from tandem.tokenizer import load_tokenizer
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc

log = logging.getLogger(__name__)

MARK_DOWN_S = 5.0  # a worker that refused a connection is avoided this long


@dataclass
class Prepared:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float  # monotonic
    speculative: bool | None = None  # None: the decode worker's configuration
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class Delta:
    """One message to the client; the last one has `finish_reason` and `timings`."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: int | str | None = None
    timings: dict[str, Any] | None = None


class Router:
    def __init__(self, config: RouterConfig, snapshot: RegistrySnapshot) -> None:
        self.config = config
        self.snapshot = snapshot
        path = hub.resolve(config.model)
        self.tokenizer = load_tokenizer(path)
        cfg = load_config(path)
        self.vocab_size = cfg.vocab_size
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.eos_token_ids = cfg.eos_token_ids
        self.admission = Admission(config.max_inflight, config.max_queue)
        self.prefill_policy = make_policy(config.prefill_policy)
        self.decode_policy = make_policy(config.decode_policy)
        self.inflight: Counter[str] = Counter()
        self.local_prefills = 0
        self.prefill_retries = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._aborts: dict[str, asyncio.Event] = {}
        self._ids = itertools.count()

    @property
    def model_name(self) -> str:
        return self.config.model

    # -- prepare ------------------------------------------------------------------------------

    def prepare(
        self,
        params: SamplingParams,
        *,
        model: str = "",
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        request_id: str = "",
        priority: int = 0,
        timeout_s: float = 0.0,
        speculative: bool | None = None,
    ) -> Prepared:
        """Tokenize and validate; raises RouterError before any worker is involved."""
        if model and model != self.model_name:
            raise RouterError(
                ErrorKind.NOT_FOUND,
                f"model {model!r} is not served here; available: [{self.model_name!r}]",
                field="model",
            )
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise invalid("give exactly one of prompt, prompt token ids or messages", "prompt")
        if prompt is not None:
            tokens = self.tokenizer.encode(prompt)
        elif messages is not None:
            tokens = self._chat_tokens(messages)
        else:
            tokens = list(prompt_token_ids or [])
        if timeout_s < 0:
            raise invalid(f"timeout must be >= 0, got {timeout_s}", "timeout")
        prompt_field = "messages" if messages is not None else "prompt"
        try:
            params.validate(self.vocab_size)
            validate_prompt_token_ids(
                tokens, self.vocab_size, self.max_model_len, params.max_tokens
            )
        except ValueError as e:
            message = str(e)
            if message.startswith("prompt"):  # name the field the client actually sent
                message = prompt_field + message.removeprefix("prompt")
            raise invalid(message) from None
        timeout = min(timeout_s or self.config.timeout_s, self.config.timeout_s)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        deadline = time.monotonic() + timeout
        return Prepared(rid, tokens, params, priority, deadline, speculative=speculative)

    def _chat_tokens(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if not messages:
            raise invalid("messages must not be empty", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str) or m.get("role") not in (
                "system",
                "user",
                "assistant",
            ):
                raise invalid(
                    f"messages[{i}] needs a role (system, user, assistant) and string content",
                    "messages",
                )
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:  # e.g. a model without a chat template
            raise invalid(f"messages cannot be rendered for this model: {e}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generate -----------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()
        return event is not None

    async def generate(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Deltas until the request finishes; RouterError if it cannot be served."""
        if prep.request_id in self._aborts:
            raise invalid(f"request_id {prep.request_id!r} is already in flight", "request_id")
        abort = self._aborts[prep.request_id] = asyncio.Event()
        loop_deadline = asyncio.get_running_loop().time() + (prep.deadline - time.monotonic())
        try:
            async with asyncio.timeout_at(loop_deadline):
                async with self.admission.slot(prep.deadline - time.monotonic()):
                    async for delta in self._dispatch(prep, abort):
                        yield delta
        except TimeoutError:
            raise RouterError(ErrorKind.DEADLINE, "the request passed its deadline") from None
        finally:
            self._aborts.pop(prep.request_id, None)

    def _live(self, role: str) -> list[WorkerRecord]:
        return [
            w for w in self.snapshot.workers(model=self.model_name, role=role) if not w.draining
        ]

    async def _dispatch(self, prep: Prepared, abort: asyncio.Event) -> AsyncIterator[Delta]:
        dispatched = time.monotonic()
        decodes = self._live("decode")
        if not decodes:
            raise RouterError(ErrorKind.UNAVAILABLE, "no decode worker serves this model")
        ctx = PickContext(prep.prompt_token_ids, self.inflight)
        prefills = self._live("prefill")
        local = len(prep.prompt_token_ids) <= self.config.local_prefill_tokens or not prefills
        p = None if local else self.prefill_policy.pick(prefills, ctx)
        if p is not None:  # counted from the pick, so that a burst of requests spreads
            self.inflight[p.worker_id] += 1
        wreq = wpb.WorkerRequest(
            request_id=prep.request_id,
            prompt_token_ids=prep.prompt_token_ids,
            sampling=sampling_to_proto(prep.params),
            priority=prep.priority,
        )
        if prep.speculative is not None:
            wreq.speculative = prep.speculative
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prep.prompt_token_ids,
            prep.params.stop_strings,
            prep.params.skip_special_tokens,
        )
        try:
            d, call, ticket = await self._open_decode(decodes, ctx, wreq, local, prep)
        except BaseException:
            if p is not None:
                self.inflight[p.worker_id] -= 1
            raise
        timings: dict[str, Any] = {
            "queue_s": dispatched - prep.arrival,
            "decode_worker": d.worker_id,
            "prefill_worker": p.worker_id if p else "",
        }
        completion = 0
        first_token_time: float | None = None
        go_local = asyncio.Event()
        prefill_task: asyncio.Task[None] | None = None
        try:
            if p is not None:
                prefill_task = asyncio.create_task(
                    self._prefill(wreq, ticket, p, prep, timings, go_local)
                )
                # The pick's count on P ends with the task (even one cancelled before it ran).
                prefill_task.add_done_callback(functools.partial(self._release, p.worker_id))
            while True:
                msg = await _read_or(call, abort, go_local)
                if msg == "abort":
                    yield self._final(prep, [], "abort", completion, timings, first_token_time)
                    return
                if msg == "local":  # no prefill worker could push the KV: D computes it
                    if self.config.on_prefill_failure == "fail":
                        raise RouterError(ErrorKind.UNAVAILABLE, "no prefill worker could serve")
                    call.cancel()
                    self.local_prefills += 1
                    timings["prefill_worker"] = ""
                    call = self._decode_call(d, wreq, True, prep)
                    await self._read_ticket(call, d)
                    go_local = asyncio.Event()
                    continue
                if msg is grpc.aio.EOF:
                    raise RouterError(ErrorKind.UNAVAILABLE, "the decode worker ended the stream")
                assert isinstance(msg, wpb.DecodeResponse)
                chunk = msg.tokens
                if chunk.transfer_s:
                    timings["transfer_s"] = chunk.transfer_s
                tokens = list(chunk.token_ids)
                detok.add(tokens)
                completion += len(tokens)
                if first_token_time is None and tokens:
                    first_token_time = time.monotonic()
                reason = chunk.finish_reason or None
                stop_reason: int | str | None = None
                if detok.stop_string is not None:
                    reason, stop_reason = "stop", detok.stop_string
                elif reason == "stop" and tokens:
                    stop_reason = tokens[-1]
                text = detok.pop_text(reason is not None)
                logprobs = [logprobs_from_proto(lp) for lp in chunk.logprobs]
                if reason is None:
                    yield Delta(tokens, text, logprobs)
                    continue
                timings["draft_tokens"] = chunk.draft_tokens
                timings["accepted_tokens"] = chunk.accepted_tokens
                delta = self._final(prep, tokens, reason, completion, timings, first_token_time)
                delta.text, delta.logprobs, delta.stop_reason = text, logprobs, stop_reason
                yield delta
                return
        except grpc.aio.AioRpcError as e:
            raise self._worker_error(e, d) from None
        finally:
            call.cancel()  # no-op when finished; otherwise D aborts and frees the blocks
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()
            elif prefill_task is None and p is not None:
                self.inflight[p.worker_id] -= 1
            self.inflight[d.worker_id] -= 1

    def _final(
        self,
        prep: Prepared,
        tokens: list[int],
        reason: str,
        completion: int,
        timings: dict[str, Any],
        first_token_time: float | None,
    ) -> Delta:
        now = time.monotonic()
        ttft = (first_token_time or now) - prep.arrival
        timings.update(
            ttft_s=ttft,
            e2e_s=now - prep.arrival,
            tpot_s=(now - prep.arrival - ttft) / (completion - 1) if completion > 1 else 0.0,
        )
        return Delta(
            tokens, "", [], reason, len(prep.prompt_token_ids), completion, timings=timings
        )

    async def _open_decode(
        self,
        decodes: list[WorkerRecord],
        ctx: PickContext,
        wreq: wpb.WorkerRequest,
        local: bool,
        prep: Prepared,
    ) -> tuple[WorkerRecord, Any, Any]:
        """Open Decode on a picked worker and read its ticket. A worker that is unreachable or
        draining (UNAVAILABLE before any token) is skipped once, for another one."""
        tried: set[str] = set()
        while True:
            d = self.decode_policy.pick([w for w in decodes if w.worker_id not in tried], ctx)
            self.inflight[d.worker_id] += 1  # from the pick, so that a burst of requests spreads
            call = self._decode_call(d, wreq, local, prep)
            try:
                return d, call, await self._read_ticket(call, d)
            except BaseException as e:
                self.inflight[d.worker_id] -= 1
                call.cancel()  # also when the client left while waiting: D frees the blocks
                if not isinstance(e, grpc.aio.AioRpcError):
                    raise
                tried.add(d.worker_id)
                retry = len(tried) < 2 and any(w.worker_id not in tried for w in decodes)
                if e.code() != grpc.StatusCode.UNAVAILABLE or not retry:
                    raise self._worker_error(e, d) from None
                self.snapshot.mark_down(d.worker_id, MARK_DOWN_S)

    def _decode_call(
        self, d: WorkerRecord, wreq: wpb.WorkerRequest, local: bool, prep: Prepared
    ) -> Any:
        stub = wpb_grpc.DecodeWorkerStub(self._channel(d.endpoint))
        timeout = max(prep.deadline - time.monotonic(), 0.001)
        return stub.Decode(wpb.DecodeRequest(request=wreq, local_prefill=local), timeout=timeout)

    async def _read_ticket(self, call: Any, d: WorkerRecord) -> Any:
        first = await call.read()
        if first is grpc.aio.EOF or not first.HasField("ticket"):
            raise RouterError(ErrorKind.UNAVAILABLE, f"decode worker {d.worker_id} sent no ticket")
        return first.ticket

    async def _prefill(
        self,
        wreq: wpb.WorkerRequest,
        ticket: Any,
        first: WorkerRecord,
        prep: Prepared,
        timings: dict[str, Any],
        go_local: asyncio.Event,
    ) -> None:
        """Run the prefill on `first`; on failure try one other prefill worker, then ask the
        decode side to prefill locally (per `on_prefill_failure`)."""
        policy = self.config.on_prefill_failure
        tried = {first.worker_id}
        p: WorkerRecord | None = first
        while p is not None:
            timings["prefill_worker"] = p.worker_id
            retry = p is not first  # the first one is counted from the pick (_dispatch)
            if retry:
                self.inflight[p.worker_id] += 1
            try:
                stub = wpb_grpc.PrefillWorkerStub(self._channel(p.endpoint))
                timeout = max(prep.deadline - time.monotonic(), 0.001)
                reply = await stub.Prefill(
                    wpb.PrefillRequest(request=wreq, ticket=ticket), timeout=timeout
                )
                timings["prefill_s"] = reply.prefill_s
                timings["data_plane"] = reply.data_plane
                return
            except grpc.aio.AioRpcError as e:
                log.warning("prefill of %s on %s failed: %s", wreq.request_id, p.worker_id, e)
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.snapshot.mark_down(p.worker_id, MARK_DOWN_S)
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED):
                    return  # D's reservation has ended (it prefills locally, or was aborted)
            finally:
                if retry:
                    self.inflight[p.worker_id] -= 1
            others = [w for w in self._live("prefill") if w.worker_id not in tried]
            p = None
            if policy == "retry" and others and len(tried) < 2:
                p = self.prefill_policy.pick(
                    others, PickContext(wreq.prompt_token_ids, self.inflight)
                )
                tried.add(p.worker_id)
                self.prefill_retries += 1
        go_local.set()  # the relay loop prefills on D, or fails under `fail`

    def _release(self, worker_id: str, _task: object = None) -> None:
        self.inflight[worker_id] -= 1

    def _worker_error(self, e: grpc.aio.AioRpcError, d: WorkerRecord) -> RouterError:
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return invalid(e.details() or "invalid request")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return RouterError(ErrorKind.OVERLOADED, e.details() or "", retry_after_s=1.0)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RouterError(ErrorKind.DEADLINE, "the request passed its deadline")
        if code == grpc.StatusCode.UNAVAILABLE:
            self.snapshot.mark_down(d.worker_id, MARK_DOWN_S)
        return RouterError(
            ErrorKind.UNAVAILABLE, f"decode worker {d.worker_id} failed: {code.name} {e.details()}"
        )

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = grpc.aio.insecure_channel(endpoint)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def _read_or(call: Any, abort: asyncio.Event, go_local: asyncio.Event) -> Any:
    """The call's next message, or "abort" / "local" if that event comes first."""
    read = asyncio.ensure_future(call.read())
    waits = {
        asyncio.ensure_future(abort.wait()): "abort",
        asyncio.ensure_future(go_local.wait()): "local",
    }
    done, _ = await asyncio.wait([read, *waits], return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if read in done:
        return read.result()
    read.cancel()
    return next(name for w, name in waits.items() if w in done)
