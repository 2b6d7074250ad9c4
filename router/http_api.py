"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE streaming),
/v1/models, vLLM's /tokenize and /detokenize, plus /health, /ready, /metrics and /version.
Routes translate and delegate to the Router; the API key and the admin token are checked before
a route runs (`auth.py`: 401).

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 naming the
field (malformed JSON included), 404 for an unknown model, 429 with Retry-After under overload,
503 when no worker can serve, 504 past the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from router.auth import BearerMiddleware, Credentials
from router.choices import MAX_N, Choice, merged, request_choices
from router.core import ChatTemplateOptions, Prepared, Router
from router.errors import ErrorKind, RouterError, invalid
from router.relay import Delta
from router.router_metrics import RouterMetrics
from router.tools import ToolCall, ToolStream, ToolUse, finish_reason, template_message
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.structured import StructuredOutput

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
REQUEST_TIMEOUT_HEADER = "x-request-timeout"  # a client's deadline, seconds
CLIENT_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"  # the official openai client's, seconds

# Accepted and logged, with no effect here: OpenAI's storage, tracing and caching hints.
NO_OP_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class _ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None


class _StructuredOutputs(BaseModel):
    """vLLM's newer `structured_outputs` (its guided_* fields under one object): one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def structured_output(self) -> StructuredOutput:
        name = "structured_outputs"
        given = [k for k, v in self.model_dump(by_alias=True).items() if v not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{name}: give exactly one of json, regex, choice, grammar, json_object"
            )
        kind = given[0]
        return structured_output_of(kind, getattr(self, "json_" if kind == "json" else kind), name)


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two optional counts (None: not asked for)."""
    return b if a is None else a if b is None else max(a, b)


def structured_output_of(kind: str, value: Any, source: str) -> StructuredOutput:
    """The constraint one request field asks for: `kind` json (a schema), choice, json_object,
    regex or grammar; `source` names the field in errors."""
    if kind == "json":
        return StructuredOutput.json_schema(value, source)
    if kind == "choice":
        return StructuredOutput.choice(value or [], source)
    if kind == "json_object":
        return StructuredOutput("json_object", source=source)
    if kind == "regex":
        return StructuredOutput("regex", value or "", source)
    return StructuredOutput("grammar", value or "", source)


