"""The client's typed errors: an HTTP error raises the `APIError` subclass of its status."""
from __future__ import annotations

from typing import Any

from vlm_sdk.errors import VLMError


class APIError(VLMError):
    """The server answered with an error. `status` is the HTTP status (for an error sent inside a
    stream, the status its type implies); `type`, `code` and `param` are the fields of the OpenAI
    error object, or None."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | None = None, param: str | None = None):
        super().__init__(f"{message} (HTTP {status})" if status else message)
        self.message, self.status, self.type, self.code, self.param = message, status, type, code, param


class BadRequestError(APIError):
    """400: the request is malformed or a value is out of range; `param` names the field when known."""


class ContextLengthExceededError(BadRequestError):
    """400 with code "context_length_exceeded": the prompt can never fit the server's KV cache, or the prompt
    and max_tokens together exceed its context (max_model_len)."""


class AuthenticationError(APIError):
    """401: missing or wrong API key."""


class NotFoundError(APIError):
    """404: unknown model or path."""


class RequestTooLargeError(APIError):
    """413: the request body is over the server's max_request_bytes."""


class ServerError(APIError):
    """5xx: the server failed (503: not ready or shutting down)."""


class APIConnectionError(APIError):
    """No answer: the connection was refused or dropped, or a timeout expired (`status` is None)."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 413: RequestTooLargeError}
# an error inside a 200 stream carries no status; its type says which one it would have had
_STATUS_OF_TYPE = {"invalid_request_error": 400, "BadRequestError": 400, "authentication_error": 401,
                   "not_found_error": 404, "NotFoundError": 404}


def error_from(status: int | None, error: Any, raw: str = "") -> APIError:
    """The typed error for an HTTP status and an OpenAI error object (`{"message", "type", "param",
    "code"}`); a missing or non-dict object gives a message from the status and the raw body."""
    if not isinstance(error, dict):
        return _cls(status, None)(f"HTTP {status}: {raw[:200]}" if raw else f"HTTP {status} with no body",
                                  status=status)
    code = error.get("code")
    if status is None:
        status = code if isinstance(code, int) else _STATUS_OF_TYPE.get(error.get("type"), 500)
    code = None if code is None else str(code)
    return _cls(status, code)(str(error.get("message") or raw[:200] or "no message"), status=status,
                              type=error.get("type"), code=code, param=error.get("param"))


def _cls(status: int | None, code: str | None) -> type[APIError]:
    if status == 400 and code == "context_length_exceeded":
        return ContextLengthExceededError
    if status is not None and status >= 500:
        return ServerError
    return _BY_STATUS.get(status, APIError)
