"""The streams a simulated gateway would see arrive, told to the detector each tick.

The live gateway tells the core each second of a committed stream how many
tokens have arrived (``Exchange.streaming``), so the outlier detector judges a
long answer piece by piece while it runs. The simulator's engine model
reports no progress by itself: at each tick, :class:`StreamReports` reads the
tokens each committed stream had generated a one-way trip earlier
(``Engine.tokens_by``) and tells its exchange, skipping the streams whose
exchange said there is nothing to judge yet.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from tailguard.core.exchange import COMMITTED, Copy, Exchange
from tailguard.sim.nodes import SimNode


class StreamReports:
    """The committed streams, by when each is next worth telling about."""

    __slots__ = ("_due", "_order")

    def __init__(self) -> None:
        # (due, commit order, copy id, its exchange, the copy): a tick pops only the
        # streams due, and tells them in the order they were committed.
        self._due: list[tuple[float, int, int, Exchange, Copy]] = []
        self._order = 0

    def __bool__(self) -> bool:
        return bool(self._due)

    def committed(self, ex: Exchange, copy: Copy, due: float) -> None:
        """``copy`` of ``ex`` streams; its exchange is first worth telling at ``due``."""
        self._order += 1
        heapq.heappush(self._due, (due, self._order, copy.io, ex, copy))

    def report(self, now: float, nodes: Sequence[SimNode], copy_node: Sequence[int],
               one_way_s: float) -> None:
        """Tell each stream due by ``now`` its exchange the tokens seen by then
        (generated a one-way trip, plus the node's extra delay, earlier); forget the
        ended ones."""
        due = self._due
        ready = []
        while due and due[0][0] <= now:
            ready.append(heapq.heappop(due))
        if len(ready) > 1:
            ready.sort(key=_commit_order)
        for _, order, cid, ex, copy in ready:
            if ex.ended is not None or copy.state != COMMITTED:
                continue
            ns = nodes[copy_node[cid]]
            try:
                tokens = ns.engine.tokens_by(cid, now - one_way_s - ns.delay)
            except KeyError:  # ended at the engine; its end is on the way
                continue
            when = ex.streaming(copy, tokens, now)
            if when < math.inf:
                heapq.heappush(due, (when, order, cid, ex, copy))


def _commit_order(entry: tuple[float, int, int, Exchange, Copy]) -> int:
    return entry[1]


__all__ = ["StreamReports"]