class _Sampling(BaseModel):
    """The fields both endpoints share. Any other field is a 400 naming it: nothing a client
    sends is silently ignored (docs/api.md lists every field)."""

    model_config = ConfigDict(extra="forbid")

    model: str = ""
    max_tokens: int | None = None  # None: the rest of the model's context
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    timeout: float = 0.0  # seconds; 0 = the router's default
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* or structured_outputs.
    response_format: _ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: _StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top-n

    def structured_output(self) -> StructuredOutput | None:
        """The one structured output the request asks for (400 naming the second if two)."""
        given = [
            name
            for name in (
                "guided_json",
                "guided_regex",
                "guided_choice",
                "guided_grammar",
                "structured_outputs",
            )
            if getattr(self, name) is not None
        ]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise invalid(f"give one structured output, not {' and '.join(given)}", given[1])
        if not given:
            return None
        try:
            return self._structured(given[0])
        except ValueError as e:
            raise invalid(str(e), given[0]) from None

    def _structured(self, name: str) -> StructuredOutput:
        if self.structured_outputs is not None and name == "structured_outputs":
            return self.structured_outputs.structured_output()
        if name.startswith("guided_"):
            return structured_output_of(name.removeprefix("guided_"), getattr(self, name), name)
        assert self.response_format is not None
        if self.response_format.type == "json_object":
            return StructuredOutput("json_object", source=name)
        form = self.response_format.json_schema
        if form is None or form.schema_ is None:
            raise ValueError("response_format: json_schema needs json_schema.schema")
        return StructuredOutput.json_schema(form.schema_, name)

    def sampling_params(
        self, logprobs: int | None, prompt_logprobs: int | None = None, least_tokens: int = 1
    ) -> SamplingParams:
        """The sampling parameters; `prompt_logprobs` when the endpoint asks for more of them
        than the field does (completions: echo with logprobs); `least_tokens` the fewest output
        tokens the endpoint takes (completions with echo: 0)."""
        if self.prompt_logprobs is not None and self.stream:
            raise invalid(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        if not 1 <= self.n <= MAX_N:
            raise invalid(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise invalid("give max_tokens or max_completion_tokens, not both", "max_tokens")
        if self.output_tokens is not None and self.output_tokens < least_tokens:
            name = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
            raise invalid(f"{name} must be >= {least_tokens}, got {self.output_tokens}", name)
        given = [name for name in NO_OP_FIELDS if getattr(self, name) is not None]
        if given:
            log.info("accepted without effect: %s", ", ".join(given))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=_most(self.prompt_logprobs, prompt_logprobs),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_output=self.structured_output(),
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """The bias per token id; SamplingParams.validate checks the ids and the range."""
        try:
            return tuple(sorted((int(t), b) for t, b in (self.logit_bias or {}).items()))
        except ValueError:
            raise invalid("logit_bias keys must be token ids (integers)", "logit_bias") from None

    @property
    def output_tokens(self) -> int | None:
        """max_tokens or max_completion_tokens, whichever was given."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a list of them
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[dict[str, Any]]:
        """Each prompt as `Router.prepare` takes it: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # type: ignore[assignment]
        if not prompt:
            raise invalid("prompt must not be an empty list", "prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]

    def completion_params(self) -> SamplingParams:
        """The sampling parameters: echo with logprobs asks for the prompt's too. `max_tokens: 0`
        (only with echo) becomes 1 here: that token is not sent (`_echo_only`)."""
        if self.suffix:
            raise invalid(
                "suffix (fill in the middle) is not supported: the served chat models have no "
                "infilling template",
                "suffix",
            )
        params = self.sampling_params(
            self.logprobs, self.logprobs if self.echo else None, 0 if self.echo else 1
        )
        return replace(params, max_tokens=1) if self.echo_only else params

    @property
    def echo_only(self) -> bool:
        """echo with no tokens to generate: the answer is the prompt."""
        return self.echo and self.output_tokens == 0


class _Function(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None: an assistant's tool calls only
    name: str | None = None  # a participant's name: accepted, not shown to the model
    tool_calls: list[_ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self, index: int) -> str:
        """The content as text: a string, or text parts joined by newlines (as vLLM does);
        any other part is a 400 naming it."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str) or len(part) != 2:
                raise invalid(
                    f"messages[{index}].content[{j}]: only text parts "
                    f'({{"type": "text", "text": ...}}) are supported, got type {kind!r}',
                    "messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)

    def template_message(self, index: int) -> dict[str, Any]:
        """The message as a chat template reads it (`tools.template_message`)."""
        calls = None
        if self.tool_calls is not None:
            calls = [ToolCall(c.function.name, c.function.arguments, c.id) for c in self.tool_calls]
        text = None if self.content is None else self.text(index)
        return template_message(index, self.role, text, calls, self.tool_call_id)


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def rendered_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def tool_use(self, parser: str) -> ToolUse | None:
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def chat_sampling_params(self, tool_use: ToolUse | None) -> SamplingParams:
        """The sampling parameters, with the constraint that the tool choice puts on the output."""
        if self.top_logprobs and not self.logprobs:  # as vLLM: 0 asks for nothing
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise invalid(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                "top_logprobs",
            )
        n_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(n_logprobs)
        return params if tool_use is None else tool_use.constrain(params)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them."""
    return [m.template_message(i) for i, m in enumerate(messages)]


def error_body(e: RouterError) -> dict[str, Any]:
    return {
        "error": {
            "message": e.message,
            "type": e.kind.openai_type,
            "param": e.field,
            "code": e.kind.http_status,
        }
    }


def error_response(e: RouterError) -> JSONResponse:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(int(e.retry_after_s + 0.999))
    return JSONResponse(error_body(e), status_code=e.kind.http_status, headers=headers)


class ScaleRequest(BaseModel):
    prefill: int | None = Field(default=None, ge=0)
    decode: int | None = Field(default=None, ge=0)


def build_app(
    router: Router,
    metrics: RouterMetrics | None = None,
    admin_token: str | None = None,
    controller: Any = None,
) -> FastAPI:
    app = FastAPI(title="Tandem", version="1")
    metrics = metrics or RouterMetrics(router)
    credentials = Credentials.of(router.config.api_key, admin_token)
    app.add_middleware(BearerMiddleware, credentials=credentials, deny=_unauthorized)
    _add_admin_routes(app, router, controller)
    _add_error_handlers(app)
    _add_status_routes(app, router, metrics)
    _add_tokenizer_routes(app, router)
    _add_generate_routes(app, router, metrics)
    return app


def _unauthorized(reason: str) -> Response:
    return error_response(RouterError(ErrorKind.UNAUTHORIZED, reason))


def _add_admin_routes(app: FastAPI, router: Router, controller: Any) -> None:
    @app.get("/admin/workers")
    async def admin_workers() -> dict[str, Any]:
        return {"workers": [w.__dict__ for w in router.snapshot.workers()]}

    @app.post("/admin/scale")
    async def admin_scale(body: ScaleRequest) -> dict[str, int]:
        if controller is None:
            raise RouterError(ErrorKind.UNIMPLEMENTED, "scaling needs the Ray cluster controller")
        return dict(await controller.scale.remote(body.prefill, body.decode))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        field = "body" if first.get("type") == "json_invalid" else ".".join(loc) or "body"
        message = f"{field}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "extra_forbidden":
            message = f"{field} is not supported by this server (docs/api.md lists the fields)"
        return error_response(invalid(message, field))

    @app.exception_handler(RouterError)
    async def on_router_error(request: Request, exc: RouterError) -> JSONResponse:
        return error_response(exc)


def _add_status_routes(app: FastAPI, router: Router, metrics: RouterMetrics) -> None:
    """/health, /ready, /metrics, /version and /v1/models."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        decode = router.serving_decode_workers()
        return JSONResponse({"ready": decode > 0, "decode_workers": decode}, 200 if decode else 503)

    @app.get("/version")
    async def package_version() -> dict[str, str]:
        return {"version": version("tandem-serve")}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": router.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "max_model_len": router.max_model_len,
        }
        return {"object": "list", "data": [card]}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered as chat requests are."""

    model_config = ConfigDict(extra="forbid")

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # with messages: rendered as a chat request's

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them, checked as a chat request's are."""
        if self.tools is not None and self.messages is None:
            raise invalid("tools need messages", "tools")
        tool_use = ToolUse.of(self.tools, None, None)
        return tool_use.prompt_tools if tool_use is not None else None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    tokens: list[int]


def _add_tokenizer_routes(app: FastAPI, router: Router) -> None:
    """/tokenize and /detokenize, with vLLM's bodies."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        messages = None if body.messages is None else template_messages(body.messages)
        tokens = await router.tokenize(
            model=body.model,
            prompt=body.prompt,
            messages=messages,
            chat_template=ChatTemplateOptions(
                body.add_generation_prompt, tools=body.prompt_tools()
            ),
        )
        return {"tokens": tokens, "count": len(tokens), "max_model_len": router.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        return {"prompt": router.detokenize(body.tokens, model=body.model)}


def _add_generate_routes(app: FastAPI, router: Router, metrics: RouterMetrics) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = body.completion_params()
        prompts = body.prompts()
        rid = _response_id(_CompletionRender.prefix)  # the request's id too: logs name it
        preps = [
            await router.prepare(
                params,
                model=body.model,
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                timeout_s=_timeout_s(body, request),
                **prompt,
            )
            for i, prompt in enumerate(prompts)
        ]
        render = _CompletionRender(router, preps, body, rid)
        return await _respond(router, metrics, render, body, request, body.echo_only)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        tool_use = body.tool_use(router.tool_parser)
        rid = _response_id(_ChatRender.prefix)
        prep = await router.prepare(
            body.chat_sampling_params(tool_use),
            model=body.model,
            request_id=rid,
            messages=body.rendered_messages(),
            timeout_s=_timeout_s(body, request),
            chat_template=ChatTemplateOptions(
                body.add_generation_prompt,
                body.chat_template_kwargs or {},
                body.continue_final_message,
                tool_use.prompt_tools if tool_use is not None else None,
            ),
        )
        render = _ChatRender(router, [prep], body, tool_use, rid)
        return await _respond(router, metrics, render, body, request)


def _response_id(prefix: str) -> str:
    """A new response id (OpenAI's `cmpl-...`, `chatcmpl-...`), which is also the request's id
    in the router's and the workers' logs."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _timeout_s(body: _Sampling, request: Request) -> float:
    """The request's deadline in seconds from now (0: the router's default): the body's
    `timeout`, the `x-request-timeout` header, and for a whole answer the official client's own
    read timeout (`x-stainless-read-timeout`: it stops waiting then), whichever is soonest."""
    headers = [REQUEST_TIMEOUT_HEADER] + ([] if body.stream else [CLIENT_READ_TIMEOUT_HEADER])
    timeouts = [body.timeout] if body.timeout else []
    for name in headers:
        if (value := request.headers.get(name)) is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            raise invalid(f"header {name} must be seconds, got {value!r}", name) from None
        if not seconds > 0:
            raise invalid(f"header {name} must be > 0, got {value!r}", name)
        timeouts.append(seconds)
    return min(timeouts, default=0.0)


async def _respond(
    router: Router,
    metrics: RouterMetrics,
    render: _Render,
    body: _Sampling,
    request: Request,
    echo_only: bool = False,
) -> Response:
    """Run each prompt's n choices (`choices.py`; choice i*n + j is prompt i's j-th) and
    answer, whole or as a stream."""
    choices = [choice for prep in render.preps for choice in request_choices(prep, body.n)]

    def generate(c: Choice) -> AsyncGenerator[Delta, None]:
        return metrics.observe(c.deltas(router))

    def echo(c: Choice) -> AsyncGenerator[Delta, None]:
        return _echo_only(c.prep, lambda: generate(c))

    deltas = merged(echo if echo_only else generate, choices)
    if not body.stream:
        try:
            await _run_while_connected(deltas, render, request)
        finally:
            await deltas.aclose()  # a client that left cancels the request on both workers
        return JSONResponse(render.full())
    # Pull the first delta before answering 200, so admission and routing errors get their
    # status codes rather than a broken stream.
    first = await anext(deltas)

    async def sse() -> AsyncIterator[str]:
        try:
            async for index, d in _starting_with(first, deltas):
                if (chunk := render.chunk(index, d)) is not None:
                    yield _event(chunk)
            if body.include_usage:
                yield _event(render.usage_chunk())
        except RouterError as e:  # after the 200: report in the stream, as OpenAI does
            yield _event(error_body(e))
        finally:
            await deltas.aclose()  # a client that left cancels the request on both workers
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


async def _echo_only(
    prep: Prepared, generate: Callable[[], AsyncGenerator[Delta, None]]
) -> AsyncGenerator[Delta, None]:
    """The answer to an echo request with nothing to generate: its end. No worker is involved
    unless the prompt's logprobs are asked for: they come with a first token, which is dropped."""
    scores = None
    if prep.params.prompt_logprobs is not None:
        async with contextlib.aclosing(generate()) as deltas:
            async for d in deltas:
                scores = scores or d.prompt_logprobs
        scores = scores or []
    yield Delta([], "", [], "length", len(prep.prompt_token_ids), 0, prompt_logprobs=scores)


async def _starting_with(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _run_while_connected(
    deltas: AsyncIterator[tuple[int, Delta]], render: _Render, request: Request
) -> None:
    """Collect the whole answer; a client that disconnects first ends the request (on every
    worker, through the generator's close), as closing a stream does."""

    async def collect() -> None:
        async for index, d in deltas:
            render.add(index, d)

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise RouterError(ErrorKind.CANCELLED, "the client disconnected")
        task.result()  # its RouterError, if any
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _event(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload) + "\n\n"


@dataclass
class _Choice:
    """One choice's answer so far."""

    text: list[str] = field(default_factory=list)
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0
    started: bool = False  # a stream chunk has been sent for it
    streamed_logprobs: int = 0  # with tools: the logprobs sent so far
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # tokens 1, 2, ...

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.token_logprobs.extend(d.logprobs)
        self.prompt_logprobs.extend(d.prompt_logprobs or ())
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason
            self.completion_tokens = d.completion_tokens


class _Render:
    """Accumulates each choice's deltas into an OpenAI response, or turns each into a stream
    chunk that names its choice index."""

    kind = ""
    prefix = "cmpl"

    def __init__(
        self,
        router: Router,
        preps: list[Prepared],
        logprobs: bool,
        body: _Sampling,
        response_id: str,
    ) -> None:
        self.tokenizer = router.tokenizer
        self.model = router.model_name
        self.preps = preps  # one per prompt; prompt i's choices are i*n .. i*n + n-1
        self.logprobs = logprobs
        self.n = body.n
        self.num_prompt_logprobs = body.prompt_logprobs  # vLLM's field: None when not asked
        self.id = response_id
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(body.n * len(preps))]

    def add(self, index: int, d: Delta) -> None:
        self.choices[index].add(d)

    def usage(self) -> dict[str, int]:
        """Each prompt counted once, as OpenAI does, and every choice's completion."""
        n_prompt = sum(len(p.prompt_token_ids) for p in self.preps)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": completion,
            "total_tokens": n_prompt + completion,
        }

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.envelope(f"{self.kind}.chunk", []), "usage": self.usage()}

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def prompt_logprobs(self, c: _Choice) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, then by token id the
        token's and its top-n's logprob, rank and text."""
        n = self.num_prompt_logprobs
        if n is None:
            return None

        def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id)}

        scores: list[dict[str, Any] | None] = [None]
        for lp in c.prompt_logprobs:
            top = zip(lp.top_token_ids[:n], lp.top_logprobs[:n], strict=True)
            position = {str(t): entry(t, p, rank) for rank, (t, p) in enumerate(top, 1)}
            position[str(lp.token_id)] = entry(lp.token_id, lp.logprob, lp.rank)
            scores.append(position)
        return scores

    def full(self) -> dict[str, Any]:
        choices = [self.full_choice(i, c) for i, c in enumerate(self.choices)]
        return {**self.envelope(self.kind, choices), "usage": self.usage()}

    def chunk(self, index: int, d: Delta) -> dict[str, Any] | None:
        """The stream chunk of choice `index`'s delta; None while the delta is held back."""
        choice = self.choices[index]
        choice.add(d)
        body = self.chunk_choice(index, d, not choice.started)
        if body is None:
            return None
        choice.started = True
        return self.envelope(f"{self.kind}.chunk", [body])

    def full_choice(self, index: int, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, index: int, d: Delta, first: bool) -> dict[str, Any] | None:
        raise NotImplementedError


class _CompletionRender(_Render):
    kind = "text_completion"
    prefix = "cmpl"

    def __init__(
        self, router: Router, preps: list[Prepared], body: CompletionRequest, response_id: str
    ) -> None:
        super().__init__(router, preps, body.logprobs is not None, body, response_id)
        self.num_logprobs = body.logprobs or 0
        # echo: each choice's text starts with its prompt's (token ids decoded, as vLLM does),
        # and with logprobs its logprobs with the prompt's (the first token's are null)
        self.echo = body.echo
        self.echoed = [
            self.tokenizer.decode(p.prompt_token_ids) if self.echo else "" for p in preps
        ]

    def _logprobs(
        self, lps: list[TokenLogprobs], echoed: tuple[list[int], list[TokenLogprobs]] | None
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of `lps`, after those of an echoed prompt (its token ids and
        the logprobs of its tokens after the first)."""
        if not self.logprobs:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        scored = lps
        if echoed is not None:
            prompt, scores = echoed
            tokens += [self.token_text(t) for t in prompt]
            token_logprobs.append(None)
            top_logprobs.append(None)
            scored = scores + lps
        for lp in scored:
            top = list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))[: self.num_logprobs]
            token_logprobs.append(lp.logprob)
            top_logprobs.append({self.token_text(t): p for t, p in top})
        tokens += [self.token_text(lp.token_id) for lp in lps]
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs}

    def _echoed(self, index: int, first: bool) -> tuple[list[int], list[TokenLogprobs]] | None:
        """Choice `index`'s prompt and its scores, when its first text echoes them."""
        if not (self.echo and first):
            return None
        return self.preps[index // self.n].prompt_token_ids, self.choices[index].prompt_logprobs

    def full_choice(self, index: int, c: _Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": self.echoed[index // self.n] + "".join(c.text),
            "logprobs": self._logprobs(c.token_logprobs, self._echoed(index, True)),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "prompt_logprobs": self.prompt_logprobs(c),
        }

    def chunk_choice(self, index: int, d: Delta, first: bool) -> dict[str, Any]:
        return {
            "index": index,
            "text": self.echoed[index // self.n] + d.text if first else d.text,
            "logprobs": self._logprobs(d.logprobs, self._echoed(index, first)),
            "finish_reason": d.finish_reason,
        }


class _ChatRender(_Render):
    kind = "chat.completion"
    prefix = "chatcmpl"

    def _logprobs(self, lps: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [
                        entry(t, p) for t, p in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                }
                for lp in lps
            ]
        }

    def __init__(
        self,
        router: Router,
        preps: list[Prepared],
        body: ChatRequest,
        tool_use: ToolUse | None,
        response_id: str,
    ) -> None:
        super().__init__(router, preps, body.logprobs, body, response_id)
        self.tool_use = tool_use if tool_use is not None and tool_use.parses else None
        if self.tool_use is not None:
            self.tool_streams = [ToolStream(self.tool_use) for _ in self.choices]

    def _message(self, c: _Choice) -> tuple[dict[str, Any], str | None]:
        """The choice's message, its tool calls read from the text when tools may be called,
        and its finish reason (`tool_calls` when it ended with calls)."""
        text = "".join(c.text)
        if self.tool_use is None:
            return {"role": "assistant", "content": text}, c.finish_reason
        content, calls = self.tool_use.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if not calls:
            return message, c.finish_reason
        message["tool_calls"] = [call.to_openai() for call in calls]
        return message, finish_reason(calls, c.finish_reason)

    def full(self) -> dict[str, Any]:
        """vLLM's chat answer has the prompt's logprobs beside the choices."""
        return {**super().full(), "prompt_logprobs": self.prompt_logprobs(self.choices[0])}

    def full_choice(self, index: int, c: _Choice) -> dict[str, Any]:
        message, finish_reason = self._message(c)
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(c.token_logprobs),
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }

    def chunk_choice(self, index: int, d: Delta, first: bool) -> dict[str, Any] | None:
        if self.tool_use is not None:
            return self._tool_chunk_choice(index, d, first)
        delta: dict[str, Any] = {"content": d.text}
        if first:
            delta["role"] = "assistant"
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(d.logprobs),
            "finish_reason": d.finish_reason,
        }

    def _tool_chunk_choice(self, index: int, d: Delta, first: bool) -> dict[str, Any] | None:
        """With tools, the text streams as content as far as it cannot be a call
        (`ToolStream`); the calls come with the last delta, each with its `index`.
        Logprobs come with the chunk that sends their text, the rest with the last."""
        c = self.choices[index]
        content, calls, reason = self.tool_streams[index].add(d.text, d.finish_reason)
        if not (content or reason):
            return None
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **t.to_openai()} for i, t in enumerate(calls)]
        logprobs = c.token_logprobs[c.streamed_logprobs :]
        c.streamed_logprobs = len(c.token_logprobs)
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": reason,
        }
