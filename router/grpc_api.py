"""The public gRPC API (`tandem.v1.Tandem`) and the admin API (`tandem.v1.Admin`) on grpc.aio:
thin servicers that translate messages and delegate to the Router. The API key and the admin
token are checked before a servicer runs (`auth.py`); health follows readiness (`readiness.py`)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.auth import BearerInterceptor, Credentials
from router.choices import MAX_N, merged, request_choices
from router.core import ChatTemplateOptions, Router
from router.errors import RouterError, invalid
from router.readiness import ReadinessHealth
from router.relay import Delta
from router.router_metrics import RouterMetrics
from router.tools import ToolCall, ToolStream, ToolUse, template_message
from tandem.messages import logprobs_to_proto, sampling_from_proto
from tandem.v1 import admin_pb2, admin_pb2_grpc, api_pb2, api_pb2_grpc

MIN_TIMEOUT_S = 0.001  # a call whose deadline has passed gets this much: it ends at once


def _prepare_args(request: api_pb2.GenerateRequest) -> dict[str, Any]:
    which = request.WhichOneof("input")
    if which == "prompt":
        return {"prompt": request.prompt}
    if which == "prompt_token_ids":
        return {"prompt_token_ids": list(request.prompt_token_ids.ids)}
    if which == "chat":
        return {"messages": [_template_message(i, m) for i, m in enumerate(request.chat.messages)]}
    raise invalid("one of prompt, prompt_token_ids or chat is required", "input")


def _template_message(index: int, m: api_pb2.ChatMessage) -> dict[str, Any]:
    calls = [ToolCall(c.name, c.arguments, c.id) for c in m.tool_calls]
    return template_message(index, m.role, m.content, calls or None, m.tool_call_id or None)


def _tool_use(request: api_pb2.GenerateRequest, parser: str) -> ToolUse | None:
    """The request's tools and tool choice, checked as the HTTP API's are (`ToolUse.of`)."""
    tools = [_openai_tool(i, t) for i, t in enumerate(request.tools)]
    if tools and request.WhichOneof("input") != "chat":
        raise invalid("tools need chat input", "tools")
    choice: Any = None
    which = request.tool_choice.WhichOneof("choice")
    if which == "mode":
        choice = request.tool_choice.mode
    elif which == "function":
        choice = {"type": "function", "function": {"name": request.tool_choice.function}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return ToolUse.of(tools, choice, parallel, parser)


def _openai_tool(index: int, tool: api_pb2.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "description": tool.description}
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except ValueError:
            raise invalid(f"tools[{index}].parameters must be JSON text", "tools") from None
    return {"type": "function", "function": function}


def delta_to_proto(request_id: str, d: Delta, index: int = 0) -> api_pb2.GenerateResponse:
    msg = api_pb2.GenerateResponse(
        request_id=request_id,
        index=index,
        token_ids=d.token_ids,
        text=d.text,
        logprobs=[logprobs_to_proto(lp) for lp in d.logprobs],
        finish_reason=d.finish_reason or "",
        prompt_logprobs=[logprobs_to_proto(lp) for lp in d.prompt_logprobs or ()],
    )
    if d.finish_reason is not None:
        msg.usage.prompt_tokens = d.prompt_tokens
        msg.usage.completion_tokens = d.completion_tokens
        t = d.timings or {}
        for name in ("queue_s", "ttft_s", "e2e_s", "tpot_s", "transfer_s"):
            setattr(msg.timings, name, float(t.get(name, 0.0)))
        msg.timings.prefill_worker = t.get("prefill_worker", "")
        msg.timings.decode_worker = t.get("decode_worker", "")
        msg.timings.draft_tokens = int(t.get("draft_tokens", 0))
        msg.timings.accepted_tokens = int(t.get("accepted_tokens", 0))
    return msg


def _with_tool_calls(msg: api_pb2.GenerateResponse, stream: ToolStream, d: Delta) -> None:
    """The message's text as content that cannot be a call, and at the end the calls."""
    content, calls, reason = stream.add(d.text, d.finish_reason)
    msg.text = content
    msg.finish_reason = reason or ""
    msg.tool_calls.extend(
        api_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls
    )


async def _abort_with(context: grpc.aio.ServicerContext, e: RouterError) -> None:
    details = (
        f"{e.field}: {e.message}" if e.field and not e.message.startswith(e.field) else e.message
    )
    if e.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", str(int(e.retry_after_s + 0.999))),))
    await context.abort(e.kind.grpc_code, details)


