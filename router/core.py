"""The router's request lifecycle, independent of the API that carried the request.

prepare      tokenize (chat template), validate -> Prepared      INVALID_ARGUMENT, NOT_FOUND
admit        a dispatch slot from a bounded queue                  RESOURCE_EXHAUSTED
pick         a decode worker D, and a prefill worker P unless the prompt is short
             (conditional disaggregation: D prefills it). With no D serving, wait for a
             replacement up to `decode_wait_s`                     UNAVAILABLE
             (at most `max_decode_waiters` wait)                   RESOURCE_EXHAUSTED
             Each pick is a lease (`inflight.py`): the request counts on the worker
             from the pick until the `Route` ends
Decode(D)    D reserves blocks and answers with the KV ticket
Prefill(P)   in the background: P computes the prompt and pushes its KV to D. A P that fails
             is retried once on another P; then D prefills locally (`on_prefill_failure`),
             unless D already streams (it computed the prompt itself when the transfer
             failed on its side). A queue on P does not fail the transfer: P renews it
             while the request waits there, up to the request's deadline
relay        D's token chunks -> incremental detokenizer (stop strings) -> the client
migrate      D dies mid-stream (UNAVAILABLE, or the stream ends without a final chunk) or
             stalls (`_check_live`: the registry has not listed it for UNLISTED_S, its
             heartbeats having stopped, or it has sent the request tokens and then nothing
             on any stream for `decode_stall_s`; its call is cancelled, so a D that wakes
             up frees the blocks): D is marked down and the request resumes on another D
             with the tokens already sent appended to its prompt (`_resumed`), prefilled
             as any request; the relay carries on, so the client sees one stream (waiting,
             as a new request does, for a replacement when no D is left). At most
             MAX_MIGRATIONS times, else
                                                                   UNAVAILABLE
end          usage and timings; a stop string, an Abort, a client that leaves, or the
             deadline (the router's own timer, whatever the workers do: DEADLINE_EXCEEDED)
             cancels both calls, and the workers free the request's blocks. An
             Abort that reaches a router replica not holding the request is forwarded to
             the others (`forward_abort`: the registry's pub/sub)

n > 1 choices (OpenAI's n) travel as one request: one admission slot, one route, one prefill
and one KV transfer; D forks the choices over the prompt's blocks and tags each chunk with its
choice's index, and each choice has its own relay. A stop string ends its choice alone (an Abort
of the choice's id on D); a D that dies mid-stream leaves each open choice to resume on its own,
as a request of its own (`choice_prep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from router.admission import Admission
from router.errors import ErrorKind, RouterError, invalid
from router.inflight import Lease, pick
from router.merge import merged
from router.policies import PickContext, make_policy
from router.relay import Delta, Relay
from router.tools import hermes_messages, parser_for_template
from tandem import hub
from tandem.config import RouterConfig
from tandem.messages import sampling_to_proto
from tandem.model_config import load_config
from tandem.registry import RegistrySnapshot, WorkerRecord
from tandem.sampling_params import SamplingParams, choice_request_id, validate_prompt_token_ids
from tandem.tokenizer import load_tokenizer
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc

log = logging.getLogger(__name__)

LOCAL_PREFILL_SUFFIX = "/local"  # the worker-side id of a request D prefills itself
MARK_DOWN_S = 5.0  # a worker that refused a connection is avoided this long
MAX_MIGRATIONS = 2  # a request resumes on another decode worker at most this often
MIGRATED_SUFFIX = "/m"  # + the count: the worker-side id of a resumed request
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
DECODE_POLL_S = 0.1  # how often a request waiting for a decode worker looks again
CHOICE_ABORT_S = 5.0  # the timeout of the Abort that ends one choice on its decode worker
STALL_CHECK_S = 0.5  # how often a request waiting on its decode worker checks that D lives
UNLISTED_S = 2.0  # a decode worker missing from the registry this long past one of its
# heartbeat intervals is treated as dead (a Redis that restarted empty lists each worker again
# at its next heartbeat)


class DecodeLost(Exception):
    """The decode worker serving a request died after its ticket: the request may resume."""

    def __init__(self, worker: WorkerRecord, reason: str) -> None:
        super().__init__(f"decode worker {worker.worker_id} failed: {reason}")
        self.worker = worker


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How chat messages are rendered: the generation prompt after them (off: the model
    continues the conversation as it stands), the final assistant message continued rather than
    closed, the tools offered (`tools.py`), and variables for the template itself."""

    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None


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
class Route:
    """Where one request runs, from the picks to its end: the lease on D and D's open Decode
    call, and the lease on P unless D prefills. Leaving its `with` block ends it: the call is
    cancelled (a no-op once finished; otherwise D aborts and frees the blocks), the prefill task
    too (its end releases P's lease), and D's lease is released."""

    decode: Lease
    call: Any  # D's Decode stream; reopened when D prefills after all
    ticket: Any
    prefill: Lease | None
    request_id: str  # the request's id on D (another when D prefills after all)
    go_local: asyncio.Event = field(default_factory=asyncio.Event)  # no P could push the KV
    decoding: bool = False  # D has sent a token: it holds the prompt's KV, however it got there
    _prefill_task: asyncio.Task[None] | None = field(default=None, init=False)
    _read: asyncio.Future[Any] | None = field(default=None, init=False)  # D's pending read

    def start_prefill(self, prefill: Coroutine[Any, Any, None]) -> None:
        """Run the prefill in the background; P's lease ends with the task (also with one
        cancelled before it ran)."""
        assert self.prefill is not None
        self._prefill_task = asyncio.create_task(prefill)
        self._prefill_task.add_done_callback(self.prefill.release)

    async def next_message(self, abort: asyncio.Event) -> Any:
        """D's next message, or "abort" / "local" if that event comes first, or "check" after
        STALL_CHECK_S without any. A read that loses the race stays pending for the next call:
        a cancelled read breaks a grpc.aio stream."""
        if self._read is None:
            self._read = asyncio.ensure_future(self.call.read())
        waits = {
            asyncio.ensure_future(abort.wait()): "abort",
            asyncio.ensure_future(self.go_local.wait()): "local",
        }
        try:
            done, _ = await asyncio.wait(
                [self._read, *waits], timeout=STALL_CHECK_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:  # also when the request's task is cancelled (a client that left, n choices)
            for w in waits:
                w.cancel()
        if self._read in done:
            read, self._read = self._read, None
            return read.result()
        return next((name for w, name in waits.items() if w in done), "check")

    def reopen(self, call: Any, request_id: str) -> None:
        """Replace D's call (cancelled, with its pending read) by `call`, for `request_id`."""
        self._end_call()
        self.call, self.request_id = call, request_id

    def _end_call(self) -> None:
        self.call.cancel()
        if self._read is not None:
            self._read.cancel()
            self._read = None

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._end_call()
        if self._prefill_task is not None:
            self._prefill_task.cancel()  # a no-op when it has ended
        elif self.prefill is not None:
            self.prefill.release()
        self.decode.release()


class Router:
    def __init__(
        self,
        config: RouterConfig,
        snapshot: RegistrySnapshot,
        forward_abort: Callable[[str], int] | None = None,
    ) -> None:
        self.config = config
        self.snapshot = snapshot
        # Asks the other router replicas to abort a request: how many replicas listen (this
        # one included), 0 when that could not be sent.
        self.forward_abort = forward_abort
        path = hub.resolve(config.model)
        self.tokenizer = load_tokenizer(path)
        self.tool_parser = parser_for_template(
            config.tool_call_parser, self.tokenizer.chat_template
        )
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
        self.migrations = 0
        self.decode_waiters = 0  # requests waiting for a decode worker now
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._aborts: dict[str, asyncio.Event] = {}
        self._choice_aborts: set[asyncio.Task[None]] = set()  # Aborts of one choice on D
        self._heard: dict[str, float] = {}  # decode worker id -> its last message (monotonic)
        self._ids = itertools.count()

    @property
    def model_name(self) -> str:
        return self.config.model

    # -- prepare ------------------------------------------------------------------------------

    async def prepare(
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
        chat_template: ChatTemplateOptions = ChatTemplateOptions(),
    ) -> Prepared:
        """Tokenize and validate; raises RouterError before any worker is involved. A text
        prompt is encoded on a worker thread (the tokenizer lets go of the GIL meanwhile): a
        long one, seconds for megabytes, holds up none of the requests this loop relays."""
        self._check_model(model)
        args = (prompt, prompt_token_ids, messages, chat_template)
        if prompt is None and messages is None:  # token ids: nothing to encode
            tokens = self._prompt_tokens(*args)
        else:
            tokens = await asyncio.to_thread(self._prompt_tokens, *args)
        if not timeout_s >= 0:  # NaN too
            raise invalid(f"timeout must be >= 0, got {timeout_s}", "timeout")
        # Unset max_tokens: the rest of the context. The engine resolves it against its own
        # context and KV cache (tandem/engine/engine_core.py), unless this router caps the
        # context below the model's (a limit the workers do not know).
        checked = params.resolved_for(len(tokens), self.max_model_len)
        if self.config.max_model_len:
            params = checked
        self._validate(tokens, checked, "messages" if messages is not None else "prompt")
        timeout = min(timeout_s or self.config.timeout_s, self.config.timeout_s)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        deadline = time.monotonic() + timeout
        return Prepared(rid, tokens, params, priority, deadline, speculative=speculative)

    def _check_model(self, model: str) -> None:
        """NOT_FOUND unless `model` is this router's (or empty: the one it serves)."""
        if model and model != self.model_name:
            raise RouterError(
                ErrorKind.NOT_FOUND,
                f"model {model!r} is not served here; available: [{self.model_name!r}]",
                field="model",
            )

    async def tokenize(
        self,
        *,
        model: str = "",
        prompt: str | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        chat_template: ChatTemplateOptions = ChatTemplateOptions(),
    ) -> list[int]:
        """The token ids `prepare` would send for this prompt or conversation (/tokenize),
        encoded on a worker thread, and refused unencoded when too long, as there."""
        self._check_model(model)
        if messages is not None and prompt is None:
            return await asyncio.to_thread(self._chat_tokens, messages, chat_template)
        if prompt is not None and messages is None:
            return await asyncio.to_thread(self._encode, prompt, "prompt")
        raise invalid("give exactly one of prompt or messages", "prompt")

    def detokenize(self, token_ids: Sequence[int], *, model: str = "") -> str:
        """The text of `token_ids` (/detokenize); INVALID_ARGUMENT names an id out of range."""
        self._check_model(model)
        for i, t in enumerate(token_ids):
            if not 0 <= t < self.vocab_size:
                raise invalid(f"tokens[{i}] must be in [0, {self.vocab_size}), got {t}", "tokens")
        return str(self.tokenizer.decode(token_ids))

    def _prompt_tokens(
        self,
        prompt: str | None,
        prompt_token_ids: Sequence[int] | None,
        messages: Sequence[dict[str, Any]] | None,
        chat_template: ChatTemplateOptions,
    ) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise invalid("give exactly one of prompt, prompt token ids or messages", "prompt")
        if prompt is not None:
            return self._encode(prompt, "prompt")
        if messages is not None:
            return self._chat_tokens(messages, chat_template)
        return list(prompt_token_ids or [])

    def _chat_tokens(
        self, messages: Sequence[dict[str, Any]], options: ChatTemplateOptions
    ) -> list[int]:
        return self._encode(self._chat_text(messages, options), "messages", False)

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's tokens; INVALID_ARGUMENT naming `field`, without encoding it, for a text
        too long for the context whatever its tokens."""
        if self.tokenizer.surely_longer(text, self.max_model_len):
            raise invalid(
                f"{field} has {len(text)} characters, more than max_model_len="
                f"{self.max_model_len} tokens of up to {self.tokenizer.max_token_chars} "
                "characters each hold",
                field,
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _validate(self, tokens: list[int], params: SamplingParams, prompt_field: str) -> None:
        try:
            params.validate(self.vocab_size)
            validate_prompt_token_ids(
                tokens, self.vocab_size, self.max_model_len, params.output_budget
            )
        except ValueError as e:
            message = str(e)
            if message.startswith("prompt "):  # name the field the client actually sent
                message = prompt_field + message.removeprefix("prompt")
            raise invalid(message) from None
        structured = params.structured_output
        if structured is not None:
            try:  # llguidance, without torch: the workers compile what passes here
                structured.validate()
            except ValueError as e:
                raise invalid(str(e), structured.source) from None

    def _chat_text(self, messages: Sequence[dict[str, Any]], options: ChatTemplateOptions) -> str:
        """The conversation rendered by the chat template."""
        if not messages:
            raise invalid("messages must not be empty", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str) or m.get("role") not in CHAT_ROLES:
                raise invalid(
                    f"messages[{i}] needs a role ({', '.join(CHAT_ROLES)}) and string content",
                    "messages",
                )
        if options.continue_final_message and options.add_generation_prompt:
            raise invalid(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        if options.continue_final_message and messages[-1]["role"] != "assistant":
            raise invalid("continue_final_message needs a final assistant message", "messages")
        # vLLM's reading of OpenAI's `developer` role: the system prompt.
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        tools = options.tools
        if not self.tokenizer.renders_tools:
            messages, tools = hermes_messages(messages, tools), None
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                options.add_generation_prompt,
                tools=tools,
                continue_final_message=options.continue_final_message,
                **options.template_kwargs,
            )
        except ValueError as e:  # e.g. a model without a chat template
            raise invalid(f"messages cannot be rendered for this model: {e}", "messages") from None

    # -- generate -----------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """Abort a request this replica holds (all its choices); whether it holds it."""
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()
        return event is not None

    async def abort_anywhere(self, request_id: str) -> bool:
        """Abort the request on whichever router replica holds it: True when this one does,
        or when the abort went out to another replica (which aborts it if it holds it)."""
        if self.abort(request_id):
            return True
        if self.forward_abort is None:
            return False
        return await asyncio.to_thread(self.forward_abort, request_id) > 1

    async def generate(self, prep: Prepared) -> AsyncIterator[Delta]:
        """Deltas until the request (of one choice) finishes; RouterError if it cannot be
        served."""
        if prep.params.n != 1:
            raise ValueError("generate serves one choice: use generate_choices")
        async with contextlib.aclosing(self.generate_choices(prep)) as deltas:
            async for _, delta in deltas:
                yield delta

    async def generate_choices(self, prep: Prepared) -> AsyncGenerator[tuple[int, Delta], None]:
        """(choice index, delta) of each of the request's `params.n` choices until every one
        finishes; RouterError if the request cannot be served."""
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

    @property
    def ready(self) -> bool:
        """Whether a decode worker of this model takes new requests: HTTP /ready and gRPC
        health follow it."""
        return self.serving_decode_workers() > 0

    def serving_decode_workers(self) -> int:
        """How many decode workers of this model take new requests (/ready reports it)."""
        return len(self._live("decode"))

    def _live(self, role: str) -> list[WorkerRecord]:
        """The workers of this model and `role` that take new requests (not draining)."""
        return [
            w for w in self.snapshot.workers(model=self.model_name, role=role) if not w.draining
        ]

    async def _dispatch(
        self, prep: Prepared, abort: asyncio.Event
    ) -> AsyncIterator[tuple[int, Delta]]:
        """Relay the request's choices from one route; if its decode worker dies mid-stream,
        mark it down and resume each open choice on another one, through its relay."""
        timings: dict[str, Any] = {"queue_s": time.monotonic() - prep.arrival}
        relays = [
            Relay(self.tokenizer, prep.prompt_token_ids, prep.params, prep.arrival, timings)
            for _ in range(prep.params.n)
        ]
        lost: set[str] = set()  # the decode workers this request has lost
        try:
            async with contextlib.aclosing(self._relay_route(prep, abort, relays, lost)) as deltas:
                async for item in deltas:
                    yield item
            return
        except DecodeLost as e:
            self._lose(prep, e, lost)
        resuming = [i for i, relay in enumerate(relays) if not relay.finished]

        def resume(i: int) -> AsyncGenerator[Delta, None]:
            return self._resume(choice_prep(prep, i), abort, relays[i], set(lost))

        async with contextlib.aclosing(merged(resume, resuming)) as deltas:
            async for position, delta in deltas:
                yield resuming[position], delta

    async def _resume(
        self, prep: Prepared, abort: asyncio.Event, relay: Relay, lost: set[str]
    ) -> AsyncGenerator[Delta, None]:
        """Resume a request of one choice after its decode worker died (and again after the
        next one dies), through `relay`: the tokens it already sent end its prompt."""
        relay.timings = dict(relay.timings)  # its own from here: its route is its own
        while True:
            self.migrations += 1
            route_prep = _resumed(prep, relay.output_token_ids, len(lost))
            try:
                async with contextlib.aclosing(
                    self._relay_route(route_prep, abort, [relay], lost)
                ) as deltas:
                    async for _, delta in deltas:
                        yield delta
                return
            except DecodeLost as e:
                self._lose(prep, e, lost)

    def _lose(self, prep: Prepared, e: DecodeLost, lost: set[str]) -> None:
        """Mark the decode worker down and avoid it; UNAVAILABLE after too many losses."""
        log.warning("request %s: %s", prep.request_id, e)
        self.snapshot.mark_down(e.worker.worker_id, MARK_DOWN_S)
        lost.add(e.worker.worker_id)
        if len(lost) > MAX_MIGRATIONS:
            raise RouterError(ErrorKind.UNAVAILABLE, str(e)) from None

    async def _relay_route(
        self, prep: Prepared, abort: asyncio.Event, relays: list[Relay], lost: set[str]
    ) -> AsyncGenerator[tuple[int, Delta], None]:
        """Pick the workers (none in `lost`) and open Decode, prefill in the background, relay
        D's tokens of each choice through its relay; the route ends with the request however
        it ends. DecodeLost: D died."""
        wreq = _worker_request(prep)
        with await self._open_route(prep, wreq, lost) as route:
            timings = relays[0].timings  # the route's relays share it
            timings["decode_worker"] = route.decode.worker.worker_id
            timings["prefill_worker"] = route.prefill.worker.worker_id if route.prefill else ""
            if route.prefill is not None:
                route.start_prefill(
                    self._prefill(wreq, route.ticket, route.prefill, prep, timings, route.go_local)
                )
            running = set(range(len(relays)))
            try:
                while running:
                    chunk = await self._next_chunk(route, wreq, prep, abort, timings)
                    if chunk is None:  # aborted
                        for i in sorted(running):
                            yield i, relays[i].final([], "abort")
                        return
                    if chunk.index not in running:
                        continue  # the end of a choice a stop string ended here
                    delta = relays[chunk.index].delta(chunk)
                    yield chunk.index, delta
                    if delta.finish_reason is not None:
                        running.discard(chunk.index)
                        if running and not chunk.finish_reason:  # D has not ended it
                            self._abort_choice(route, chunk.index)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    raise DecodeLost(route.decode.worker, e.details() or "UNAVAILABLE") from None
                raise self._worker_error(e, route.decode.worker) from None

    def _abort_choice(self, route: Route, index: int) -> None:
        """End one choice on D (its others go on), in the background."""
        stub = wpb_grpc.DecodeWorkerStub(self._channel(route.decode.worker.endpoint))
        request = wpb.WorkerAbortRequest(request_id=choice_request_id(route.request_id, index))

        async def abort() -> None:
            try:
                await stub.Abort(request, timeout=CHOICE_ABORT_S)
            except grpc.aio.AioRpcError as e:  # the choice ends with the request anyway
                log.warning("abort of %s failed: %s", request.request_id, e)

        task = asyncio.create_task(abort())
        self._choice_aborts.add(task)
        task.add_done_callback(self._choice_aborts.discard)

    # -- pick ---------------------------------------------------------------------------------

    async def _open_route(self, prep: Prepared, wreq: wpb.WorkerRequest, lost: set[str]) -> Route:
        """Pick P unless D prefills the prompt itself (a short prompt, or no prefill worker),
        then open Decode on a picked D (not one in `lost`). P counts from its pick, before D
        is picked."""
        decodes = await self._decode_workers(lost)
        ctx = PickContext(prep.prompt_token_ids, self.inflight)
        prefills = self._live("prefill")
        local = len(prep.prompt_token_ids) <= self.config.local_prefill_tokens or not prefills
        prefill = None if local else pick(self.prefill_policy, prefills, ctx)
        try:
            decode, call, ticket = await self._open_decode(decodes, ctx, wreq, local, prep)
        except BaseException:
            if prefill is not None:
                prefill.release()
            raise
        return Route(decode, call, ticket, prefill, wreq.request_id)

    async def _decode_workers(self, lost: set[str]) -> list[WorkerRecord]:
        """The decode workers the request may use (none in `lost`). With none, wait for one
        (a replacement starting) up to `decode_wait_s`; the request's deadline cuts the wait
        short. UNAVAILABLE when none came, RESOURCE_EXHAUSTED when too many wait already."""

        def available() -> list[WorkerRecord]:
            return [w for w in self._live("decode") if w.worker_id not in lost]

        decodes = available()
        if decodes:
            return decodes
        wait_s = self.config.decode_wait_s
        if wait_s <= 0:
            raise RouterError(ErrorKind.UNAVAILABLE, "no decode worker serves this model")
        if self.decode_waiters >= self.config.max_decode_waiters:
            raise RouterError(
                ErrorKind.OVERLOADED,
                f"{self.decode_waiters} requests already wait for a decode worker",
                retry_after_s=1.0,
            )
        self.decode_waiters += 1
        try:
            end = time.monotonic() + wait_s
            while not decodes and time.monotonic() < end:
                await asyncio.sleep(DECODE_POLL_S)
                decodes = available()
        finally:
            self.decode_waiters -= 1
        if not decodes:
            raise RouterError(ErrorKind.UNAVAILABLE, "no decode worker serves this model")
        return decodes

    async def _open_decode(
        self,
        decodes: list[WorkerRecord],
        ctx: PickContext,
        wreq: wpb.WorkerRequest,
        local: bool,
        prep: Prepared,
    ) -> tuple[Lease, Any, Any]:
        """Open Decode on a picked worker and read its ticket. A worker that is unreachable or
        draining (UNAVAILABLE before any token) is skipped once, for another one."""
        tried: set[str] = set()
        while True:
            lease = pick(self.decode_policy, [w for w in decodes if w.worker_id not in tried], ctx)
            d = lease.worker
            call = self._decode_call(d, wreq, local, prep)
            try:
                return lease, call, await self._read_ticket(call, d)
            except BaseException as e:
                lease.release()
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
        return stub.Decode(
            wpb.DecodeRequest(request=wreq, local_prefill=local), timeout=_time_left(prep)
        )

    async def _read_ticket(self, call: Any, d: WorkerRecord) -> Any:
        """D's ticket, the call's first message; DecodeLost if D stalls first (`_check_live`)."""
        read = asyncio.ensure_future(call.read())
        try:
            while not (await asyncio.wait([read], timeout=STALL_CHECK_S))[0]:
                self._check_live(d, decoding=False)
        finally:
            read.cancel()  # a no-op once read; else the call ends with it
        first = read.result()
        if first is grpc.aio.EOF or not first.HasField("ticket"):
            raise RouterError(ErrorKind.UNAVAILABLE, f"decode worker {d.worker_id} sent no ticket")
        self._heard[d.worker_id] = time.monotonic()
        return first.ticket

    # -- prefill ------------------------------------------------------------------------------

    async def _prefill(
        self,
        wreq: wpb.WorkerRequest,
        ticket: Any,
        first: Lease,
        prep: Prepared,
        timings: dict[str, Any],
        go_local: asyncio.Event,
    ) -> None:
        """Run the prefill on `first` (whose lease the task holds); on failure try one other
        prefill worker, then ask the decode side to prefill locally (per `on_prefill_failure`)."""
        done = await self._prefill_on(first.worker, wreq, ticket, prep, timings)
        if not done and (retry := self._pick_retry(first.worker, wreq)) is not None:
            with retry:
                done = await self._prefill_on(retry.worker, wreq, ticket, prep, timings)
        if not done:
            go_local.set()  # the relay prefills on D, or fails under `fail`

    async def _prefill_on(
        self,
        p: WorkerRecord,
        wreq: wpb.WorkerRequest,
        ticket: Any,
        prep: Prepared,
        timings: dict[str, Any],
    ) -> bool:
        """Prefill on `p` and push the KV to D; False if it failed and another worker may
        succeed, True once nothing is left to do (pushed, or D's reservation has ended)."""
        timings["prefill_worker"] = p.worker_id
        stub = wpb_grpc.PrefillWorkerStub(self._channel(p.endpoint))
        try:
            reply = await stub.Prefill(
                wpb.PrefillRequest(request=wreq, ticket=ticket), timeout=_time_left(prep)
            )
        except grpc.aio.AioRpcError as e:
            log.warning("prefill of %s on %s failed: %s", wreq.request_id, p.worker_id, e)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.snapshot.mark_down(p.worker_id, MARK_DOWN_S)
            # NOT_FOUND, CANCELLED: D's reservation has ended (it prefills locally, or was aborted)
            return e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED)
        timings["prefill_s"] = reply.prefill_s
        timings["data_plane"] = reply.data_plane
        return True

    def _pick_retry(self, failed: WorkerRecord, wreq: wpb.WorkerRequest) -> Lease | None:
        """Another prefill worker for the retry, if `on_prefill_failure` retries and one is live."""
        others = [w for w in self._live("prefill") if w.worker_id != failed.worker_id]
        if self.config.on_prefill_failure != "retry" or not others:
            return None
        retry = pick(self.prefill_policy, others, PickContext(wreq.prompt_token_ids, self.inflight))
        self.prefill_retries += 1
        return retry

    # -- relay --------------------------------------------------------------------------------

    async def _next_chunk(
        self,
        route: Route,
        wreq: wpb.WorkerRequest,
        prep: Prepared,
        abort: asyncio.Event,
        timings: dict[str, Any],
    ) -> wpb.TokenChunk | None:
        """D's next chunk; None on an abort."""
        while True:
            msg = await route.next_message(abort)
            if msg == "abort":
                return None
            if msg == "check":
                self._check_live(route.decode.worker, route.decoding)
                continue
            if msg != "local":
                break
            if route.decoding:  # D fell back to its own prefill first (`on_transfer_failure`)
                route.go_local = asyncio.Event()
                continue
            await self._prefill_on_decode(route, wreq, prep, timings)
        if msg is grpc.aio.EOF:
            raise DecodeLost(route.decode.worker, "the stream ended without a final chunk")
        assert isinstance(msg, wpb.DecodeResponse)
        self._heard[route.decode.worker.worker_id] = time.monotonic()
        route.decoding = True
        return msg.tokens

    def _check_live(self, d: WorkerRecord, decoding: bool) -> None:
        """DecodeLost if D has stopped answering though its connection stays open (a stalled
        process): the registry has not listed it for UNLISTED_S beyond one heartbeat interval
        (no heartbeat within its TTL, not a Redis that restarted empty),
        or, once it decodes the request (`decoding`), it has sent nothing on any of this
        router's streams for `decode_stall_s` (a stalled engine beside a live heartbeat)."""
        if self.snapshot.unlisted_s(d.worker_id) >= UNLISTED_S + d.heartbeat_s:
            raise DecodeLost(d, "it left the registry (no heartbeat within its TTL)")
        silent_s = time.monotonic() - self._heard.get(d.worker_id, time.monotonic())
        if decoding and silent_s >= self.config.decode_stall_s:
            raise DecodeLost(d, f"it has sent nothing for {silent_s:.1f} s")

    async def _prefill_on_decode(
        self, route: Route, wreq: wpb.WorkerRequest, prep: Prepared, timings: dict[str, Any]
    ) -> None:
        """No prefill worker could push the KV: reopen Decode on D to compute it there."""
        if self.config.on_prefill_failure == "fail":
            raise RouterError(ErrorKind.UNAVAILABLE, "no prefill worker could serve")
        self.local_prefills += 1
        timings["prefill_worker"] = ""
        # A request id of its own: D learns of the first call's cancel on another thread, and
        # may not have dropped that reservation yet (the same id was refused as a duplicate,
        # INVALID_ARGUMENT for a server-side failure) or would cancel this one by its id.
        local = wpb.WorkerRequest()
        local.CopyFrom(wreq)
        local.request_id = f"{wreq.request_id}{LOCAL_PREFILL_SUFFIX}"
        route.reopen(self._decode_call(route.decode.worker, local, True, prep), local.request_id)
        await self._read_ticket(route.call, route.decode.worker)
        route.go_local = asyncio.Event()

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


def _worker_request(prep: Prepared) -> wpb.WorkerRequest:
    wreq = wpb.WorkerRequest(
        request_id=prep.request_id,
        prompt_token_ids=prep.prompt_token_ids,
        sampling=sampling_to_proto(prep.params),
        priority=prep.priority,
        output_offset=prep.params.output_offset,
        n=prep.params.n,
    )
    if prep.speculative is not None:
        wreq.speculative = prep.speculative
    return wreq


def choice_prep(prep: Prepared, index: int) -> Prepared:
    """Choice `index` of `prep` as a request of its own (its id and seed: `choice(index)`)."""
    return replace(
        prep,
        request_id=choice_request_id(prep.request_id, index),
        params=prep.params.choice(index),
    )


def _resumed(prep: Prepared, sent: list[int], migration: int) -> Prepared:
    """The request to resume after `sent` tokens reached the client: they end its prompt, its
    token budgets shrink by them, and seeded sampling continues at their output position."""
    params = prep.params
    k = len(sent)
    resumed = replace(
        params,
        max_tokens=None if params.max_tokens is None else params.max_tokens - k,
        min_tokens=max(params.min_tokens - k, 0),
        output_offset=params.output_offset + k,
        prompt_logprobs=None,  # sent with the first token already
    )
    return replace(
        prep,
        request_id=f"{prep.request_id}{MIGRATED_SUFFIX}{migration}",
        prompt_token_ids=prep.prompt_token_ids + sent,
        params=resumed,
    )


def _time_left(prep: Prepared) -> float:
    """The gRPC timeout of a worker call: what is left to the deadline (never zero)."""
    return max(prep.deadline - time.monotonic(), 0.001)
