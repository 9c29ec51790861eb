"""An idle timeout that costs one attribute store per chunk.

A stream must end when nothing arrived for ``idle_s`` or when its total
deadline passed. ``asyncio.timeout`` with ``reschedule`` per chunk does that
but cancels and re-creates a timer handle per chunk (and on CPython 3.11 each
call asks ``get_running_loop``, a ``getpid`` system call), a large share of
the gateway's CPU when streaming. :class:`IdleTimeout`
arms one timer; :meth:`IdleTimeout.touch` only records the time of the last
progress, and when the timer fires it re-arms itself for
``last + idle_s`` if there was progress since, and cancels the task only if
there was none. The cancellation becomes :class:`TimeoutError` on exit, as
with ``asyncio.timeout`` (whose ``uncancel`` bookkeeping it follows, so an
outside cancellation is never swallowed).

    async with IdleTimeout(loop, idle_s=30.0, deadline=loop.time() + 600,
                           write_s=30.0) as idle:
        while chunk := await read():
            idle.touch()
            idle.writing = True
            await write(chunk)
            idle.writing = False

While ``writing`` is set the wait is the *client's* (it reads slowly, the
gateway's send buffer is full), so it is bounded by ``write_s`` instead and
an expiry then has :attr:`IdleTimeout.cause` ``"client"``: a slow reader must
never read as a silent node (``"idle"``) or be charged to it. ``"total"``
is the request's own deadline.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType


class IdleTimeout:
    """Cancel the current task after ``idle_s`` without :meth:`touch`, or at ``deadline``."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_loop", "_task", "cause", "deadline",
                 "idle_s", "last", "stall_s", "write_s", "writing")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float, deadline: float,
                 write_s: float | None = None) -> None:
        self._loop = loop
        self.idle_s = idle_s
        self.write_s = idle_s if write_s is None else write_s
        # A stream that may move to another node: silent this long, it expires with
        # cause "stall" (the exchange then decides; inf: never).
        self.stall_s = math.inf
        self.deadline = deadline
        self.last = loop.time()
        self.writing = False
        self.cause = ""  # why it expired: "idle", "client" or "total"
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._expired = False
        self._cancelling = 0

    @property
    def expired(self) -> bool:
        return self._expired

    def touch(self) -> None:
        """Progress now: the idle clock restarts."""
        self.last = self._loop.time()

    async def __aenter__(self) -> IdleTimeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("IdleTimeout must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._arm()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        task = self._task
        if (self._expired and exc_type is asyncio.CancelledError and task is not None
                and task.uncancel() <= self._cancelling):
            raise TimeoutError from exc
        return None

    def _limit(self) -> float:
        if self.writing:
            return self.write_s
        return self.stall_s if self.stall_s < self.idle_s else self.idle_s

    def _arm(self) -> None:
        when = self.last + self._limit()
        self._handle = self._loop.call_at(min(when, self.deadline), self._fire)

    def _fire(self) -> None:
        self._handle = None
        now = self._loop.time()
        if now < self.deadline and now < self.last + self._limit():
            self._arm()  # progress since the timer was set: wait out the rest
            return
        self._expired = True
        self.cause = ("total" if now >= self.deadline else "client" if self.writing
                      else "stall" if self.stall_s < self.idle_s else "idle")
        if self._task is not None:
            self._task.cancel()


__all__ = ["IdleTimeout"]