def _timeout_s(request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> float:
    """The request's deadline in seconds from now (0: the router's default): its `timeout_s`
    or the call's own deadline (`grpc-timeout`), whichever is sooner."""
    remaining = context.time_remaining()
    if remaining is None:  # the call has no deadline
        return request.timeout_s
    remaining = max(remaining, MIN_TIMEOUT_S)  # passed already: ends at once, as DEADLINE_EXCEEDED
    return min(request.timeout_s or remaining, remaining)


class TandemServicer(api_pb2_grpc.TandemServicer):
    def __init__(self, router: Router, metrics: RouterMetrics) -> None:
        self.router = router
        self.metrics = metrics

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        try:
            try:
                params = sampling_from_proto(request.sampling)
            except (TypeError, ValueError) as e:
                field = "structured_output" if "structured_output" in str(e) else "sampling"
                raise invalid(str(e), field) from None
            if request.n > MAX_N:
                raise invalid(f"n must be at most {MAX_N}, got {request.n}", "n")
            tool_use = _tool_use(request, self.router.tool_parser)
            prep = await self.router.prepare(
                params if tool_use is None else tool_use.constrain(params),
                model=request.model,
                request_id=request.request_id,
                priority=request.priority,
                timeout_s=_timeout_s(request, context),
                speculative=request.speculative if request.HasField("speculative") else None,
                chat_template=ChatTemplateOptions(
                    tools=tool_use.prompt_tools if tool_use is not None else None
                ),
                **_prepare_args(request),
            )
            choices = request_choices(prep, max(request.n, 1))
            streams = (
                [ToolStream(tool_use) for _ in choices] if tool_use and tool_use.parses else []
            )
            observed = merged(lambda c: self.metrics.observe(c.deltas(self.router)), choices)
            async with contextlib.aclosing(observed) as deltas:
                async for index, delta in deltas:
                    msg = delta_to_proto(prep.request_id, delta, index)
                    if streams:
                        _with_tool_calls(msg, streams[index], delta)
                    yield msg
        except RouterError as e:
            await _abort_with(context, e)

    async def Abort(
        self, request: api_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.AbortResponse:
        return api_pb2.AbortResponse(found=await self.router.abort_anywhere(request.request_id))

    async def ListModels(
        self, request: api_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ListModelsResponse:
        r = self.router
        card = api_pb2.ModelCard(
            id=r.model_name,
            max_model_len=r.max_model_len,
            prefill_workers=len(r.snapshot.workers(model=r.model_name, role="prefill")),
            decode_workers=len(r.snapshot.workers(model=r.model_name, role="decode")),
        )
        return api_pb2.ListModelsResponse(models=[card])


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, router: Router, controller: Any = None) -> None:
        self.router = router
        self.controller = controller  # the Ray pool controller's actor handle, if any

    async def ListWorkers(
        self, request: admin_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListWorkersResponse:
        now = time.time()
        pending, events = [], []
        if self.controller is not None:
            slots = await self.controller.status.remote()
            pending = [
                admin_pb2.PendingWorker(
                    role=s["role"], state=s["state"], reason=s["reason"], age_s=s["age_s"]
                )
                for s in slots
                if s["state"] in ("pending", "starting")
            ]
            events = [
                admin_pb2.ControllerEvent(time_unix=e["time"], role=e["role"], error=e["error"])
                for e in await self.controller.recent_events.remote()
            ]
        return admin_pb2.ListWorkersResponse(
            pending=pending,
            events=events,
            workers=[
                admin_pb2.WorkerInfo(
                    worker_id=w.worker_id,
                    role=w.role,
                    endpoint=w.endpoint,
                    kv_endpoint=w.kv_endpoint,
                    model=w.model,
                    running=w.running,
                    waiting=w.waiting,
                    kv_blocks_total=w.kv_blocks_total,
                    kv_blocks_free=w.kv_blocks_free,
                    draining=w.draining,
                    heartbeat_age_s=now - w.heartbeat_at,
                    metrics_url=w.metrics_url,
                )
                for w in self.router.snapshot.workers()
            ],
        )

    async def Scale(
        self, request: admin_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ScaleResponse:
        if self.controller is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "scaling needs the Ray cluster controller"
            )
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        sizes = await self.controller.scale.remote(prefill, decode)
        return admin_pb2.ScaleResponse(prefill=sizes["prefill"], decode=sizes["decode"])

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainResponse:
        if self.controller is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "draining by RPC needs the Ray cluster controller"
            )
        if not await self.controller.drain.remote(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no serving worker {request.worker_id}")
        return admin_pb2.DrainResponse()


async def build_grpc_server(
    router: Router,
    address: str,
    metrics: RouterMetrics,
    admin_token: str | None = None,
    controller: Any = None,
    readiness_period_s: float = 0.25,
) -> tuple[grpc.aio.Server, int, ReadinessHealth]:
    """The router's gRPC server (public + admin + health + reflection), not yet started, and its
    health's readiness follower (run its `follow()` while the server serves)."""
    tandem_name = api_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
    admin_name = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
    credentials = Credentials.of(router.config.api_key, admin_token)
    auth = BearerInterceptor(
        {tandem_name: credentials.api_key, admin_name: credentials.admin_token}
    )
    server = grpc.aio.server(interceptors=[auth])
    api_pb2_grpc.add_TandemServicer_to_server(TandemServicer(router, metrics), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(router, controller), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [tandem_name, admin_name, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    await health_servicer.set(admin_name, health_pb2.HealthCheckResponse.SERVING)
    readiness = ReadinessHealth(router, health_servicer, [tandem_name], readiness_period_s)
    await readiness.update()
    return server, port, readiness
