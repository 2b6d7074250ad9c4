"""Who may call what: the API key on the public APIs, the admin token on the admin APIs.

Both are bearer secrets (`Authorization: Bearer <secret>`, gRPC metadata `authorization`), and
either may be unset, which leaves its APIs open. HTTP denies by default: every route needs the API
key except the probes and the version (`OPEN_PATHS`) and the admin routes, which need the admin
token. gRPC: `tandem.v1.Tandem` needs the API key and `tandem.v1.Admin` the admin token; health
and reflection stay open, for probes and stock tools.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
ADMIN_PREFIX = "/admin/"


@dataclass(frozen=True)
class Credential:
    """The bearer secret one API needs, and its name in error messages; `secret=None`: open."""

    secret: str | None
    name: str  # "API key" | "admin token"

    def refusal(self, authorization: str | None) -> str | None:
        """Why a call with this `authorization` header is refused; None when it may proceed."""
        if self.secret is None:
            return None
        if not authorization:
            return f"{self.name} required: send the header 'Authorization: Bearer <{self.name}>'"
        scheme, _, given = authorization.partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.secret.encode()
        ):
            return None
        return f"invalid {self.name}"


@dataclass(frozen=True)
class Credentials:
    api_key: Credential
    admin_token: Credential

    @classmethod
    def of(cls, api_key: str | None, admin_token: str | None) -> Credentials:
        return cls(Credential(api_key, "API key"), Credential(admin_token, "admin token"))

    def for_path(self, path: str) -> Credential | None:
        """What an HTTP route needs; None: nothing."""
        if path in OPEN_PATHS:
            return None
        return self.admin_token if path.startswith(ADMIN_PREFIX) else self.api_key


class BearerMiddleware:
    """ASGI middleware: a call to a route that needs a credential it lacks gets `deny(reason)`
    (401) and never reaches the route. Plain ASGI rather than Starlette's BaseHTTPMiddleware,
    which would wrap every streamed response."""

    def __init__(
        self, app: ASGIApp, credentials: Credentials, deny: Callable[[str], Response]
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.deny = deny

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            credential = self.credentials.for_path(scope["path"])
            authorization = Headers(scope=scope).get("authorization")
            reason = None if credential is None else credential.refusal(authorization)
            if reason is not None:
                response = self.deny(reason)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# grpc's handler factory for each (request streaming, response streaming)
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """gRPC: a call to a service in `services` (full name -> credential) without that credential
    ends UNAUTHENTICATED before its servicer runs; other services pass."""

    def __init__(self, services: Mapping[str, Credential]) -> None:
        self.services = services

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.split("/")[1]  # "/package.Service/Method"
        credential = self.services.get(service)
        if handler is None or credential is None:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        reason = credential.refusal(metadata.get("authorization"))
        if reason is None:
            return handler

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        kind = _HANDLER_KINDS[handler.request_streaming, handler.response_streaming]
        return kind(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
