"""Drive one :class:`tailguard.engine.Engine` in real time on the asyncio loop.

The engine model is sans-IO: it is told ``now`` and says when it next has
something to report (:meth:`Engine.next_event_time`; with
``step_by_step=True`` that is the end of every engine step). The driver maps
engine time to the loop's monotonic clock::

    engine_time = (loop.time() - t0) * time_scale

(``time_scale`` is ``--speed``: 2.0 runs the fleet twice as fast) and keeps
exactly one timer armed, at the real time of the next engine event. The timer
is a plain ``loop.call_at`` callback rather than a task that sleeps: it costs
no coroutine switch per step, and a submit that makes the next event earlier
(a request reaching an idle engine) simply re-arms it.

At each step end the callback calls ``advance`` and hands out what happened:
first-token, finish and failure events, and for each streaming request the
tokens it generated since the last step (``tokens_generated``). Each request
is a :class:`Pending` that its HTTP handler awaits; the driver wakes the
handler at most once per step, and the handler writes all the new tokens at
once, so the cost is per step and request, not per token.

Timers fire up to a millisecond early (uvloop rounds to milliseconds), so the
driver never tells the engine a time before the last one it used: engine time
is ``max(clock, last)``. A step is therefore reported at most ~1 ms early,
never in the wrong order.

Zero-delay mode (``time_scale = inf``): there is no engine; a request is done
the moment it is submitted, with all its tokens. This is the "infinitely
fast engine" that measures a gateway's own overhead.
"""

from __future__ import annotations

import asyncio
import math

from tailguard.core.hardware import PerfModel
from tailguard.emulator.metrics import EngineMetrics
from tailguard.emulator.protocol import BLOCK_TOKENS
from tailguard.engine import FAILED, FINISH, FIRST_TOKEN, Engine, EngineConfig


