"""The streams a simulated gateway would see arrive, told to the detector each tick.

The live gateway tells the core each second of a committed stream how many
tokens have arrived (``Exchange.streaming``), so the outlier detector judges a
long answer piece by piece while it runs. The simulator's engine model
reports no progress by itself: at each tick, :class:`StreamReports` reads the
tokens each committed stream had generated a one-way trip earlier
(``Engine.tokens_by``) and tells its exchange, skipping the streams whose
exchange said there is nothing to judge yet.

A step of a node's engine that lasts STALL_S or more (a pause, a throttle
that stretches every step) leaves its streams silent from its start to its
end: live, no chunk comes, so none of them is told meanwhile, and the first
chunk after it tells its stream's exchange of the gap (``Exchange.silent``,
which the node may count as a stall) before the piece across it is judged.
:meth:`StreamReports.long_step` notes such a step; the streams due on its node
wait for its end, where :meth:`StreamReports.quiet_ended` tells the gap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from tailguard.core.exchange import COMMITTED, Copy, Exchange
from tailguard.core.fleet import STALL_S
from tailguard.sim.nodes import SimNode


class StreamReports:
    """The committed streams, by when each is next worth telling about."""

    __slots__ = ("_due", "_notes", "_order", "_quiet")

    def __init__(self) -> None:
        # (due, commit order, copy id, its exchange, the copy): a tick pops only the
        # streams due, and tells them in the order they were committed.
        self._due: list[tuple[float, int, int, Exchange, Copy]] = []
        self._order = 0
        # Node index -> (start, end) in engine time of its long step under way, and
        # the note's number.
        self._quiet: dict[int, tuple[float, float, int]] = {}
        self._notes = 0

    def __bool__(self) -> bool:
        return bool(self._due)

    def committed(self, ex: Exchange, copy: Copy, due: float) -> None:
        """``copy`` of ``ex`` streams; its exchange is first worth telling at ``due``."""
        self._order += 1
        heapq.heappush(self._due, (due, self._order, copy.io, ex, copy))

    def long_step(self, ns: SimNode, now: float) -> tuple[float, int] | None:
        """The step under way on ``ns`` at ``now``, where it lasts STALL_S or more:
        noted, and its end returned with the note's number (None otherwise, or where
        it was noted already)."""
        span = ns.engine.step_span(now)
        if span is None or span[1] - span[0] < STALL_S:
            return None
        noted = self._quiet.get(ns.index)
        if noted is not None and noted[:2] == span:
            return None
        self._notes += 1
        self._quiet[ns.index] = (span[0], span[1], self._notes)
        return span[1], self._notes

    def quiet_ended(self, ns: SimNode, note: int, now: float, copy_node: Sequence[int],
                    one_way_s: float) -> None:
        """The long step of ``ns`` noted as ``note`` has ended, as the gateway sees it
        (``now``): the first of its streams tells its exchange of the gap. Nothing
        where a later fault made that step longer (its new end does it)."""
        noted = self._quiet.get(ns.index)
        if noted is None or noted[2] != note:
            return
        del self._quiet[ns.index]
        first = min((e for e in self._due if copy_node[e[2]] == ns.index
                     and e[3].ended is None and e[4].state == COMMITTED),
                    key=_commit_order, default=None)
        if first is not None:
            first[3].silent(first[4], noted[0] + one_way_s + ns.delay, now)

    def report(self, now: float, nodes: Sequence[SimNode], copy_node: Sequence[int],
               one_way_s: float) -> None:
        """Tell each stream due by ``now`` its exchange the tokens seen by then
        (generated a one-way trip, plus the node's extra delay, earlier); forget the
        ended ones. A stream of a node in a long step waits for its end."""
        due = self._due
        ready = []
        while due and due[0][0] <= now:
            ready.append(heapq.heappop(due))
        if len(ready) > 1:
            ready.sort(key=_commit_order)
        quiet = self._quiet
        for _, order, cid, ex, copy in ready:
            if ex.ended is not None or copy.state != COMMITTED:
                continue
            ns = nodes[copy_node[cid]]
            seen = now - one_way_s - ns.delay
            if quiet:
                span = quiet.get(ns.index)
                if span is not None and span[0] <= seen < span[1]:  # silent: nothing came
                    heapq.heappush(due, (span[1] + one_way_s + ns.delay, order, cid, ex, copy))
                    continue
            try:
                tokens = ns.engine.tokens_by(cid, seen)
            except KeyError:  # ended at the engine; its end is on the way
                continue
            when = ex.streaming(copy, tokens, now)
            if when < math.inf:
                heapq.heappush(due, (when, order, cid, ex, copy))


def _commit_order(entry: tuple[float, int, int, Exchange, Copy]) -> int:
    return entry[1]


__all__ = ["StreamReports"]
