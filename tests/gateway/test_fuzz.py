"""Fuzzing the gateway on a real socket (issue 11): OpenAI bodies and raw HTTP.

A gateway in front of two fake engines runs in a thread with its own event
loop for the whole module; hypothesis sends it requests with the standard
library's blocking client (or a raw socket), so each example is a real HTTP
exchange. The rules:

* a client mistake is never a 5xx: a 2xx answer, or a 4xx with an
  OpenAI-shaped JSON error body;
* nothing a client sends changes a node's state or charges it a failure;
* afterwards nothing is in flight and a normal request is still served.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from gateway_fakes import FakeEngine, fleet_doc
from hypothesis import HealthCheck, given, settings, strategies as st

from tailguard.config.fleet import parse_fleet
from tailguard.core.fleet import NodeState
from tailguard.gateway.app import RunningGateway, run_gateway

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


class Served:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.gw: RunningGateway | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        engines = [await FakeEngine(n).start() for n in ("a", "b")]
        try:
            cfg = parse_fleet(fleet_doc(engines, max_body_bytes=64 << 10,
                                        client={"header_timeout_s": 2.0, "body_timeout_s": 2.0}))
            async with run_gateway(cfg) as gw:
                self.gw = gw
                self.ready.set()
                await self.stop.wait()
        finally:
            for e in engines:
                await e.stop()

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the gateway's loop (its state is the loop's)."""
        async def inner() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(inner(), self.loop).result(5)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    s.thread.start()
    assert s.ready.wait(15)
    yield s
    assert s.stop is not None
    s.loop.call_soon_threadsafe(s.stop.set)
    s.thread.join(15)


def request(served: Served, body: bytes, headers: dict[str, str] | None = None,
            path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    assert served.gw is not None
    conn = http.client.HTTPConnection("127.0.0.1", served.gw.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check_answer(status: int, raw: bytes) -> None:
    assert status < 500, (status, raw[:300])
    if status >= 400:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["code"], str)


def check_fleet(served: Served) -> None:
    def state() -> list[tuple[str, str, int, int]]:
        assert served.gw is not None
        b = served.gw.fleet.balancer
        assert b.outliers is not None
        return [(n.id, n.state.value, n.in_flight, b.outliers.health[n.id].failures)
                for n in b.nodes.values()]

    for node_id, st_, in_flight, failures in served.call(state):
        assert (st_, in_flight, failures) == (NodeState.HEALTHY.value, 0, 0), node_id


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)

MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "", "x"]) | JSON},
    optional={"content": st.text() | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text() | JSON})) | JSON})

CHAT_BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "nope", ""]) | JSON,
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "stream": st.booleans() | JSON,
        "max_tokens": st.integers(-3, 8) | JSON,
        "max_completion_tokens": st.integers(-3, 8),
        "stream_options": st.just({"include_usage": True}) | JSON,
        "temperature": JSON,
        "x-extra": JSON,
    })


@SETTINGS
@given(body=CHAT_BODY)
def test_openai_bodies(served: Served, body: dict[str, Any]) -> None:
    status, raw = request(served, json.dumps(body).encode())
    check_answer(status, raw)
    if status == 200 and body.get("stream") is True:
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]


@SETTINGS
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]))
def test_arbitrary_bytes_as_body(served: Served, raw: bytes, path: str) -> None:
    check_answer(*request(served, raw, path=path))


def _encode(body: bytes, how: str) -> tuple[bytes, dict[str, str]]:
    if how == "gzip":
        return gzip.compress(body), {"Content-Encoding": "gzip"}
    if how == "deflate":
        return zlib.compress(body), {"Content-Encoding": "deflate"}
    if how == "garbage-gzip":
        return b"\x1f\x8b" + body[:20], {"Content-Encoding": "gzip"}
    if how == "unknown":
        return body, {"Content-Encoding": "snappy"}
    return body, {}


TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
HEADER_NAME = st.text(alphabet=TCHAR, min_size=1, max_size=12)  # RFC 9110 token
HEADER_VALUE = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@SETTINGS
@given(encoding=st.sampled_from(["none", "gzip", "deflate", "garbage-gzip", "unknown"]),
       chunks=st.lists(st.integers(1, 64), min_size=1, max_size=6),
       chunked=st.booleans(),
       extra=st.dictionaries(HEADER_NAME, HEADER_VALUE, max_size=4),
       stream=st.booleans())
def test_raw_http_framing_and_encodings(served: Served, encoding: str, chunks: list[int],
                                        chunked: bool, extra: dict[str, str],
                                        stream: bool) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 3, "stream": stream}).encode()
    data, headers = _encode(body, encoding)
    skip = {"content-length", "transfer-encoding", "content-encoding", "host", "connection",
            "expect", "upgrade"}
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: x", b"Connection: close"]
    lines += [f"{k}: {v}".encode() for k, v in {**extra, **headers}.items()
              if k.lower() not in skip or k in headers]
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
        payload, i = b"", 0
        for size in chunks:
            piece = data[i:i + size]
            i += size
            if piece:
                payload += b"%x\r\n%s\r\n" % (len(piece), piece)
        if i < len(data):
            payload += b"%x\r\n%s\r\n" % (len(data) - i, data[i:])
        payload += b"0\r\n\r\n"
    else:
        lines.append(b"Content-Length: %d" % len(data))
        payload = data
    assert served.gw is not None
    with socket.create_connection(("127.0.0.1", served.gw.port), timeout=10) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + payload)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert status < 500, answer[:400]
    if encoding in ("none", "gzip", "deflate"):
        assert status == 200, answer[:400]
    else:
        assert status in (400, 415), answer[:400]
    del rest


@SETTINGS
@given(junk=st.binary(min_size=1, max_size=200))
def test_garbage_instead_of_http(served: Served, junk: bytes) -> None:
    assert served.gw is not None
    with socket.create_connection(("127.0.0.1", served.gw.port), timeout=10) as sock:
        sock.sendall(junk + b"\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    if answer:
        status = int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/") else 400
        assert status < 500, answer[:300]


def test_after_the_fuzzing_the_fleet_is_untouched(served: Served) -> None:
    status, raw = request(served, json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "still there?"}], "max_tokens": 2}).encode())
    assert status == 200, raw
    check_fleet(served)
