"""The prompt work a node computes beside its decodes, and the recent rate of it
dispatched there.

What its prompts (their uncached part) add to its engine steps, at its roofline
speed (``predict.prefill_extra_s``): ever computed here, and the recent rate of
it dispatched here. The rate, ``duty``, is the share of the engine's time its
prompts will take beside its decodes (not capped: see
``predict.interleaved_tpot``); ``duty_sq`` is the same sum over the works'
squares, which sets how much the work landing in one answer's decode varies
(``policies/tailguard.py``). Both are this replica's (times ``1 + remote_ratio``
for the fleet's), decayed over ``DUTY_TAU_S`` at each tick: the rate given, not
the rate computed, since a node stalled or behind still has those prompts to
compute beside its next decodes.

The computation itself (``prefill_work_s``, roofline seconds of extra
decode-step time) is spread over the time each prompt computes
(:meth:`PromptWork.work_at`): the engine takes waiting prompts first come,
first served, a chunk a step, so a prompt accrues from when those ahead of it
are expected done, over its chunks' steps (the balancer sets both), at a rate
that rises along the prompt (a chunk late in a long prompt attends to all of
the prompt before it, so it takes a growing share of each step); the rest is
credited at its first token. A decode judged in one-second pieces then sees
the prompt chunks that slowed it while it ran, not in the piece after, nor
while the prompt waited behind another.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, ClassVar

# The time constant of a node's recent prompt-work rate (duty): long enough to
# hold tens of prompts at a few requests a second, short enough to follow a
# burst or a peer's lost capacity spilling onto the node.
DUTY_TAU_S = 5.0

# An accrual (PromptWork.start_work): its rate at its begin and the rate's rise per
# second, when it begins and ends, its state (the event it waits for next, or
# done), its seconds and chunks, and whether chunk_work counts it.
_RATE, _SLOPE, _BEGIN, _END_T, _STATE, _SECONDS, _CHUNKS, _OPEN = range(8)
_START, _END, _DONE = 0.0, 1.0, 2.0


class PromptWork:
    """Prompt work on the node (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = (
        "chunk_count", "chunk_work", "duty", "duty_sq", "duty_t", "prefill_work_s", "work_events",
        "work_free", "work_rate", "work_seq", "work_slope", "work_t")

    prefill_work_s: float  # accrued by work_t
    work_t: float
    work_rate: float  # the accrual's rate at work_t...
    work_slope: float  # ...and how fast it rises
    # (time, seq, START or END, accrual): when each prompt's accrual begins and ends
    work_events: list[tuple[float, int, float, list[float]]]
    work_seq: int
    duty: float
    duty_sq: float
    duty_t: float
    # The work and the prefill chunks of the prompts being computed now: what one
    # step carrying a chunk of them costs (:meth:`chunk_s`).
    chunk_work: float
    chunk_count: int
    work_free: float  # the latest end of the prompts under way

    def _init_work(self) -> None:
        self.work_free = 0.0
        self.chunk_work = 0.0
        self.chunk_count = 0
        self.prefill_work_s = 0.0
        self.work_t = 0.0
        self.work_rate = 0.0
        self.work_slope = 0.0
        self.work_events = []
        self.work_seq = 0
        self.duty = 0.0
        self.duty_sq = 0.0
        self.duty_t = 0.0

    def work_at(self, now: float) -> float:
        """The prompt work computed by ``now`` (seconds, see ``prefill_work_s``)."""
        t = self.work_t
        if now <= t:  # asked again at once (the streams of one tick): nothing new
            return self.prefill_work_s
        rate, slope, base, events = self.work_rate, self.work_slope, self.prefill_work_s, \
            self.work_events
        while events and events[0][0] <= now:
            at, _, kind, entry = heapq.heappop(events)
            if entry[_STATE] != kind:  # ended early (end_work): nothing left to do
                continue
            dt = at - t
            if dt > 0.0:
                base += (rate + 0.5 * slope * dt) * dt
                rate += slope * dt
                t = at
            if kind == _START:
                rate += entry[_RATE]
                slope += entry[_SLOPE]
                entry[_STATE] = _END
            else:
                rate -= entry[_RATE] + entry[_SLOPE] * (entry[_END_T] - entry[_BEGIN])
                slope -= entry[_SLOPE]
                entry[_STATE] = _DONE
        if not events:  # nothing accrues: no drift left over
            rate = slope = 0.0
        dt = now - t
        base += (rate + 0.5 * slope * dt) * dt
        self.prefill_work_s, self.work_rate, self.work_slope = base, rate + slope * dt, slope
        self.work_t = now
        return base

    def work_free_at(self, now: float) -> float:
        """When the prompts under way are expected computed (``now`` if none is)."""
        return self.work_free if self.work_free > now else now

    def chunk_s(self) -> float:
        """The mean work of one chunk of the prompts being computed now (0: none)."""
        return self.chunk_work / self.chunk_count if self.chunk_count > 0 else 0.0

    def start_work(self, seconds: float, begin: float, end: float, now: float,
                   chunks: int = 1, ramp: float = 1.0) -> list[float] | None:
        """A prompt of ``seconds`` of work in ``chunks`` prefill chunks dispatched at
        ``now``, expected to compute from ``begin`` to ``end`` at a rate that ends
        ``ramp`` times where it began; returns its accrual, for :meth:`end_work`."""
        self.work_at(now)
        if end <= begin or seconds <= 0.0:
            return None
        span = end - begin
        # A rate rising linearly from r0 to r0 * ramp, whose integral is ``seconds``.
        r0 = 2.0 * seconds / (span * (1.0 + ramp))
        entry = [r0, r0 * (ramp - 1.0) / span, begin, end, _START, seconds, float(chunks), 1.0]
        self.chunk_work += seconds
        self.chunk_count += chunks
        if end > self.work_free:
            self.work_free = end
        if begin <= now:
            entry[_BEGIN] = now if begin < now else begin
            entry[_STATE] = _END
            self.work_rate += r0
            self.work_slope += entry[_SLOPE]
        else:
            self.work_seq += 1
            heapq.heappush(self.work_events, (begin, self.work_seq, _START, entry))
        self.work_seq += 1
        heapq.heappush(self.work_events, (end, self.work_seq, _END, entry))
        return entry

    def end_work(self, seconds: float, entry: list[float] | None, now: float,
                 computed: bool = True) -> None:
        """The prompt's computation ended by ``now``: what it had not accrued is
        credited (``computed``), or dropped (its request ended first)."""
        self.work_at(now)
        if entry is None:
            if computed:
                self.prefill_work_s += seconds
            return
        if entry[_OPEN]:
            entry[_OPEN] = 0.0
            self.chunk_count -= int(entry[_CHUNKS])
            if self.chunk_count > 0:
                self.chunk_work -= entry[_SECONDS]
            else:  # none under way: the next prompt starts at once
                self.chunk_work = 0.0
                self.work_free = now
        state = entry[_STATE]
        if state == _DONE:
            return  # accrued whole already
        entry[_STATE] = _DONE
        accrued = 0.0
        if state == _END:  # accruing: what it gave so far, and its rate now, taken back
            dt = now - entry[_BEGIN]
            accrued = (entry[_RATE] + 0.5 * entry[_SLOPE] * dt) * dt
            self.work_rate -= entry[_RATE] + entry[_SLOPE] * dt
            self.work_slope -= entry[_SLOPE]
        if computed:  # the rest of it
            self.prefill_work_s += max(0.0, seconds - accrued)

    def add_dispatched_work(self, seconds: float) -> None:
        """Prompt computation (roofline seconds) dispatched to the node."""
        self.duty += seconds / DUTY_TAU_S
        self.duty_sq += seconds * seconds / DUTY_TAU_S

    def withdraw_work(self, seconds: float) -> None:
        """A dispatched prompt that will not be computed (its request failed first)."""
        self._shift_rates(-seconds / DUTY_TAU_S, -seconds * seconds / DUTY_TAU_S)

    def recount_work(self, counted: float, actual: float, since: float) -> None:
        """A prompt dispatched at ``since`` and counted in the rates as ``counted``
        seconds of work took ``actual`` (its first token said so): the rates hold
        ``actual`` from then on, decayed as the rest."""
        if self.duty_t > since:
            w = math.exp(-(self.duty_t - since) / DUTY_TAU_S) / DUTY_TAU_S
        else:
            w = 1.0 / DUTY_TAU_S
        self._shift_rates((actual - counted) * w, (actual * actual - counted * counted) * w)

    def _shift_rates(self, duty: float, duty_sq: float) -> None:
        """Add to the prompt rates, never taking them below 0."""
        d = self.duty + duty
        self.duty = d if d > 0.0 else 0.0
        q = self.duty_sq + duty_sq
        self.duty_sq = q if q > 0.0 else 0.0

    def decay_duty(self, now: float) -> None:
        """The prompt rates forget what was dispatched before ``now`` (each tick)."""
        dt = now - self.duty_t
        if dt > 0.0:
            w = math.exp(-dt / DUTY_TAU_S)
            self.duty *= w
            self.duty_sq *= w
            self.duty_t = now
