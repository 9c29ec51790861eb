"""The lean upstream client against raw HTTP servers on 127.0.0.1 (real sockets).

Each server is an ``asyncio`` stream server whose answers are written byte
for byte by the test, so framing (Content-Length, chunked, close-delimited),
keep-alive, 1xx, malformed answers and closed connections are all exercised.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from multidict import CIMultiDict

from tailguard.adapters.upstream import (
    HIGH_WATER,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
HEADERS: CIMultiDict[str] = CIMultiDict({"Content-Type": "application/json", "X-Custom": "1"})


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: its head and its body (Content-Length framed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port; yields its URL and the connection counter."""
    conns = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            await handler(reader, writer, conns[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", conns
    finally:
        srv.close()
        await srv.wait_closed()


def keepalive(answer: bytes, seen: list[bytes] | None = None) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            head, body = await read_request(reader)
            if seen is not None:
                seen.append(head + body)
            writer.write(answer)
            await writer.drain()

    return handle


OK_BODY = b'{"ok": 1}'
OK_JSON = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
           % (len(OK_BODY), OK_BODY))


def test_content_length_keepalive_reuses_one_connection() -> None:
    async def body() -> None:
        seen: list[bytes] = []
        async with server(keepalive(OK_JSON, seen)) as (url, conns):
            client = UpstreamClient()
            for i in range(5):
                resp = await client.post(url + "/v1/chat/completions?x=1", HEADERS,
                                         b'{"n": %d}' % i)
                assert resp.status == 200
                assert resp.content_type == "application/json"
                assert await resp.read() == OK_BODY
                resp.release()
            assert conns[0] == 1  # every request on the same keep-alive connection
            first = seen[0]
            assert first.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
            assert b"\r\nX-Custom: 1\r\n" in first and b"Content-Length: 8\r\n" in first
            assert b"Host: 127.0.0.1:" in first and first.endswith(b'{"n": 0}')
            client.close()

    asyncio.run(body())


def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    gate = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        await gate.wait()  # the client must get the first chunk before the rest exists
        writer.write(b"5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def body() -> None:
        async with server(handle) as (url, _):
            client = UpstreamClient()
            resp = await client.post(url + "/s", HEADERS, b"{}")
            assert resp.content_type == "text/event-stream"
            assert await resp.readany() == b"data: "
            gate.set()
            rest = await resp.read()
            assert rest == b"hello"
            assert await resp.readany() == b""
            resp.release()
            assert len(client._pools) == 1 and len(next(iter(client._pools.values())).idle) == 1
            client.close()

    asyncio.run(body())


def test_close_delimited_body_and_connection_close_are_not_reused() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async def body() -> None:
        async with server(handle) as (url, conns):
            client = UpstreamClient()
            for _ in range(2):
                resp = await client.post(url + "/", HEADERS, b"")
                assert await resp.read() == b"until the end"
                resp.release()
            assert conns[0] == 2
            client.close()

    asyncio.run(body())


def test_bytes_nobody_asked_for_make_the_connection_unusable() -> None:
    # Half of an answer nobody asked for, while the connection is idle: reused,
    # the next request's answer would be read as the rest of it.
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nst"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(OK_JSON)
        await writer.drain()
        if n == 1:  # the first connection misbehaves
            await asyncio.sleep(0.02)
            writer.write(stray)
            await writer.drain()
        await keepalive(OK_JSON)(reader, writer, n)

    async def body() -> None:
        async with server(handle) as (url, conns):
            client = UpstreamClient()
            for _ in range(3):
                resp = await client.post(url + "/", HEADERS, b"{}")
                assert resp.status == 200 and await resp.read() == OK_BODY
                resp.release()
                await asyncio.sleep(0.1)
            assert conns[0] == 2  # the out-of-step connection was closed, the next one reused
            client.close()

    asyncio.run(body())


def test_informational_answer_is_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + OK_JSON
    async def body() -> None:
        async with server(keepalive(answer)) as (url, _):
            client = UpstreamClient()
            resp = await client.post(url + "/", HEADERS, b"{}")
            assert resp.status == 200 and await resp.read() == OK_BODY
            resp.release()
            client.close()

    asyncio.run(body())


def test_idle_connection_closed_by_server_is_retried_once_on_a_new_one() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(OK_JSON)
        await writer.drain()
        if n == 1:  # the first connection closes right after its answer (keep-alive ended)
            await asyncio.sleep(0.05)
            return
        await keepalive(OK_JSON)(reader, writer, n)

    async def body() -> None:
        async with server(handle) as (url, conns):
            client = UpstreamClient()
            resp = await client.post(url + "/", HEADERS, b"{}")
            await resp.read()
            resp.release()
            await asyncio.sleep(0.2)  # the server has closed the idle connection by now
            resp = await client.post(url + "/", HEADERS, b"{}")
            assert resp.status == 200 and await resp.read() == OK_BODY
            resp.release()
            assert conns[0] == 2
            client.close()

    asyncio.run(body())


def test_disconnect_mid_answer_raises_and_nothing_is_reused() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n4\r\ndata\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def body() -> None:
        async with server(handle) as (url, _):
            client = UpstreamClient()
            resp = await client.post(url + "/", HEADERS, b"{}")
            assert await resp.readany() == b"data"
            with pytest.raises(UpstreamDisconnected):
                await resp.readany()
            resp.release()
            assert all(not p.idle for p in client._pools.values())
            client.close()

    asyncio.run(body())


def test_server_that_closes_without_answer_and_malformed_answer() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def body() -> None:
        client = UpstreamClient()
        async with server(silent) as (url, _):
            with pytest.raises(UpstreamDisconnected):
                await client.post(url + "/", HEADERS, b"{}")
        async with server(garbage) as (url, _):
            with pytest.raises(UpstreamProtocolError):
                await client.post(url + "/", HEADERS, b"{}")
        client.close()

    asyncio.run(body())


def test_header_with_a_line_break_is_refused_before_sending() -> None:
    async def body() -> None:
        seen: list[bytes] = []
        async with server(keepalive(OK_JSON, seen)) as (url, conns):
            client = UpstreamClient()
            bad = CIMultiDict({"Authorization": "Bearer x\r\nX-Injected: 1"})
            with pytest.raises(UpstreamError, match="line break"):
                await client.post(url + "/", bad, b"{}")
            await asyncio.sleep(0.05)
            assert seen == [] and conns[0] == 0
            client.close()

    asyncio.run(body())


def test_connect_refused_and_connect_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused

        async def body() -> None:
            client = UpstreamClient()
            with pytest.raises(UpstreamConnectError, match="cannot connect"):
                await client.post(f"http://127.0.0.1:{port}/", HEADERS, b"{}", 1.0)
            with pytest.raises(UpstreamConnectError, match="not an http"):
                await client.post("ftp://127.0.0.1/", HEADERS, b"{}")
            # A listener with a full backlog never completes the handshake in time
            # on every system, so the timeout is checked with a tiny bound instead.
            with pytest.raises(UpstreamConnectError):
                await client.post(f"http://127.0.0.1:{port}/", HEADERS, b"{}", 1e-9)
            client.close()

        asyncio.run(body())


def test_cancelled_request_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await reader.read()  # returns when the client closes the connection
        closed.set()

    async def body() -> None:
        async with server(slow) as (url, _):
            client = UpstreamClient()
            task = asyncio.ensure_future(client.post(url + "/", HEADERS, b"{}"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(closed.wait(), 5)
            assert all(not p.idle for p in client._pools.values())
            client.close()

    asyncio.run(body())


def test_slow_reader_pauses_the_engine_side() -> None:
    total = 64 * HIGH_WATER  # well past what the kernel's socket buffers absorb
    sent = [0]

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()
            sent[0] += len(block)
        await asyncio.sleep(1)

    async def body() -> None:
        async with server(big) as (url, _):
            client = UpstreamClient()
            resp = await client.post(url + "/", HEADERS, b"{}")
            await asyncio.sleep(0.5)  # nobody reads: the client stops reading the socket
            conn = resp._conn
            assert conn is not None and conn.paused
            assert sent[0] < total  # the engine side is held back too
            got = len(await resp.read())
            assert got == total
            resp.release()
            client.close()

    asyncio.run(body())


def test_idle_connections_are_reaped_after_the_keepalive_time() -> None:
    """An idle pool must not hold sockets to a node for ever (they were never reaped)."""

    async def body() -> None:
        closed: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         n: int) -> None:
            try:
                await keepalive(OK_JSON)(reader, writer, n)
            finally:
                closed.append(n)

        async with server(handle) as (url, conns):
            client = UpstreamClient(keepalive_s=0.3)
            # three connections at once, then all idle
            answers = await asyncio.gather(*(client.post(url + "/x", HEADERS, b"{}")
                                             for _ in range(3)))
            for resp in answers:
                await resp.read()
                resp.release()
            pool = client.pool_for(url)
            assert pool is not None and len(pool.idle) == 3 and conns[0] == 3
            await asyncio.sleep(0.8)
            assert pool.idle == []  # reaped without any new request
            for _ in range(20):
                if len(closed) == 3:
                    break
                await asyncio.sleep(0.05)
            assert sorted(closed) == [1, 2, 3]  # and the server saw them close
            client.close()

    asyncio.run(body())
