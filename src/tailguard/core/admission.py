"""The gateway's admission queue: priority, deadline, late binding and shedding.

When no eligible node of a pool has room under its concurrency limit
(:mod:`tailguard.core.limits`), a request waits in its pool's queue instead of
piling onto an engine. The node is chosen only when a permit frees (late
binding), so a request never waits behind a slow node it was bound to early.

Order: priority first (``high`` 0, ``normal`` 1, ``low`` 2, from the header
``x-tailguard-priority``), then the earliest deadline (arrival + the pool's
TTFT SLO, or the client's ``x-slo-ttft-ms``), then arrival order. This is
earliest-deadline-first within a priority class, the classic policy for
meeting deadlines on one server (Liu and Layland, 1973).

Shedding is immediate (the driver answers 429 with ``Retry-After``), never a
silent timeout:

* ``queue_full``: the queue is at ``queue_max`` entries or ``queue_max_bytes``
  and the newcomer does not outrank its worst entry; if it does, that worst
  entry is displaced (``displaced``) and the newcomer takes its place, so low
  priority absorbs the shedding;
* ``deadline``: the predicted wait exceeds the time left to the deadline
  (less the node's recent TTFT, ``service_ttft``). The wait is
  ``(entries of its priority or higher + 1) / (release rate - arrival rate
  of higher priorities)``: higher-priority arrivals overtake it, as in a
  preemptive-priority queue. Rates are counters decayed with time constant
  ``rate_tau_s``, divided by the span they have seen (``tau * (1 -
  exp(-elapsed / tau))``, the bias correction of an average started at zero);
  until releases have been seen for ``rate_tau_s`` nothing is shed on
  prediction (a cold fleet's first second of releases says little about the
  next), entries expire at their deadline instead;
* ``expired``: an entry still queued at its deadline (it could no longer
  meet the TTFT SLO; serving it would only delay the others).

Worked example: releases at 20/s, ``high`` arriving at 4/s, a ``normal``
request arrives with 30 ``high`` and ``normal`` entries ahead and a TTFT SLO
of 1 s: predicted wait 31 / (20 - 4) = 1.9 s > 1 s, so it is shed at once
with ``Retry-After`` of the queue's drain time; a ``high`` one with 10
``high`` entries ahead waits 11 / 20 = 0.55 s and is queued.

A cancelled client leaves at once: its entry stops counting towards the
length and bytes immediately (the heap entry is skipped when reached).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
PRIORITY_NAMES = ("high", "normal", "low")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The ``admission:`` section of a scenario or of a fleet file's pool."""

    queue_max: int = 1024
    queue_max_bytes: int = 64 << 20
    shed_on_predicted_wait: bool = True
    expire: bool = True  # shed entries still queued at their deadline
    rate_tau_s: float = 5.0
    min_retry_after_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Shed:
    """A decision to refuse a request now: 429, ``Retry-After``, an OpenAI-style error."""

    reason: str  # queue_full | displaced | deadline | expired | no_capacity
    retry_after_s: float

    @property
    def message(self) -> str:
        return {
            "queue_full": "the gateway queue is full",
            "displaced": "displaced from the gateway queue by a higher-priority request",
            "deadline": "the predicted queue wait exceeds the request's TTFT deadline",
            "expired": "the request reached its TTFT deadline in the gateway queue",
        }.get(self.reason, "no node has capacity for the request")


class Waiter:
    """A queued request: what the balancer needs to place it later, plus the driver's data."""

    __slots__ = ("arrival", "deadline", "exclude", "max_tokens", "model", "payload", "prefix",
                 "priority", "prompt_tokens", "seq", "session", "size_bytes", "state", "wid")

    def __init__(self, model: str, prompt_tokens: int, max_tokens: int | None, priority: int,
                 arrival: float, deadline: float, size_bytes: int = 0,
                 exclude: Sequence[str] = (), payload: Any = None, wid: int = 0,
                 prefix: Sequence[int] = (), session: str | None = None) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.priority = min(max(priority, 0), 2)
        self.arrival = arrival
        self.deadline = deadline
        self.size_bytes = size_bytes
        self.exclude = tuple(exclude)
        self.payload = payload
        self.prefix = prefix  # the prompt's hashed blocks
        self.session = session  # the client's session key
        self.seq = 0
        self.wid = wid  # the balancer's sequence number: names it in recordings
        self.state = "queued"  # queued | dispatched | shed | cancelled

    def key(self) -> tuple[int, float, int]:
        return (self.priority, self.deadline, self.seq)

    def __lt__(self, other: Waiter) -> bool:
        return self.key() < other.key()


