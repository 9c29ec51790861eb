"""Structured request logs: one line per request, tied to an ``x-request-id``.

Every request gets an id: the client's own ``x-request-id`` when it sends a
sane one (1-128 characters of ``[A-Za-z0-9._:-]``, so that a header cannot
forge log lines), else a fresh random one. The id is

* returned in the response header ``x-request-id`` (streams included: it is
  set in ``on_response_prepare``, before the headers leave),
* forwarded to the engine as ``x-request-id`` (vLLM and SGLang log it), and
* a field of the request's log line.

The ``/v1`` requests log one line each on the ``tailguard.request`` logger
when they end: info for answers, warning for 5xx and client disconnects
(``499``), with the node, the pool, TTFT, output tokens, end-to-end time and,
for failures, the failure's origin (an :class:`~tailguard.core.fleet.Outcome`
value, or ``no_capacity``). Other routes (``/metrics``, the dashboard's state
polls) log at debug level only.

The proxy adds what it knows through :func:`note` (a dict update: the hot
path pays no formatting); the line is formatted only when the logger is on.

Two formats (``tailguard serve --log-format text|json``)::

    2026-11-29T21:30:00.123Z INFO tailguard.request: POST /v1/chat/completions 200 id=3f2a... node=h100-0 pool=llama-3.1-8b ttft_s=0.084 tokens=120 e2e_s=1.912
    {"ts": "2026-11-29T21:30:00.123Z", "level": "info", "logger": "tailguard.request", "msg": "POST /v1/chat/completions 200", "id": "3f2a...", "node": "h100-0", ...}
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import time
from contextvars import ContextVar
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from tailguard.adapters.api_errors import NODE_HEADER

REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED = 499

log = logging.getLogger("tailguard.request")

_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# Request ids: a random per-process prefix and a counter. Unique across
# restarts and replicas like a UUID, at a fifth of uuid4's cost (0.7 vs 3.5 us here).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class RequestLog:
    """The current request's id and the fields of its log line."""

    __slots__ = ("fields", "id")

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.fields: dict[str, Any] = {}


# A context variable, not the request's mapping: the middleware, the proxy and
# the response-prepare signal all run in the request's task, and aiohttp's
# typed request keys only exist in its newest releases.
_CURRENT: ContextVar[RequestLog | None] = ContextVar("tailguard_request_log", default=None)


def request_id() -> str:
    """The current request's id (a fresh one outside :func:`request_log`)."""
    cur = _CURRENT.get()
    if cur is None:
        cur = RequestLog(new_request_id())
        _CURRENT.set(cur)
    return cur.id


def note(**fields: Any) -> None:
    """Add fields to the current request's log line (pool, ttft_s, tokens, origin...)."""
    cur = _CURRENT.get()
    if cur is not None:
        cur.fields.update(fields)


@web.middleware
async def request_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request its id and log one line when it ends."""
    given = request.headers.get(REQUEST_ID_HEADER)
    cur = RequestLog(given if given and _SANE_ID.fullmatch(given) else new_request_id())
    _CURRENT.set(cur)
    t0 = time.monotonic()
    status = 500
    node: str | None = None
    try:
        resp = await handler(request)
        status = resp.status
        node = resp.headers.get("x-tailguard-node")
        if not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = cur.id
        return resp
    except web.HTTPException as exc:
        status = exc.status
        exc.headers[REQUEST_ID_HEADER] = cur.id
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        _emit(request, cur, status, node, time.monotonic() - t0)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: streams prepared inside the handler carry the id too, and
    no browser sniffs a type into what the gateway writes itself (a node id or a model
    name echoed in a JSON error must never run as HTML). An engine's own answer,
    relayed (a 2xx naming its node), goes as the engine typed it."""
    headers = response.headers
    cur = _CURRENT.get()
    if cur is not None and REQUEST_ID_HEADER not in headers:
        headers[REQUEST_ID_HEADER] = cur.id
    if response.status >= 400 or NODE_HEADER not in headers:
        headers["X-Content-Type-Options"] = "nosniff"


def _emit(request: web.Request, cur: RequestLog, status: int, node: str | None,
          e2e: float) -> None:
    proxied = request.path.startswith("/v1/")
    level = logging.INFO if proxied else logging.DEBUG
    if proxied and (status >= 500 or status == CLIENT_CLOSED):
        level = logging.WARNING
    if not log.isEnabledFor(level):
        return
    fields: dict[str, Any] = {"id": cur.id}
    if node and node != "-":
        fields["node"] = node
    fields.update(cur.fields)
    fields["e2e_s"] = round(e2e, 4)
    log.log(level, "%s %s %d", request.method, request.path, status,
            extra={"fields": fields})


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...`` (values with spaces are quoted)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _iso(record.created)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` and the fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": _iso(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Root logging for ``tailguard serve``: ``fmt`` is ``text`` or ``json``.

    Like :func:`logging.basicConfig`, it leaves a root logger that already has
    handlers alone (an embedding program's, or pytest's), setting only the level.
    """
    root = logging.getLogger()
    root.setLevel(getattr(logging, level.upper()))
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)


def _iso(created: float) -> str:
    t = time.gmtime(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(created % 1 * 1000):03d}Z"


def _text_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return json.dumps(s) if (" " in s or '"' in s or not s) else s


__all__ = ["REQUEST_ID_HEADER", "JsonFormatter", "RequestLog", "TextFormatter", "add_request_id_header",
           "configure_logging", "note", "request_id", "request_log"]
