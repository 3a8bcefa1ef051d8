"""The HTTP layer under the app: aiohttp's own protocol errors in OpenAI's shape, a cap on open
connections, and the connection timeouts.

aiohttp answers a request it cannot parse (a bad request line or header, a line over 8190 bytes, a
bad chunk size) inside its protocol handler, before routing or middleware, with a text/plain body and
a logged traceback, and offers no hook for it (aio-libs/aiohttp#3287). So `LimitedAppRunner` makes
its server build `_Protocol`, whose `handle_error` answers those in OpenAI's error shape, and whose
`log_exception` keeps a client's malformed bytes out of the error log. The same server refuses a
connection past `max_connections` with a 503 before reading from it.

Timeouts: aiohttp's keep-alive timer runs from the moment a connection opens or its last response
ends until the next request head is complete, so `keep_alive_timeout` bounds both an idle
connection and a client that sends its headers slowly. The body has its own bound (server/body.py).
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from vlm_sdk.server.body import one_line
from vlm_sdk.server.protocol import APIError

logger = logging.getLogger("vlm_sdk.server")

# after answering a request whose body was not read (401, 413 up front, 408), aiohttp reads and drops
# what the client still sends, so that closing does not reset the connection before the client has
# read the answer; this bounds that time (aiohttp's default is 10 s)
_LINGER_S = 2.0


def _busy_response(limit: int) -> bytes:
    body = json.dumps(APIError(503, f"this server has {limit} connections open, its limit (server setting "
                                    f"--max-connections); retry shortly", "server_error", None,
                               "too_many_connections").body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Protocol(web.RequestHandler):
    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            err = APIError(status, "internal server error; the request was not completed (details are in the "
                                   "server log)", "server_error", None, "internal_error")
        else:
            # aiohttp's message points at the bad byte with a caret line; one line of text reads better
            text = " ".join(line for line in (message or "unparsable").splitlines() if line.strip() != "^")
            err = APIError(status, f"malformed HTTP request: {one_line(text)}", "invalid_request_error", None,
                           "malformed_request")
        if request.writer.output_size > 0:  # as aiohttp's: a response has begun, the connection is broken
            raise ConnectionError("response already started; cannot send the error")
        if self._manager is not None:  # None once the connection is lost
            self._manager.on_error(err.status)
        resp = web.json_response(err.body(), status=err.status)
        resp.force_close()
        return resp

    def log_exception(self, *args, **kw) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError, ConnectionError)):
            logger.debug("malformed request or lost client: %r", exc)  # the client's bytes, not our fault
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    """aiohttp's server with our protocol and a cap on open connections."""

    def __init__(self, *args, max_connections: int, on_error: Callable[[int], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.on_error = on_error
        self._busy = _busy_response(max_connections)

    def __call__(self) -> web.RequestHandler:
        return _Protocol(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: web.RequestHandler, transport) -> None:
        if len(self._connections) >= self.max_connections:
            # answered before reading: an overloaded server must not spend a parse on it
            transport.write(self._busy)
            transport.close()
            self.on_error(503)
            return
        super().connection_made(handler, transport)


class LimitedAppRunner(web.AppRunner):
    """An AppRunner whose server is `_Server`: same application, same handler settings."""

    def __init__(self, app: web.Application, *, max_connections: int, keep_alive_timeout: float,
                 on_error: Callable[[int], None], **kwargs):
        super().__init__(app, keepalive_timeout=keep_alive_timeout, lingering_time=_LINGER_S, **kwargs)
        self._limits = {"max_connections": max_connections, "on_error": on_error}

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts and freezes the app, as AppRunner does
        return _Server(plain.request_handler, request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                       **self._limits, **plain._kwargs)
