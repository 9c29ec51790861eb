"""Mid-stream migration in the simulator: what a gateway would see of a stalled
stream, and the longest gap between two tokens that each client saw.

The engine model reports a request's first token and its end, not each token,
so the simulated gateway cannot time the silence after every token as the live
one does. :class:`StreamWatch` finds silences where they can happen: in a
*long step* of an engine (a step composed with big prefill chunks, a stall
fault, a throttled rank), every request decoding in it waits from the step's
start to its end. Each time a node's engine composes a step (and when a fault
changes one), the step under way is looked at (``Engine.step_span``); when it
is longer than the gap resolution it is logged, and when it is longer than the
stall floor a review is scheduled for ``start + stall_after``: the committed
streams on that node that have been silent that long are reported to their
exchange (``Exchange.review``), which may move them. A moved stream whose
stalled step then ends before its continuation's first token resumed first
(``Exchange.resumed``), as live; one moved for its node's state is cut there
instead.

The gaps: a request's longest gap is the longest logged step inside the window
where its answer came from one node, cut at the window's end, and, where it
moved, the handover (from its last token on the old node to the
continuation's first). Gaps under :data:`GAP_RESOLUTION_S` are not logged: a
request with none reports the resolution (an upper bound). A request that
failed reports ``inf``: the client never got the rest.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

from tailguard.core.exchange import COMMITTED, Action, Copy, Exchange, Phase
from tailguard.core.fleet import NodeState
from tailguard.core.migration import LEAVE_NOW
from tailguard.sim.nodes import SimNode

# Steps shorter than this are not logged: healthy decode and prefill steps.
GAP_RESOLUTION_S = 0.25

Do = Callable[[Exchange, tuple[Action, ...], float], None]
Push = Callable[[float, int, int], None]  # (time, node or copy id, kind: REVIEW/WATCH/RESUME)
REVIEW, WATCH, RESUME = 0, 1, 2


class StreamWatch:
    """Committed streams per node, long steps per node, and the moved requests' windows."""

    def __init__(self, nodes: Sequence[SimNode], copies: list[Copy | None],
                 copy_ex: list[Exchange | None], copy_node: list[int], floor_s: float,
                 do: Do, push: Push) -> None:
        self.nodes = nodes
        self.copies = copies
        self.copy_ex = copy_ex
        self.copy_node = copy_node
        self.floor_s = floor_s  # no stream counts as stalled before this much silence
        self.do = do
        self.push = push
        self.on: list[set[int]] = [set() for _ in nodes]  # committed stream copy ids
        self.long: list[list[tuple[float, float]]] = [[] for _ in nodes]
        self.review_at = [-math.inf] * len(nodes)
        self.watch_at = [-math.inf] * len(nodes)
        # Moved requests: (node, from, until) of each copy the answer came from, the
        # copy it comes from now (id, node, since), the last token of a copy that
        # stopped, and each request's longest handover.
        self.windows: dict[int, list[tuple[int, float, float]]] = {}
        self.current: dict[int, tuple[int, int, float]] = {}
        self.last_token: dict[int, float] = {}
        self.handover: dict[int, float] = {}
        self.crash_tokens: dict[int, int] = {}

    # -- what the simulator tells it ------------------------------------------------

    def committed(self, ex: Exchange, copy: Copy, now: float) -> None:
        """``copy`` of ``ex`` streams to the client from ``now``."""
        cid = copy.io
        ni = self.copy_node[cid]
        self.on[ni].add(cid)
        ns = self.nodes[ni]
        if ns.scheduled - now > GAP_RESOLUTION_S:  # it may have joined a step that stalls
            self.look(ns, now)
        if copy.after is None:
            return
        rid = ex.tag
        old = self.current.get(rid)
        if old is not None:
            ocid, oni, since = old
            self.windows.setdefault(rid, []).append((oni, since, now))
            last = self.last_token.pop(ocid, now)
            if now - last > self.handover.get(rid, 0.0):
                self.handover[rid] = now - last
        self.current[rid] = (cid, ni, now)

    def moving(self, ex: Exchange, old: Copy, first_at: float, now: float) -> None:
        """``ex`` sent a continuation for ``old``, which committed at ``first_at``; its last
        token came at the start of the step under way on its node (or the crash's)."""
        rid = ex.tag
        self.current.setdefault(rid, (old.io, self.copy_node[old.io], first_at))
        if old.io not in self.last_token:
            span = self.nodes[self.copy_node[old.io]].engine.step_span(now)
            self.last_token[old.io] = span[0] if span is not None else now

    def crashing(self, ns: SimNode, now: float) -> None:
        """``ns`` crashes now: its streams' tokens so far and last token, read before."""
        eng = ns.engine
        span = eng.step_span(now)
        start = span[0] if span is not None else now
        for cid in self.on[ns.index]:
            if self.copies[cid] is not None:
                self.crash_tokens[cid] = eng.tokens_by(cid, now)
                self.last_token[cid] = start

    def look(self, ns: SimNode, now: float) -> None:
        """The step under way on ``ns`` changed: log it if long, and schedule the review
        of its streams (and a look at the next step) where it could stall them."""
        span = ns.engine.step_span(now)
        if span is None:
            return
        start, end = span
        if end - start <= GAP_RESOLUTION_S:
            return
        ni = ns.index
        log = self.long[ni]
        if log and log[-1][0] == start:
            if end > log[-1][1]:
                log[-1] = (start, end)
        else:
            log.append((start, end))
        if not self.on[ni]:
            return
        at = max(now, start + self.floor_s)
        if at < end and at != self.review_at[ni]:
            self.review_at[ni] = at
            self.push(at, ni, REVIEW)
        if end < ns.scheduled and end > self.watch_at[ni]:  # a long step inside a run
            self.watch_at[ni] = end
            self.push(end, ni, WATCH)

    def review(self, ni: int, now: float) -> None:
        """The streams on node ``ni`` silent since the start of its step under way:
        each told to its exchange once silent for its own stall trigger."""
        ns = self.nodes[ni]
        span = ns.engine.step_span(now)
        if span is None:
            return
        start, end = span
        silent = now - start
        later = math.inf
        for cid in list(self.on[ni]):
            copy, ex = self.copies[cid], self.copy_ex[cid]
            if copy is None or ex is None or copy.state != COMMITTED:
                self.on[ni].discard(cid)
                continue
            if ex.phase is not Phase.STREAMING or ex.committed is not copy:
                continue
            after = ex.stall_after(copy)
            if silent < after - 1e-9:  # (a review due at start + after may land a hair early)
                later = min(later, start + after)
                continue
            try:
                tokens = ns.engine.tokens_by(cid, now)
            except KeyError:
                continue
            self.last_token[cid] = start
            self.do(ex, ex.review(copy, now, tokens, max(silent, after)), now)
            if _moving(ex):
                self.push(end, cid, RESUME)
            else:  # not moved (the budget, no node): asked again, as the gateway does
                later = min(later, now + after)
        if later < end:
            self.push(later, ni, REVIEW)

    def resume(self, cid: int, now: float) -> None:
        """The stalled step of moved copy ``cid`` ended: if its continuation has not
        sent its first token yet, the stalled copy comes back first (a longer stall
        looks again at its new end)."""
        copy, ex = self.copies[cid], self.copy_ex[cid]
        if copy is None or ex is None or ex.phase is not Phase.MOVING \
                or ex.committed is not copy or copy.state != COMMITTED:
            return
        span = self.nodes[self.copy_node[cid]].engine.step_span(now)
        if span is not None and span[0] < now < span[1] \
                and span[0] == self.last_token.get(cid):
            self.push(span[1], cid, RESUME)  # the stall was made longer
            return
        actions = ex.resumed(copy, now)
        if copy.state == COMMITTED:  # it won: its tokens reach the client again
            self.last_token.pop(cid, None)
        self.do(ex, actions, now)

    def states(self, state_of: Callable[[int], NodeState], now: float) -> None:
        """At a tick: the streams on nodes that left healthy service, to their exchanges."""
        for ni, on in enumerate(self.on):
            if not on:
                continue
            state = state_of(ni)
            if state not in LEAVE_NOW and state is not NodeState.DEGRADED:
                continue  # (the exchange decides whether a degraded node's streams move)
            eng = self.nodes[ni].engine
            for cid in list(on):
                copy, ex = self.copies[cid], self.copy_ex[cid]
                if copy is None or ex is None or copy.state != COMMITTED:
                    on.discard(cid)
                    continue
                try:
                    tokens = eng.tokens_by(cid, now)
                except KeyError:
                    continue
                self.do(ex, ex.review(copy, now, tokens, 0.0), now)
                if _moving(ex):  # it leaves a node still streaming: cut at its next token
                    span = eng.step_span(now)
                    self.push(span[1] if span is not None else now, cid, RESUME)

    def ended(self, copies: Sequence[Copy]) -> None:
        for c in copies:
            if c.io is not None:
                self.on[self.copy_node[c.io]].discard(c.io)

    # -- the gaps -------------------------------------------------------------------

    def gaps(self, node: Sequence[int], first: Sequence[float], end: Sequence[float],
             served: Sequence[bool], one_way_s: float) -> list[float]:
        """Each request's longest gap between two tokens (see the module docstring):
        nan where it was never served or failed before its first token."""
        starts = []
        for log in self.long:
            log.sort()
            starts.append([s for s, _ in log])
        out = []
        for rid in range(len(node)):
            if first[rid] < 0.0:
                out.append(math.nan)
                continue
            if not served[rid]:
                out.append(math.inf)
                continue
            windows = list(self.windows.get(rid, ()))
            cur = self.current.get(rid)
            if cur is not None:
                windows.append((cur[1], cur[2], end[rid]))
            else:
                windows.append((node[rid], first[rid], end[rid]))
            gap = max(GAP_RESOLUTION_S, self.handover.get(rid, 0.0))
            for ni, t0, t1 in windows:
                if ni < 0:
                    continue
                log, s = self.long[ni], starts[ni]
                # in engine time: a token seen at t was made a one-way trip earlier
                lo, hi = t0 - one_way_s, t1 - one_way_s
                i = bisect.bisect_left(s, lo)
                while i < len(s) and s[i] < hi:
                    g = min(log[i][1], hi) - s[i]
                    if g > gap:
                        gap = g
                    i += 1
            out.append(gap)
        return out


def _moving(ex: Exchange) -> bool:
    return ex.phase is Phase.MOVING


__all__ = ["GAP_RESOLUTION_S", "RESUME", "REVIEW", "WATCH", "StreamWatch"]
