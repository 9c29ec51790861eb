"""Slow KV links between a prefill node and a decode node: the link's fault, not a node's.

In disaggregated serving a decode node's first token for a prompt computed
elsewhere comes after the prompt's KV has crossed the link between the two
nodes (:mod:`tailguard.core.kv_transfer`) and one decode step. A slow link
(a congested fabric, a NIC fallen back to TCP) makes that first token late
while both nodes compute as fast as ever, so neither node's evidence may
carry it: the decode ticket is not judged by its first token at all
(:meth:`~tailguard.core.learner.Learner.hand_off`), and the delay is judged
here, per pair.

A hand-off sample is the time from the hand-off to the decode node's first
token against what the pair's link and one step predict. Its excess counts
as slow when it is more than ``SLOW_RATIO - 1`` times the expected transfer
*and* more than the noise a healthy hand-off shows: the network round trip
and up to two of the node's steps (the step in progress when the request
arrives, and its own), ``NOISE_STEPS`` steps plus ``NOISE_S``. A link is
flagged when ``MIN_SLOW`` of its last ``WINDOW`` samples are slow, and its
slowness (the median of those samples' measured over expected transfer)
is given to the router, which then prices the pair's transfers at it
(:attr:`~tailguard.core.kv_transfer.LinkMap.slowness`). A flagged link recovers after ``WINDOW`` clean
samples in a row; one the router no longer uses recovers its price by half
(in log) every ``REGAIN_S`` seconds, so that it is tried again.

Worked example: an 8B model's 12k-token prompt moves in 18 ms over 87 GB/s;
at a tenth of that rate it takes 180 ms, an excess of 162 ms against a noise
allowance of about 2 x 30 ms + 10 ms at an A100's decode step: slow. A link
at half its rate (an excess of 18 ms) stays within the noise: such a link
costs a prompt less than one decode step, and is not worth a verdict.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

from tailguard.core.events import Event

SLOW_RATIO = 2.0  # a transfer this many times its expected time is slow
NOISE_STEPS = 2.0  # ...beyond this many of the decode node's steps
NOISE_S = 0.01  # ...and the network round trip
WINDOW = 6  # samples a link's verdict looks at
MIN_SLOW = 4  # of them slow to flag it
REGAIN_S = 30.0  # an unused flagged link's price halves (in log) this often


class _Link:
    __slots__ = ("flagged", "since", "slowness", "t", "window")

    def __init__(self) -> None:
        self.window: deque[tuple[bool, float]] = deque(maxlen=WINDOW)
        self.flagged = False
        self.slowness = 1.0
        self.t = 0.0  # last sample
        self.since = 0.0  # flagged since


class LinkWatch:
    """Hand-off samples per (prefill node, decode node) pair, and their verdicts."""

    __slots__ = ("_links", "_pending", "samples")

    def __init__(self) -> None:
        self._links: dict[tuple[str, str], _Link] = {}
        self._pending: list[Event] = []
        self.samples = 0

    def on_hand_off(self, src: str, dst: str, measured: float, kv_s: float, step_s: float,
                    now: float) -> None:
        """The decode node ``dst`` gave its first token ``measured`` seconds after
        the hand-off of a prompt computed on ``src``, whose transfer was expected
        to take ``kv_s`` and the node's step ``step_s``."""
        if kv_s <= 0.0:
            return
        self.samples += 1
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[(src, dst)] = _Link()
        excess = measured - kv_s - step_s
        slow = excess > (SLOW_RATIO - 1.0) * kv_s and excess > NOISE_STEPS * step_s + NOISE_S
        link.window.append((slow, max(1.0, (measured - step_s) / kv_s)))
        link.t = now
        flagged_now = sum(1 for s, _ in link.window if s) >= MIN_SLOW
        if flagged_now and not link.flagged:
            link.flagged, link.since = True, now
            link.slowness = median(r for s, r in link.window if s)
            self._pending.append(Event(now, f"{src}->{dst}", "link", "slow",
                                       f"KV transfers {link.slowness:.1f}x expected "
                                       f"({sum(s for s, _ in link.window)} of the last "
                                       f"{len(link.window)} hand-offs slow)"))
        elif link.flagged and len(link.window) == WINDOW and not any(s for s, _ in link.window):
            link.flagged, link.slowness = False, 1.0
            self._pending.append(Event(now, f"{src}->{dst}", "link", "recovered",
                                       f"KV transfers as expected again ({WINDOW} hand-offs)"))

    def tick(self, now: float, prices: dict[tuple[str, str], float]) -> list[Event]:
        """The verdicts since the last tick; ``prices`` (the pools' shared
        :attr:`LinkMap.slowness`) gets each flagged pair's, an unused one's eased
        toward its nominal rate."""
        out, self._pending = self._pending, []
        for pair, link in self._links.items():
            if not link.flagged:
                prices.pop(pair, None)
                continue
            idle = now - link.t
            price = link.slowness
            if idle > REGAIN_S:
                price = math.exp(math.log(price) * 0.5 ** (idle / REGAIN_S))
            prices[pair] = price
        return out
