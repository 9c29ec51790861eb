"""Silence: how long a node has gone without answering past a prompt's due time,
and the stalls that silence makes.

What :meth:`Silence.overdue_s` reads: the requests still waiting for their first
token, oldest first (those that moved on are dropped when they reach the front);
the earliest due time of one that left unanswered after it (a hedge's loser, a
client gone: the node owed it, and the debt stands until it answers anything);
the node's last first token or good finish. The router adds the silence to its
predicted TTFT; the outlier detector leaves the decode timed across a stall out
of its evidence (:meth:`Silence.spans_stall`) and prices a node that stalls often
by its stalls instead.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, ClassVar, Protocol

# A prompt is overdue (Silence.overdue_s) once it has waited OVERDUE_FACTOR times its
# expected time to first token, at its class's learned prefill speed: a node
# whose prompts run late by less is slow, which the learner prices.
OVERDUE_FACTOR = 2.0
# How long a request cancelled past its due time (a hedge's loser) keeps its node
# overdue when nothing else there is waiting: then one request probes the node,
# which either answers (it is back) or is overdue itself within twice its
# expected TTFT. Without an end, a node left silent would never be sent another
# request, and never seen to recover (the outlier detector, not this, ejects).
OWED_S = 1.0
# A silence past a due prompt is a stall (Silence.spans_stall) once it lasts this long
# (long enough that a piece of decode timed across it reads several times slow)
# and OVERDUE_FACTOR times the prompt's whole allowance (its due time less its
# dispatch): a node 3x slow answers a prompt at 3x its expected TTFT, 1.5x its
# allowance, so only one silent past 6x is taken for stalled; a slow node's
# slowest answers are not stalls, and their decode stays in the evidence.
STALL_S = 1.0


class Awaited(Protocol):
    """What a node's overdue check reads of a dispatched request (balancer.Ticket).

    ``due``: when its first token is overdue, inf while it waits for an engine
    slot (the node sets it once one frees: :meth:`Silence.slot_freed`);
    ``allowance``: its due less the time its wait began.
    """

    due: float
    allowance: float

    @property
    def t_dispatch(self) -> float: ...
    @property
    def t_first(self) -> float: ...
    @property
    def released(self) -> bool: ...
    @property
    def presumed(self) -> bool: ...


class Silence:
    """Overdue prompts and stalls (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ("awaited", "debt_due", "debt_limit", "overdue_at", "owed_due", "owed_until",
              "progress_t", "stall_from", "stall_to", "stalled_s", "stalls")

    decoding: int  # read from the node's load
    prefilling: int
    kv_short_until: float
    awaited: deque[Awaited]
    owed_due: float
    owed_until: float
    progress_t: float
    # The last stall seen to end: from when the node was silent past a due
    # prompt, to the answer that ended the silence.
    stall_from: float
    stall_to: float
    stalls: int  # stalls seen to end, and their silence in all (the detector's)
    stalled_s: float
    # The earliest due of a prompt that left unanswered while others were in
    # flight, and the silence past it that makes a stall, until the next
    # answer: a stall whose waiting prompts were all hedged away is a stall.
    debt_due: float
    debt_limit: float
    # The earliest time overdue_s can be above 0, as it last found (-inf: look
    # again; set so whenever the front of ``awaited`` may have changed), so a
    # policy calls it only when it can matter.
    overdue_at: float

    def _init_silence(self) -> None:
        self.awaited = deque()
        self.owed_due = math.inf
        self.owed_until = 0.0
        self.progress_t = 0.0
        self.stall_from = self.stall_to = -math.inf
        self.stalls = 0
        self.stalled_s = 0.0
        self.debt_due = math.inf
        self.debt_limit = STALL_S
        self.overdue_at = -math.inf

    def overdue_s(self, now: float) -> float:
        """How long the node has been silent past its oldest waiting prompt's due
        time: 0 while it answers (a first token or a finish since that time) or
        nothing is overdue.

        A request cancelled past its due time (a hedge's loser) still counts
        until the node next answers, for at most OWED_S: otherwise every hedge
        would clear the evidence, and the router send the next request into the
        stall. A failed request says nothing here (the outlier detector counts
        failures).
        A stalled engine (a pause, a hung card, a stuck scheduler) shows here
        within a fraction of a second, long before its learned speed or the
        outlier detector moves: every request sent to it meanwhile waits out
        the rest of the stall, so the router adds this to its predicted TTFT.
        A node merely busy keeps producing first tokens and finishes; one
        merely slow is late by less than OVERDUE_FACTOR, which its learned
        speed prices. Only this replica's requests are seen.
        """
        q = self._trim()
        due = q[0].due if q else math.inf
        if self.owed_due < due:
            if now < self.owed_until:
                due = self.owed_due
            else:
                self.owed_due = math.inf  # expired: the next request probes the node
        since = due if due > self.progress_t else self.progress_t
        self.overdue_at = since
        return now - since if now > since else 0.0

    def spans_stall(self, since: float, now: float) -> bool:
        """Whether work timed from ``since`` to ``now`` overlaps a stall: a silence
        past a due prompt of STALL_S or more, the last one seen to end or one
        still going on.

        Such a sample times the stall, not the node's speed: a piece of decode
        across a 2 s pause reads 3x slow on a node as fast as its peers. The
        router already dodges a stall as it happens (:meth:`overdue_s`); the
        outlier detector, counting it again as slowness, weighted a node that
        paused 2 s in every 10 at a third of its worth. Overlap, not only
        spanning: a driver that reads a stream's tokens on a clock (the
        simulator's ticks) may end a piece inside the stall and begin the next
        there. A node that decodes on through a silence of its prompts alone
        (a stuck prefill) has those pieces left out too.
        """
        if since < self.stall_to and now > self.stall_from:
            return True
        # overdue_at is never later than the silence's start: most calls end here.
        if now - self.overdue_at < STALL_S:
            return False
        silent = self.overdue_s(now)
        return silent >= STALL_S and silent >= self._stall_limit()

    def _stall_limit(self) -> float:
        """How long a silence past the oldest waiting prompt's due time makes a stall
        (STALL_S): at least twice that prompt's allowance (its due less its dispatch)."""
        q = self.awaited
        if not q:  # a debt (``owed_due``) alone: the absolute bound
            return STALL_S
        w = OVERDUE_FACTOR * q[0].allowance
        return w if w > STALL_S else STALL_S

    def _trim(self) -> deque[Awaited]:
        """Drop the requests at the front that are no longer waiting."""
        q = self.awaited
        while q and (q[0].t_first >= 0.0 or q[0].released or q[0].presumed):
            q.popleft()
        return q

    def awaits(self, req: Awaited) -> None:
        """A request dispatched here waits for its first token (:meth:`overdue_s`)."""
        if not self.awaited:
            self.overdue_at = -math.inf
            if self.decoding <= 0 and self.prefilling <= 0:
                self.debt_due = math.inf  # idle since: it owed nothing meanwhile
        self.awaited.append(req)

    def slot_freed(self, now: float) -> None:
        """A request that held an engine slot ended: the oldest prompt waiting for
        one starts its wait for its first token now.

        A prompt sent to a node whose slots were all taken waits for a running
        answer to end, a wait the roofline does not price: due at its dispatch,
        a llama.cpp server with two slots at a third of its speed had its queued
        prompts late by seconds at every answer, each taken for a stall, and the
        decode that would have caught it left out of the evidence.
        """
        for req in self.awaited:
            if req.due == math.inf and req.t_first < 0.0 and not req.released \
                    and not req.presumed:
                req.due = now + req.allowance
                return

    def progressed(self, now: float) -> None:
        """A first token or a good finish: the node is answering (:meth:`overdue_s`)."""
        q = self.awaited
        due, limit = self.debt_due, self.debt_limit
        if q and q[0].due <= due:  # the front may be the one answering now: its due counts
            due, limit = q[0].due, self._stall_limit()
        since = due if due > self.progress_t else self.progress_t
        # A silence while the node was short of KV cache (Load.kv_short), or still
        # recomputing what it preempted then, is its prompts queued for room or
        # that recompute, not a stall: as the detector's samples (kv_short_since).
        if now - since >= STALL_S and now - since >= limit and self.kv_short_until < since:
            self._stalled(since, now)
        self.debt_due = math.inf
        self.progress_t = now
        self.owed_due = math.inf
        self.overdue_at = -math.inf
        self._trim()  # bounded by what is in flight, whether or not a policy reads it

    def stream_silent(self, since: float, now: float, limit: float) -> None:
        """A stream decoding here sent nothing from ``since`` (its token before) to
        ``now`` (the one that ended the gap); ``limit``: the longest gap the node's
        engine makes when healthy (a long step), times OVERDUE_FACTOR twice, as a
        prompt's silence is held to twice its allowance.

        A pause that catches no prompt waiting freezes the streams alone: the
        prompts' silence never sees it, and the decode timed across it reads
        several times slow. The gap is a stall when nothing else on the node answered
        meanwhile and no prompt is still waiting: a prompt that held the
        engine (one computed whole, not in chunks) ends the gap with its first
        token, or is still waiting for it when the streams resume. The node's
        other streams, silent through the same pause, tell the same stall.
        """
        if now - since < STALL_S or now - since < limit or self.progress_t > since \
                or self.prefilling > 0 or self.kv_short_until >= since:
            return
        self._stalled(since, now)

    def _stalled(self, since: float, now: float) -> None:
        """A silence from ``since`` to ``now`` was a stall: one more, unless it is the
        last one's, told again (by another of its streams, or by its prompts)."""
        if since < self.stall_to:
            if now > self.stall_to:
                self.stalled_s += now - self.stall_to
                self.stall_to = now
            return
        self.stall_from, self.stall_to = since, now
        self.stalls += 1
        self.stalled_s += now - since

    def left_unanswered(self, due: float, now: float, allowance: float = 0.0) -> None:
        """A request was cancelled before its first token at ``now`` (``due``: its
        due time, ``allowance``: due less dispatch), or (``due`` inf) failed or was
        taken as prefilled without one."""
        if due < now and due < self.owed_due:
            self.owed_due = due
            self.owed_until = now + OWED_S
        if due < now and due < self.debt_due and (self.decoding > 0 or self.prefilling > 0):
            self.debt_due = due
            w = OVERDUE_FACTOR * allowance
            self.debt_limit = w if w > STALL_S else STALL_S
        self.overdue_at = -math.inf
        self._trim()
