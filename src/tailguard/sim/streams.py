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

from collections.abc import Sequence

from tailguard.core.exchange import COMMITTED, Copy, Exchange
from tailguard.sim.nodes import SimNode


class _Stream:
    """A committed stream, and when to tell its exchange again."""

    __slots__ = ("copy", "due", "exchange")

    def __init__(self, exchange: Exchange, copy: Copy, due: float) -> None:
        self.exchange = exchange
        self.copy = copy
        self.due = due


class StreamReports:
    """The committed streams by copy id (the engine's request id)."""

    __slots__ = ("streams",)

    def __init__(self) -> None:
        self.streams: dict[int, _Stream] = {}

    def __bool__(self) -> bool:
        return bool(self.streams)

    def committed(self, ex: Exchange, copy: Copy, now: float) -> None:
        """``copy`` of ``ex`` streams from ``now`` on."""
        self.streams[copy.io] = _Stream(ex, copy, now)

    def report(self, now: float, nodes: Sequence[SimNode], copy_node: Sequence[int],
               one_way_s: float) -> None:
        """Tell each stream's exchange the tokens seen by ``now`` (generated a one-way
        trip, plus the node's extra delay, earlier); forget the ended ones."""
        streams = self.streams
        ended: list[int] = []
        for cid, entry in streams.items():
            ex, copy = entry.exchange, entry.copy
            if ex.ended is not None or copy.state != COMMITTED:
                ended.append(cid)
                continue
            if entry.due > now:  # nothing to judge yet (what the exchange said)
                continue
            ns = nodes[copy_node[cid]]
            try:
                tokens = ns.engine.tokens_by(cid, now - one_way_s - ns.delay)
            except KeyError:  # ended at the engine; its end is on the way
                ended.append(cid)
                continue
            entry.due = ex.streaming(copy, tokens, now)
        for cid in ended:
            del streams[cid]


__all__ = ["StreamReports"]
