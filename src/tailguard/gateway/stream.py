"""A committed stream, relayed to the client, and moved to another node when the
exchange says so (mid-stream migration).

:class:`StreamRelay` copies the upstream's chunks to the client as they come:
per chunk it counts ``data:`` events (:class:`~tailguard.adapters.sse.SseCounter`),
notes the gap since the previous one and pushes the idle deadline; it never
parses a chunk's JSON. While the stream may move (the pool's migration is on
and the request can be continued), it also

* relays whole events only (a partial event waits for the rest of it, so the
  client never holds half an event when another node takes over), and holds
  back an engine's own error event instead of relaying it;
* runs the stall clock: no chunk for :meth:`Exchange.stall_after` and the
  exchange is asked (:meth:`Exchange.review`) whether the stream moves; it is
  asked too at each progress report (its node may have been quarantined).

A move (:class:`~tailguard.core.exchange.Migrate`) sends the continuation
(:mod:`tailguard.adapters.splice`) and, where the stalled copy still runs,
races them: the stalled copy's next chunk wins (:meth:`Exchange.resumed`) and
the continuation is cancelled, or the continuation's first chunk wins and the
stalled copy is cancelled. A stream moved because its node left healthy
service never goes back: the old copy's next chunk is dropped and the old copy
ended. The winner's bytes are then relayed, the
continuation's rewritten into the original stream's events. A failure,
whether of a stream or of a continuation, goes to the exchange, which answers
with another move or the end (an SSE error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tailguard.adapters.api_errors import sse_error_event
from tailguard.adapters.logs import CLIENT_CLOSED, note
from tailguard.adapters.metrics import GatewayMetrics
from tailguard.adapters.openai_request import CHAT
from tailguard.adapters.splice import (
    CONTINUES_CHAT,
    Relayed,
    Rewriter,
    continuation_body,
    moved_comment,
)
from tailguard.adapters.sse import SseCounter
from tailguard.adapters.upstream import UpstreamError, UpstreamResponse
from tailguard.config.fleet import NodeConfig
from tailguard.core.exchange import COMMITTED, Action, Copy, Exchange, Fail, Failure, Migrate
from tailguard.core.fleet import STALL_S, Outcome
from tailguard.gateway.call import Call, count_answer, response_headers
from tailguard.gateway.idle import IdleTimeout
from tailguard.gateway.race import Answer, stop_attempt

# An engine's own error event (data: {"error": ...}); text cannot fake one (its
# quotes and newlines are escaped inside the JSON strings of other events).
_ERROR_EVENT = re.compile(rb'(^|\n)data:\s*\{\s*"error"\s*:')

Send = Callable[[Copy, bytes], Awaitable["Failure | Answer"]]


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class _Moved(Exception):
    """A progress report made the exchange move the stream."""

    def __init__(self, move: Migrate) -> None:
        super().__init__(move.cause)
        self.move = move


class Source:
    """One node's stream that the client's answer comes from."""

    __slots__ = ("copy", "counter", "held", "node", "resp", "rewriter")

    def __init__(self, copy: Copy, resp: UpstreamResponse, node: NodeConfig,
                 rewriter: Rewriter | None = None) -> None:
        self.copy = copy
        self.resp = resp
        self.node = node
        self.counter = SseCounter()
        self.rewriter = rewriter
        self.held = b""  # an engine error event held back from the client


def _move_of(actions: tuple[Action, ...]) -> Migrate | None:
    for a in actions:
        if type(a) is Migrate:
            return a
    return None


class StreamRelay:
    """Relays one committed stream (and its continuations) to the client."""

    def __init__(self, ex: Exchange, call: Call, metrics: GatewayMetrics, send: Send,
                 engine_of: Callable[[str], str | None], node_of: Callable[[str], NodeConfig],
                 write_s: float) -> None:
        self.ex = ex
        self.call = call
        self.metrics = metrics
        self.send = send  # POSTs a body for a copy: its answer with the first chunk, or failure
        self.engine_of = engine_of
        self.node_of = node_of
        self.write_s = write_s
        self.chat = call.endpoint == CHAT
        # Whole events only, and the stall clock, while the stream may move.
        self.relayed: Relayed | None = Relayed() if ex.migration is not None else None
        self.before = 0  # answer tokens the client got from earlier sources
        self.t_first = 0.0
        self.last = 0.0  # when the last chunk arrived, and the longest gap between two
        self.max_gap = 0.0
        self.protocol = call.request.protocol
        self.pauses = getattr(self.protocol, "write_pauses", 0)
        self.sources: list[Source] = []

    # -- the whole stream -------------------------------------------------------------

    async def run(self, src: Source, first: bytes, t_first: float) -> web.StreamResponse:
        call, ex = self.call, self.ex
        model = call.req.model
        self.sources.append(src)
        out = web.StreamResponse(status=src.resp.status,
                                 headers=response_headers(src.resp, src.node.id, call.prefill))
        self.t_first = self.last = t_first
        try:
            await out.prepare(call.request)
            data = self._emit(src, first)
            if data:
                await out.write(data)
        except ConnectionError:
            return self._gone(src, out)
        idle = call.settings.timeouts.idle_s
        loop = asyncio.get_running_loop()
        try:
            while True:
                watchdog = IdleTimeout(loop, idle, call.deadline, self.write_s)
                if ex.committed is src.copy:
                    watchdog.stall_s = ex.stall_after(src.copy)
                failure: Failure | None = None
                move: Migrate | None = None
                try:
                    await self._relay(src, out, watchdog)
                except _ClientGone:
                    return self._gone(src, out)
                except _Moved as m:
                    move = m.move
                except TimeoutError:
                    if watchdog.cause == "client":
                        # It read nothing for write_s: the client's doing, never the node's.
                        note(origin="client_slow_read")
                        self.metrics.client_closed_reason("slow_reader")
                        if call.request.transport is not None:
                            call.request.transport.abort()
                        return self._gone(src, out)
                    if watchdog.cause == "stall":
                        now = time.monotonic()
                        move = _move_of(ex.review(src.copy, now, src.counter.output_tokens(),
                                                  now - self.last))
                        if move is None:
                            continue  # not moved (budget, no node): it may still come back
                    else:
                        total = watchdog.cause == "total"
                        failure = Failure(
                            Outcome.TIMEOUT, 504,
                            f"node {src.node.id} exceeded the request's total time" if total
                            else f"node {src.node.id} sent nothing for {idle:g} s",
                            "upstream_timeout", cut=total)
                except (UpstreamError, OSError) as exc:
                    failure = Failure(Outcome.CONNECT_FAILURE, 502,
                                      f"node {src.node.id} failed in the middle of the stream: "
                                      f"{type(exc).__name__}", "upstream_disconnected")
                if move is None:
                    got = await self._ended(src, out, failure)
                    if got is None:
                        return out
                    move = got
                nxt = await self._move(src, out, move)
                if isinstance(nxt, Fail):
                    await self._failed(src, out, nxt.failure)
                    return out
                src = nxt
        except BaseException:  # cancelled: the client went away (counted before the moves)
            ex.client_gone(time.monotonic(), src.counter.output_tokens())
            raise
        finally:
            served = ex.ended == "ok" or ex.ended == "client_error"
            for s in self.sources:
                if served and s is src:
                    s.resp.release()  # read to the end: the connection is reusable
                else:
                    s.resp.close()
            if ex.moves:
                note(moves=ex.moves, move_result=ex.move_result)
                for cause, result in ex.move_outcomes():
                    self.metrics.migration(model, cause, result)

    async def _ended(self, src: Source, out: web.StreamResponse,
                     failure: Failure | None) -> Migrate | None:
        """``src``'s stream ended, cleanly or with ``failure``: the exchange says whether
        it moves (the move), or how it ended (written, None)."""
        call, ex = self.call, self.ex
        model = call.req.model
        tokens = src.counter.output_tokens()
        timed = getattr(self.protocol, "write_pauses", 0) == self.pauses
        now = time.monotonic()
        cached = src.counter.cached_tokens(call.req.prompt_tokens)
        if failure is not None:
            if failure.origin is Outcome.TIMEOUT and not timed:
                # The wait overlapped the client's stalls: not the node's failure.
                failure = Failure(Outcome.CLIENT_CANCELLED, failure.status, failure.message,
                                  failure.code)
            note(origin=failure.origin.value, tokens=self.before + tokens)
            self.metrics.upstream_error(src.node.id, failure.origin.value)
            move = _move_of(ex.failed(src.copy, now, failure, tokens, cached))
            if move is not None:
                return move
            await self._failed(src, out, failure)
            return None
        engine_error = bool(src.held) or src.counter.engine_error()
        end = ex.stream_ended(src.copy, now, tokens=tokens, engine_error=engine_error,
                              cached_tokens=cached, timed=timed)
        if end.failure is not None:
            self.metrics.upstream_error(src.node.id, end.error)
            note(origin="engine_error_mid_stream", tokens=self.before + tokens)
            move = _move_of(end.actions)
            if move is not None:
                return move
            # The engine ended the stream with its own error event: relayed as it
            # is, but no success.
            count_answer(self.metrics, call.request, model, end.failure.status)
            await self._end(out, src.held)
            return None
        rest = self.relayed.flush() if self.relayed is not None else b""
        if src.rewriter is not None:
            rest += src.rewriter.flush()  # a last event without its blank line
        total = self.before + tokens
        self.metrics.answered(model, src.node.id, src.node.gpu_class, now - call.t0, total,
                              ttft=self.t_first - call.t0, tpot=end.tpot if not ex.moves
                              else None, max_gap=self.max_gap)
        note(ttft_s=round(self.t_first - call.t0, 4), tokens=total)
        count_answer(self.metrics, call.request, model, src.resp.status)
        await self._end(out, rest)
        return None

    # -- relaying one source ------------------------------------------------------------

    def _emit(self, src: Source, chunk: bytes) -> bytes:
        """What of ``chunk`` goes to the client now (all of it, unless the stream may move)."""
        src.counter.feed(chunk)
        relayed = self.relayed
        if relayed is None:
            return chunk
        if b'"error"' in chunk:
            m = _ERROR_EVENT.search(chunk)
            if m is not None:  # held back: the stream may continue elsewhere
                src.held = chunk[m.start():].lstrip(b"\n")
                chunk = chunk[:m.start()] + (b"\n" if m.group(1) else b"")
        if src.rewriter is not None:
            chunk = src.rewriter.feed(chunk)
        return relayed.cut(chunk)

    async def _relay(self, src: Source, out: web.StreamResponse, watchdog: IdleTimeout) -> None:
        """Copy ``src``'s chunks to the client until its end (or a timeout, a failure,
        a move), counting its events and telling the exchange its progress."""
        resp = src.resp
        tell_at = self.last
        async with watchdog:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    return
                before = self.last
                now = self._arrived()
                if now - before >= STALL_S:
                    self._silent(src, before, now)
                data = self._emit(src, chunk)
                watchdog.touch()
                if data:
                    watchdog.writing = True
                    try:
                        await out.write(data)
                    except ConnectionError as exc:
                        raise _ClientGone from exc
                    watchdog.writing = False
                if src.held:
                    return  # an engine error event: its stream ends there
                if now >= tell_at:  # (after the write: a move follows what the client has)
                    tell_at = self._progress(src, now)

    def _silent(self, src: Source, since: float, now: float) -> None:
        """``src`` sent nothing from ``since`` to ``now``: told to the exchange (its
        node may have stalled) while the pace is the node's, not the client's."""
        if getattr(self.protocol, "write_pauses", 0) == self.pauses:
            self.ex.silent(src.copy, since, now)

    def _progress(self, src: Source, now: float) -> float:
        """The stream's progress for the detector (``Exchange.streaming``), while its
        pace is the node's (once the client has made the gateway wait, no more);
        with it, whether its node's state moves it."""
        if getattr(self.protocol, "write_pauses", 0) != self.pauses:
            return math.inf
        ex = self.ex
        tokens = src.counter.output_tokens()
        due = ex.streaming(src.copy, tokens, now)
        if self.relayed is not None:
            move = _move_of(ex.review(src.copy, now, tokens, 0.0))
            if move is not None:
                raise _Moved(move)
            due = min(due, now + 1.0)  # its node's state is looked at every second
        return due

    # -- a move ----------------------------------------------------------------------

    async def _move(self, old: Source, out: web.StreamResponse,
                    move: Migrate) -> Source | Fail:
        """Carry out ``move`` (and any that follow it): the source the answer continues
        from, or the end."""
        ex, call = self.ex, self.call
        assert self.relayed is not None
        so_far = self.relayed.so_far(self.chat)
        doc: Any = json.loads(call.body)
        cfg = ex.migration
        reading: asyncio.Task[bytes] | None = None
        sending: asyncio.Future[Failure | Answer] | None = None  # the continuation, till used
        try:
            while True:
                copy = move.copy
                body = continuation_body(doc, self.chat, so_far,
                                         cfg.engine_priority if cfg is not None else None) \
                    if not so_far.finished else None
                engine = self.engine_of(copy.node_id)
                refused = None
                if body is None:
                    refused = "this answer cannot be continued on another node"
                elif self.chat and engine is not None and engine not in CONTINUES_CHAT:
                    refused = f"engine {engine} cannot continue a chat answer"
                if refused is not None:
                    result: Failure | Answer = Failure(
                        Outcome.CLIENT_CANCELLED, 502, refused, "upstream_disconnected",
                        cut=True)
                else:
                    assert body is not None
                    sending = asyncio.ensure_future(self.send(copy, body))
                    while True:
                        if reading is None and old.copy.state == COMMITTED:
                            reading = asyncio.ensure_future(old.resp.readany())
                        waits: set[asyncio.Future[Any]] = {sending}
                        if reading is not None:
                            waits.add(reading)
                        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                        if reading is not None and reading in done:
                            task, reading = reading, None
                            chunk = _result(task)
                            if chunk:
                                ex.resumed(old.copy, time.monotonic())
                                if old.copy.state != COMMITTED:  # leaving its node: dropped
                                    old.resp.close()
                                else:  # the stalled copy came back first: it wins
                                    stop_attempt(sending)
                                    sending = None
                                    before = self.last
                                    if self._arrived() - before >= STALL_S:
                                        self._silent(old, before, self.last)
                                    await self._deliver(old, out, self._emit(old, chunk))
                                    return old
                            else:  # it ended (or failed) with the continuation on its way
                                ex.failed(old.copy, time.monotonic(), Failure(
                                    Outcome.CONNECT_FAILURE, 502, f"node {old.node.id} "
                                    "failed in the middle of the stream",
                                    "upstream_disconnected"), old.counter.output_tokens())
                        if sending in done:
                            result = sending.result()
                            sending = None
                            break
                if not isinstance(result, Failure) and result[0].status >= 400:
                    resp, payload = result
                    resp.close()
                    result = Failure(Outcome.UPSTREAM_5XX, 502,
                                     f"node {copy.node_id} refused the continuation "
                                     f"({resp.status})", "upstream_error", judged=False)
                now = time.monotonic()
                if isinstance(result, Failure):
                    self.metrics.upstream_error(copy.node_id, result.origin.value)
                    actions = ex.failed(copy, now, result)
                    nxt = _move_of(actions)
                    if nxt is not None:
                        move = nxt
                        continue
                    for a in actions:
                        if type(a) is Fail:
                            return a
                    return old  # back to the stalled stream, which still runs
                resp, payload = result
                if reading is not None:
                    _stop_read(reading)
                    reading = None
                ex.first_chunk(copy, now, defer_prefill=True)  # the stalled copy is cancelled
                old.resp.close()
                self.relayed.pending = b""  # the old stream's partial event: never sent
                self.before = move.after
                src = Source(copy, resp, self.node_of(copy.node_id), Rewriter(so_far))
                self.sources.append(src)
                self._arrived()
                data = self._emit(src, payload)
                if cfg is not None and cfg.announce:
                    data = moved_comment(old.node.id, copy.node_id, move.cause, move.after) + data
                await self._deliver(src, out, data)
                return src
        finally:  # (the client left, or the relay failed: nothing may keep running)
            if reading is not None:
                _stop_read(reading)
            if sending is not None:
                stop_attempt(sending)

    def _arrived(self) -> float:
        """A chunk came now: the longest gap between two, kept; returns now."""
        now = time.monotonic()
        if now - self.last > self.max_gap:
            self.max_gap = now - self.last
        self.last = now
        return now

    async def _deliver(self, src: Source, out: web.StreamResponse, data: bytes) -> None:
        """Write what a move's winner sent first (a client gone: every permit back)."""
        if data:
            try:
                await out.write(data)
            except ConnectionError:
                self._gone(src, out)
                raise _ClientGone from None

    # -- endings ---------------------------------------------------------------------

    def _gone(self, src: Source, out: web.StreamResponse) -> web.StreamResponse:
        """The client left mid-stream (or read too slowly): 499, and every permit back."""
        count_answer(self.metrics, self.call.request, self.call.req.model, CLIENT_CLOSED)
        self.ex.client_gone(time.monotonic(), src.counter.output_tokens())
        return out

    async def _failed(self, src: Source, out: web.StreamResponse, failure: Failure) -> None:
        count_answer(self.metrics, self.call.request, self.call.req.model, failure.status)
        await self._end(out, sse_error_event(failure.status, failure.message, failure.code))

    async def _end(self, out: web.StreamResponse, last: bytes = b"") -> None:
        """Write ``last`` and end the stream; a client gone or not reading for
        ``write_s`` is left as it is: the answer is accounted already."""
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(self.write_s):
                if last:
                    await out.write(last)
                await out.write_eof()


def _result(task: asyncio.Task[bytes]) -> bytes:
    """A finished read: its bytes, or none when it failed."""
    if task.cancelled() or task.exception() is not None:
        return b""
    return task.result()


def _stop_read(task: asyncio.Task[bytes]) -> None:
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()  # retrieved: a failed read is the old stream's, already ended


__all__ = ["Source", "StreamRelay"]
