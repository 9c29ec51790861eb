"""The copies of a hedged request racing to their first chunk, as asyncio tasks.

:class:`Race` holds one task per copy the exchange dispatched
(:meth:`tailguard.gateway.forward.Forwarder._try`) and the hedge timer; the
forwarder waits on it for whichever comes first, a copy's result or the
timer, and cancels the copies the exchange says lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine

from tailguard.adapters.upstream import UpstreamResponse
from tailguard.core.exchange import Action, Cancel, Copy, Failure

Answer = tuple[UpstreamResponse, bytes]  # a response with its first chunk (or whole body)


class Race:
    """The copies of a hedged request as tasks, and the hedge timer."""

    __slots__ = ("fired", "fired_at", "tasks", "timer")

    def __init__(self) -> None:
        self.tasks: dict[asyncio.Task[Failure | Answer], Copy] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.fired: asyncio.Future[None] | None = None
        self.fired_at = 0.0  # the exchange's time the timer was armed for

    def start(self, copy: Copy, coro: Coroutine[object, object, Failure | Answer]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks[task] = copy
        copy.io = task

    def arm(self, at: float) -> None:
        loop = asyncio.get_running_loop()
        if self.timer is not None:
            self.timer.cancel()
        fired: asyncio.Future[None] = loop.create_future()
        self.fired = fired
        self.fired_at = at
        # The exchange's clock is time.monotonic(); uvloop's loop.time() need not be.
        self.timer = loop.call_later(max(0.0, at - time.monotonic()), _resolve, fired)

    async def next(self) -> tuple[Copy, Failure | Answer] | None:
        """The next copy to finish its attempt; None when the timer fired first."""
        waits: set[asyncio.Future[object]] = set(self.tasks)  # type: ignore[arg-type]
        if self.fired is not None:
            waits.add(self.fired)  # type: ignore[arg-type]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in list(self.tasks):
            if task in done:
                return self.tasks.pop(task), task.result()
        self.fired = None
        self.timer = None
        return None

    def keep(self, copy: Copy) -> None:
        """``copy`` won: it is no longer the race's to close."""
        for task, c in list(self.tasks.items()):
            if c is copy:
                del self.tasks[task]

    def cancel(self, copy: Copy) -> None:
        task = copy.io
        if isinstance(task, asyncio.Task):
            self.tasks.pop(task, None)
            stop_attempt(task)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for task in self.tasks:
            stop_attempt(task)
        self.tasks.clear()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def cancel_losers(race: Race | None, actions: tuple[Action, ...]) -> None:
    """Carry out the Cancel actions of a commit (the losers of the race)."""
    for a in actions:
        if race is not None and type(a) is Cancel:
            race.cancel(a.copy)


def stop_attempt(task: asyncio.Future[Failure | Answer]) -> None:
    """Cancel an attempt's task; an answer it already got is closed."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        got = task.result()
        if not isinstance(got, Failure):
            got[0].close()
