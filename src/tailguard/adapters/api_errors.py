"""Errors in OpenAI's shape: ``{"error": {"message", "type", "code"}}``.

The official clients turn the status into a typed exception
(``BadRequestError`` for 400, ``NotFoundError`` for 404, ...) and show
``message``; ``code`` is a stable machine-readable name documented in
``docs/gateway.md``. Inside a stream that already started, the same body is
sent as one SSE event, ``data: {"error": ...}``, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

NODE_HEADER = "x-tailguard-node"
# A disaggregated request's answer also names the node that computed its prompt and
# the seconds that leg took (tailguard bench reads them).
PREFILL_NODE_HEADER = "x-tailguard-prefill-node"
PREFILL_TIME_HEADER = "x-tailguard-prefill-s"
NO_NODE = "-"  # the header's value when no node served the request

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error")


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """``param`` names the request field at fault, as OpenAI's own errors do."""
    return json.dumps(
        {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
    ).encode()


def error_response(
    status: int,
    message: str,
    code: str,
    node: str = NO_NODE,
    headers: Mapping[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    """A JSON error response; ``node`` fills the ``x-tailguard-node`` header."""
    hdrs = {NODE_HEADER: node}
    if headers:
        hdrs.update(headers)
    return web.Response(status=status, body=error_body(status, message, code, param),
                        content_type="application/json", headers=hdrs)


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The event that ends a stream whose upstream failed after it started."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
