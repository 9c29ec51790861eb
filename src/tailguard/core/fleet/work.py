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
(:meth:`PromptWork.work_at`): accrued at ``work_rate`` from its dispatch, at
the rate that ends it by its predicted first token; the rest is credited at its
first token. A decode judged in one-second pieces then sees the prompt that
slowed it while it ran, not in the piece after.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, ClassVar

# The time constant of a node's recent prompt-work rate (duty): long enough to
# hold tens of prompts at a few requests a second, short enough to follow a
# burst or a peer's lost capacity spilling onto the node.
DUTY_TAU_S = 5.0


class PromptWork:
    """Prompt work on the node (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ("duty", "duty_sq", "duty_t", "prefill_work_s", "work_ends", "work_rate",
              "work_seq", "work_t")

    prefill_work_s: float  # accrued by work_t
    work_t: float
    work_rate: float
    work_ends: list[tuple[float, int, list[float]]]  # (end, seq, accrual)
    work_seq: int
    duty: float
    duty_sq: float
    duty_t: float

    def _init_work(self) -> None:
        self.prefill_work_s = 0.0
        self.work_t = 0.0
        self.work_rate = 0.0
        self.work_ends = []
        self.work_seq = 0
        self.duty = 0.0
        self.duty_sq = 0.0
        self.duty_t = 0.0

    def work_at(self, now: float) -> float:
        """The prompt work computed by ``now`` (seconds, see ``prefill_work_s``)."""
        t = self.work_t
        if now == t:  # asked again at once (the streams of one tick): nothing new ends
            return self.prefill_work_s
        rate, base, ends = self.work_rate, self.prefill_work_s, self.work_ends
        if now > t or ends:
            while ends and ends[0][0] <= now:
                end, _, entry = heapq.heappop(ends)
                if entry[1]:
                    base += rate * max(0.0, end - t)
                    t = max(t, end)
                    rate -= entry[0]
                    entry[1] = 0.0
            if not ends:
                rate = 0.0
            base += rate * max(0.0, now - t)
            self.prefill_work_s, self.work_rate = base, rate
            self.work_t = max(t, now)
        return self.prefill_work_s

    def start_work(self, seconds: float, duration_s: float, now: float) -> list[float] | None:
        """A prompt of ``seconds`` of work dispatched, expected to compute over the next
        ``duration_s``; returns its accrual, for :meth:`end_work`."""
        self.work_at(now)
        if duration_s <= 0.0 or seconds <= 0.0:
            return None
        entry = [seconds / duration_s, 1.0, now + duration_s]  # rate, alive, end
        self.work_rate += entry[0]
        self.work_seq += 1
        heapq.heappush(self.work_ends, (now + duration_s, self.work_seq, entry))
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
        if not entry[1]:
            return  # accrued whole already
        entry[1] = 0.0
        self.work_rate -= entry[0]
        if computed:  # the rest of it: seconds minus what the rate gave so far
            self.prefill_work_s += entry[0] * max(0.0, entry[2] - now)

    def add_dispatched_work(self, seconds: float) -> None:
        """Prompt computation (roofline seconds) dispatched to the node."""
        self.duty += seconds / DUTY_TAU_S
        self.duty_sq += seconds * seconds / DUTY_TAU_S

    def withdraw_work(self, seconds: float) -> None:
        """A dispatched prompt that will not be computed (its request failed first)."""
        d = self.duty - seconds / DUTY_TAU_S
        self.duty = d if d > 0.0 else 0.0
        q = self.duty_sq - seconds * seconds / DUTY_TAU_S
        self.duty_sq = q if q > 0.0 else 0.0

    def decay_duty(self, now: float) -> None:
        """The prompt rates forget what was dispatched before ``now`` (each tick)."""
        dt = now - self.duty_t
        if dt > 0.0:
            w = math.exp(-dt / DUTY_TAU_S)
            self.duty *= w
            self.duty_sq *= w
            self.duty_t = now
