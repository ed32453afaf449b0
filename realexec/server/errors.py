"""What can go wrong with a request, as values: the engine side raises these (or hands
them to a stream), the HTTP side turns any of them into one OpenAI-shaped error body.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

`code` is also the `reason` label of `twinserve:request_rejected_total`, so every
refusal is counted under a small fixed set of names (REJECTION_CODES).
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from core import InvalidRequestError

# Every code an error response can carry (the /metrics reason labels).
REJECTION_CODES = (
    "invalid_value", "invalid_json", "invalid_encoding", "unsupported_media_type", "invalid_api_key",
    "model_not_found", "not_found", "method_not_allowed", "request_too_large", "context_length_exceeded",
    "queue_full", "shutting_down", "engine_dead", "engine_sleeping", "sleep_refused", "request_timeout",
    "body_read_timeout",
    "client_closed_request", "internal_error",
)


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-waiting-requests allows (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed); no request can be served (HTTP 503)."""


class ShuttingDownError(RuntimeError):
    """The server is draining for shutdown: new requests are refused, and what is still
    running when --shutdown-timeout passes is aborted with this error (HTTP 503)."""


class RequestTimeoutError(RuntimeError):
    """The request ran longer than --request-timeout and was aborted (HTTP 408)."""


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An HTTP error answer: status + OpenAI error fields (+ headers such as Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str = "invalid_value", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def as_api_error(e: BaseException, default_param: str | None = None,
                 prompt_param: str = "prompt") -> APIError:
    """The answer for any error a request can meet. `prompt_param` renames "prompt"
    (chat requests call it "messages")."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        param = e.param or default_param
        return APIError(400, str(e), param=prompt_param if param == "prompt" else param, code="invalid_value")
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), type="server_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, ShuttingDownError):
        return APIError(503, str(e), type="server_error", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), type="server_error", code="engine_dead")
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), type="timeout_error", code="request_timeout")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error")
