"""The router's typed errors and how each API spells them (gRPC status, HTTP status)."""

from __future__ import annotations

import enum

import grpc


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404, "not_found_error")
    OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")
    DEADLINE = (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout")
    CANCELLED = (grpc.StatusCode.CANCELLED, 499, "client_closed_request")  # nobody reads it
    UNAUTHORIZED = (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error")
    UNIMPLEMENTED = (grpc.StatusCode.UNIMPLEMENTED, 501, "not_implemented")
    INTERNAL = (grpc.StatusCode.INTERNAL, 500, "internal_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


class RouterError(Exception):
    """An error the client sees. `field` names the offending request field, if one is."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s


def invalid(message: str, field: str | None = None) -> RouterError:
    """INVALID_ARGUMENT; the field defaults to the message's first word ("max_tokens must...")."""
    if field is None:
        head = message.split(" ", 1)[0]
        field = head if head.replace("_", "").isalpha() else None
    return RouterError(ErrorKind.INVALID_ARGUMENT, message, field)