class AdmissionQueue:
    """One pool's queue: bounded, ordered by (priority, deadline, arrival)."""

    __slots__ = ("_arrivals", "_arrivals_t", "_first_arrival", "_first_release", "_heap", "_rate",
                 "_rate_t", "_seq", "by_priority", "bytes", "config", "length", "service_ttft",
                 "shed_total")

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._heap: list[Waiter] = []
        self._seq = 0
        self.length = 0
        self.bytes = 0
        self.by_priority = [0, 0, 0]
        self._rate = 0.0  # decayed count of releases
        self._rate_t = 0.0
        self._arrivals = [0.0, 0.0, 0.0]  # decayed counts of arrivals per priority
        self._arrivals_t = [0.0, 0.0, 0.0]
        # When the counters started: a decayed count over a span shorter than
        # its time constant is corrected for the time it could not see.
        self._first_release = math.nan
        self._first_arrival = math.nan
        self.shed_total: dict[str, int] = {}
        # Recent node-side TTFT (dispatch to first token): a request must leave
        # the queue at least this long before its deadline to meet it.
        self.service_ttft = 0.0

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return self.length

    def __len__(self) -> int:
        return self.length

    # -- drain-rate estimate -------------------------------------------------

    def on_release(self, now: float, ttft: float = 0.0) -> None:
        if self._first_release != self._first_release:  # nan: the first release
            self._first_release = now
        self._rate = self._decayed(now) + 1.0
        self._rate_t = now
        if ttft > 0.0:
            self.service_ttft += (ttft - self.service_ttft) * 0.05

    def latest_start(self, w: Waiter) -> float:
        """The last moment ``w`` can leave the queue and still meet its deadline."""
        return w.deadline - self.service_ttft

    def on_arrival(self, priority: int, now: float) -> None:
        """A request of ``priority`` arrived at the pool (queued or not)."""
        if self._first_arrival != self._first_arrival:
            self._first_arrival = now
        self._arrivals[priority] = self._decay(self._arrivals[priority],
                                               now - self._arrivals_t[priority]) + 1.0
        self._arrivals_t[priority] = now

    def arrival_rate(self, priority: int, now: float) -> float:
        return self._decay(self._arrivals[priority], now - self._arrivals_t[priority]) \
            / self._span(now, self._first_arrival)

    def _span(self, now: float, since: float) -> float:
        """The decayed counters' effective window: ``tau * (1 - exp(-elapsed / tau))``.

        A count decayed with time constant ``tau`` divided by ``tau`` is the
        rate only once it has run for several ``tau``; after ``elapsed``
        seconds it has seen ``1 - exp(-elapsed / tau)`` of that weight (the
        bias correction of an exponentially weighted average started at zero).
        """
        tau = self.config.rate_tau_s
        elapsed = now - since
        if not elapsed > 0.0:  # also nan: nothing seen yet
            return tau
        return tau * -math.expm1(-elapsed / tau) if elapsed < 20.0 * tau else tau

    def warmed(self, now: float) -> bool:
        """Releases have been seen for a time constant: the drain rate can be trusted."""
        return now - self._first_release >= self.config.rate_tau_s

    def _decay(self, count: float, dt: float) -> float:
        return count * math.exp(-dt / self.config.rate_tau_s) if dt > 0 else count

    def drain_rate(self, now: float) -> float:
        """Permit releases per second lately (0 until the first release)."""
        return self._decayed(now) / self._span(now, self._first_release)

    def _decayed(self, now: float) -> float:
        dt = now - self._rate_t
        return self._rate * math.exp(-dt / self.config.rate_tau_s) if dt > 0 else self._rate

    def predicted_wait(self, priority: int, now: float) -> float:
        """Seconds until a new entry of ``priority`` would be dispatched (inf: never).

        Entries of higher priority that arrive meanwhile overtake it, so the
        rate at which its own class moves is the release rate minus their
        arrival rate (a preemptive-priority queue's effective service rate).
        """
        ahead = sum(self.by_priority[: priority + 1])
        rate = self.drain_rate(now)
        for p in range(priority):
            rate -= self.arrival_rate(p, now)
        return (ahead + 1) / rate if rate > 0 else math.inf

    def retry_after(self, now: float) -> float:
        rate = self.drain_rate(now)
        wait = self.length / rate if rate > 0 else 0.0
        return float(math.ceil(max(wait, self.config.min_retry_after_s)))

    # -- the queue -------------------------------------------------------------

    def offer(self, w: Waiter, now: float) -> tuple[Shed | None, list[Waiter]]:
        """Queue ``w`` or refuse it; returns (refusal or None, entries it displaced)."""
        cfg = self.config
        # With nothing queued the request is next: it waits for one release,
        # which the deadline check at dispatch covers.
        # Before any release there is no drain rate to predict from. With an
        # empty queue the wait is one release, unless higher priorities take
        # every release (then it is infinite: shed now, not at the deadline).
        if (cfg.shed_on_predicted_wait and w.deadline < math.inf and self.warmed(now)
                and now + self.predicted_wait(w.priority, now) > self.latest_start(w)):
            return self._shed("deadline", now), []
        displaced: list[Waiter] = []
        while self.length and (self.length >= cfg.queue_max
                               or self.bytes + w.size_bytes > cfg.queue_max_bytes):
            worst = max((x for x in self._heap if x.state == "queued"), key=Waiter.key)
            if worst.priority <= w.priority:
                for d in displaced:  # undo: the newcomer is refused after all
                    self._insert(d)
                    d.state = "queued"
                return self._shed("queue_full", now), []
            self._remove(worst)
            worst.state = "shed"
            displaced.append(worst)
        if self.length >= cfg.queue_max or w.size_bytes > cfg.queue_max_bytes:
            return self._shed("queue_full", now), []
        for _ in displaced:
            self.shed_total["displaced"] = self.shed_total.get("displaced", 0) + 1
        self._insert(w)
        return None, displaced

    def _shed(self, reason: str, now: float) -> Shed:
        self.shed_total[reason] = self.shed_total.get(reason, 0) + 1
        return Shed(reason, self.retry_after(now))

    def _insert(self, w: Waiter) -> None:
        self._seq += 1
        w.seq = self._seq
        w.state = "queued"
        heapq.heappush(self._heap, w)
        self.length += 1
        self.bytes += w.size_bytes
        self.by_priority[w.priority] += 1

    def _remove(self, w: Waiter) -> None:
        self._heap.remove(w)
        heapq.heapify(self._heap)
        self._uncount(w)

    def _uncount(self, w: Waiter) -> None:
        self.length -= 1
        self.bytes -= w.size_bytes
        self.by_priority[w.priority] -= 1

    def peek(self) -> Waiter | None:
        """The next entry to dispatch (cancelled ones are dropped on the way)."""
        heap = self._heap
        while heap and heap[0].state != "queued":
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop(self) -> Waiter:
        """Remove and return the next entry (call :meth:`peek` first to know there is one)."""
        self.peek()
        w = heapq.heappop(self._heap)
        self._uncount(w)
        return w

    def queued(self) -> list[Waiter]:
        """The entries still waiting, in queue order."""
        return sorted(w for w in self._heap if w.state == "queued")

    def cancel(self, w: Waiter) -> bool:
        """The client went away: leave the queue now. False if it was not queued."""
        if w.state != "queued":
            return False
        w.state = "cancelled"
        self._uncount(w)
        return True

    def expire(self, now: float) -> list[Waiter]:
        """Entries past their deadline, removed (the caller sheds them)."""
        if not self.config.expire or not self.length:
            return []
        late = [w for w in self._heap if w.state == "queued" and self.latest_start(w) <= now]
        for w in late:
            w.state = "shed"
            self._uncount(w)
            self.shed_total["expired"] = self.shed_total.get("expired", 0) + 1
        return late


__all__ = [
    "PRIORITIES",
    "PRIORITY_NAMES",
    "AdmissionConfig",
    "AdmissionQueue",
    "Shed",
    "Waiter",
]