class Pending:
    """Delivery state of one request between the driver and its HTTP handler."""

    __slots__ = ("avail", "cached", "done", "failed", "first_at", "last_at", "output", "prompt",
                 "rid", "stream", "submitted_at", "waiter")

    def __init__(self, rid: int, prompt: int, output: int, stream: bool, now: float) -> None:
        self.rid = rid
        self.prompt = prompt
        self.output = output
        self.stream = stream
        self.avail = 0  # tokens generated so far (the handler has sent some prefix of them)
        self.cached = 0  # prompt tokens served from the engine's prefix cache
        self.done = False
        self.failed = False
        self.submitted_at = now  # loop time
        self.first_at = -1.0
        self.last_at = now
        self.waiter: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        """Return once more tokens are available or the request has ended."""
        fut = asyncio.get_running_loop().create_future()
        self.waiter = fut
        try:
            await fut
        finally:
            self.waiter = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class EngineDriver:
    """Runs one engine model against the loop clock; see the module docstring."""

    def __init__(self, perf: PerfModel, config: EngineConfig, metrics: EngineMetrics, *,
                 time_scale: float = 1.0, base_speed: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be > 0")
        self.instant = math.isinf(time_scale)
        self.time_scale = time_scale
        self.base_speed = base_speed
        self.config = config
        self.metrics = metrics
        self.engine = Engine(perf, config, speed=base_speed, step_by_step=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._last_e = 0.0  # last engine time told to the engine (monotonic)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # engine time the timer is armed for
        self._pending: dict[int, Pending] = {}
        self._streams: dict[int, Pending] = {}  # streaming subset that already has a first token
        self._next_id = 0
        # zero-delay mode keeps its own counters (there is no engine to ask)
        self._prompt_total = 0
        self._gen_total = 0

    # ------------------------------------------------------------------ clock

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()

    def _now_e(self) -> float:
        assert self._loop is not None
        t = (self._loop.time() - self._t0) * self.time_scale
        if t > self._last_e:
            self._last_e = t
        return self._last_e

    def _arm(self) -> None:
        """Make the one timer fire at the engine's next event (earlier never hurts)."""
        nxt = self.engine.next_event_time()
        if nxt >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = nxt
        if math.isinf(nxt):
            self._timer = None
        else:
            self._timer = self._loop.call_at(self._t0 + nxt / self.time_scale, self._on_timer)

    def _on_timer(self) -> None:
        due = self._timer_at
        self._timer = None
        self._timer_at = math.inf
        now = self._now_e()
        if now < due:
            # Fired early (uvloop rounds timers to milliseconds): the step is due
            # now, so do not spin re-arming for the sub-millisecond left.
            self._last_e = now = due
        self._deliver(self.engine.advance(now))
        self._arm()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf
        for p in list(self._pending.values()):
            self._end(p, failed=True)

    # ------------------------------------------------------------ requests

    def submit(self, prompt_tokens: int, output_tokens: int, stream: bool,
               blocks: tuple[int, ...] = (), *, hold_kv: bool = False,
               remote_kv: bool = False) -> Pending:
        """Queue a request (``hold_kv``, ``remote_kv``: :meth:`Engine.submit`'s)."""
        assert self._loop is not None, "start() the driver first"
        now = self._loop.time()
        rid = self._next_id
        self._next_id += 1
        p = Pending(rid, prompt_tokens, output_tokens, stream, now)
        if self.instant:
            self._prompt_total += prompt_tokens
            self._gen_total += output_tokens
            p.avail = output_tokens
            p.done = True
            p.first_at = p.last_at = now
            self.metrics.on_finish(p, now)
            return p
        self._pending[rid] = p
        self.engine.submit(rid, prompt_tokens, output_tokens, self._now_e(), blocks,
                           BLOCK_TOKENS if blocks else 0, hold_kv=hold_kv, remote_kv=remote_kv)
        self._arm()
        return p

    def release_kv(self, p: Pending) -> bool:
        """Free the KV a finished ``hold_kv`` request holds (its decode side has it)."""
        if self.instant:
            return False
        released = self.engine.release_kv(p.rid, self._now_e())
        self._arm()
        return released

    def cancel(self, p: Pending) -> None:
        """The client went away: free the request's slot and KV in the engine."""
        if p.done:
            return
        p.done = p.failed = True
        self._pending.pop(p.rid, None)
        self._streams.pop(p.rid, None)
        if not self.instant:
            self.engine.cancel(p.rid, self._now_e())
            self._arm()

    def _end(self, p: Pending, failed: bool) -> None:
        p.done = True
        p.failed = failed
        self._pending.pop(p.rid, None)
        self._streams.pop(p.rid, None)
        p.wake()

    def _deliver(self, events: list[tuple[float, int, int]]) -> None:
        assert self._loop is not None
        now = self._loop.time()
        pending = self._pending
        metrics = self.metrics
        for _, kind, rid in events:
            p = pending.get(rid)
            if p is None:
                continue  # cancelled while its step ran
            if kind == FIRST_TOKEN:
                p.first_at = p.last_at = now
                p.avail = 1
                metrics.on_first_token(p, now)
                if p.stream:
                    self._streams[rid] = p
                p.wake()
            elif kind == FINISH:
                if p.first_at < 0:
                    p.first_at = now
                    metrics.on_first_token(p, now)
                if p.stream and p.output > p.avail:
                    metrics.on_tokens(now - p.last_at, p.output - p.avail)
                p.avail = p.output
                p.cached = self.engine.cached_tokens(rid)
                metrics.on_finish(p, now)
                self._end(p, failed=False)
            elif kind == FAILED:
                self._end(p, failed=True)
        if self._streams:
            generated = self.engine.tokens_generated
            on_tokens = metrics.on_tokens
            for p in self._streams.values():
                n = generated(p.rid)
                if n > p.avail:
                    on_tokens(now - p.last_at, n - p.avail)
                    p.avail = n
                    p.last_at = now
                    p.wake()

    # --------------------------------------------------------------- faults

    def set_speed_factor(self, factor: float) -> None:
        if self.instant:
            return
        self.engine.set_speed(self.base_speed * factor, self._now_e())
        self._rearm_later()

    def stall(self, seconds: float) -> None:
        """Pause the engine for ``seconds`` of real time."""
        if self.instant:
            return
        self.engine.stall(seconds * self.time_scale, self._now_e())
        self._rearm_later()

    def _rearm_later(self) -> None:
        # The next event may have moved later (a slower speed, a stall): a timer
        # armed for the old, earlier time would only fire early and re-arm, but
        # re-arming now keeps the loop quiet.
        self._timer_at = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deliver(self.engine.advance(self._now_e()))
        self._arm()

    def crash(self) -> None:
        """Fail every request held; the engine refuses work until :meth:`restart`."""
        if not self.instant:
            self._deliver(self.engine.crash(self._now_e()))
            self._arm()
        for p in list(self._pending.values()):
            self._end(p, failed=True)

    def restart(self) -> None:
        if not self.instant:
            self.engine.restart(self._now_e())
            self._arm()

    # -------------------------------------------------------------- metrics

    def sync(self) -> None:
        """Bring the engine up to now before its gauges are read (a no-op when instant)."""
        if not self.instant and self._loop is not None:
            self._deliver(self.engine.advance(self._now_e()))
            self._arm()

    @property
    def num_running(self) -> int:
        return 0 if self.instant else self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return 0 if self.instant else self.engine.num_waiting

    @property
    def kv_usage(self) -> float:
        return 0.0 if self.instant else self.engine.kv_usage

    @property
    def num_preemptions(self) -> int:
        return 0 if self.instant else self.engine.num_preemptions

    @property
    def prompt_tokens_total(self) -> int:
        return self._prompt_total if self.instant else self.engine.prompt_tokens_total

    @property
    def generation_tokens_total(self) -> int:
        return self._gen_total if self.instant else self.engine.generation_tokens_total

    @property
    def num_gpu_blocks(self) -> int:
        return self.engine.num_gpu_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    @property
    def in_flight(self) -> int:
        return len(self._pending)
