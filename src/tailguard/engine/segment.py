"""Closed-form timing of a run of identical-batch engine steps.

Between two changes of its batch (an admission, a completion, a preemption,
a prefill chunk) an engine repeats the same decode step; only the context
sum grows, by ``B`` (the batch size) per step. With the roofline of
:meth:`tailguard.core.hardware.PerfModel.step_time`, step ``j`` of such a run
(context sum ``X0 + B*j``) takes::

    t(j) = K + max(m0 + m1*j, c0 + c1*j)

    m0 = weight_s + kv_s*X0           m1 = kv_s*B          (memory line)
    c0 = token_flop_s*B + attn*X0     c1 = attn*B          (compute line)
    K  = fixed_s + allreduce_token_s*B

The maximum of two lines is one line up to their crossover ``j*`` and the
other after it, so the time of the first ``k`` steps is two arithmetic
series, and "how many whole steps end by time t" is the root of a quadratic,
fixed up by +-1 with the exact sum (so forward and inverse agree to the bit).

Worked example: ``K = 3 ms``, memory line ``10 ms + 0.01 ms*j``, compute line
``8 ms + 0.03 ms*j``; the lines cross at ``j* = 2/0.02 = 100``. Steps 0..99
follow memory, steps 100.. follow compute::

    S(100) = 100*(3 + 10) + 0.01*100*99/2           = 1349.5 ms
    S(150) = S(100) + 50*(3 + 8 + 0.03*100) + 0.03*50*49/2 = 2086.25 ms

Inverse for 2000 ms: 1349.5 ms covers 100 steps; the remaining 650.5 ms on
the compute piece (base 14 ms, slope 0.03 ms) solve
``0.015*m^2 + 13.985*m = 650.5`` for ``m = 44.4``: 144 whole steps end by then.

A segment is one of: a pause (``n == 0``: a stall of an idle engine), one
step that carries prefill chunks (``n == 1``), or a pure-decode run
(``n >= 1``, timed by the formula above). Step ``k`` of a run ends at
``t0 + S(k+1)/speed``; the last step ends at ``end`` (which includes any stall
added while that step ran).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailguard.engine.request import Request


class Segment:
    """A stretch of steps whose composition is fixed; see the module docstring."""

    __slots__ = ("a1", "a2", "b1", "b2", "chunks", "end", "js", "n", "r_js", "s0", "speed", "t0")

    def __init__(self, t0: float, s0: int, n: int, end: float, speed: float) -> None:
        self.t0 = t0
        self.s0 = s0  # engine step counter when the segment's first step starts
        self.n = n
        self.end = end
        self.speed = speed
        self.chunks: list[tuple[Request, int]] | None = None
        # Two linear pieces of the per-step time (raw, before dividing by speed):
        # step j < js costs a1 + b1*j; step j >= js costs a2 + b2*(j - js).
        self.a1 = 0.0
        self.b1 = 0.0
        self.js = 0
        self.a2 = 0.0
        self.b2 = 0.0
        self.r_js = 0.0  # raw time of the first js steps

    @classmethod
    def decode_run(
        cls,
        t0: float,
        s0: int,
        n: int,
        speed: float,
        *,
        m0: float,
        m1: float,
        c0: float,
        c1: float,
        k: float,
    ) -> Segment:
        """A run of ``n`` decode steps whose step ``j`` costs ``k + max(m0+m1*j, c0+c1*j)``."""
        seg = cls(t0, s0, n, t0, speed)
        # Orient so that piece 1 is the line that dominates first.
        if m1 >= c1:
            lo0, lo1, hi0, hi1 = c0, c1, m0, m1
        else:
            lo0, lo1, hi0, hi1 = m0, m1, c0, c1
        # The steeper line (hi) dominates from js on: first j with hi(j) >= lo(j).
        gap = lo0 - hi0
        slope = hi1 - lo1
        if gap <= 0.0:
            js = 0
        elif gap >= slope * n:  # no crossover within the run (also keeps the division finite)
            js = n
        else:
            js = min(n, math.ceil(gap / slope))
        seg.js = js
        seg.a1 = lo0 + k
        seg.b1 = lo1
        seg.a2 = hi0 + hi1 * js + k
        seg.b2 = hi1
        seg.r_js = js * seg.a1 + seg.b1 * (js * (js - 1) // 2)
        seg.end = seg.time_at(n)
        return seg

    def time_at(self, k: int) -> float:
        """End time of the run's ``k``-th step (``t0`` for ``k == 0``), without stalls."""
        if k <= self.js:
            raw = k * self.a1 + self.b1 * (k * (k - 1) // 2)
        else:
            m = k - self.js
            raw = self.r_js + m * self.a2 + self.b2 * (m * (m - 1) // 2)
        return self.t0 + raw / self.speed

    def steps_done_by(self, now: float) -> int:
        """Whole steps of the run that have ended by ``now``, at most ``n - 1``.

        The last step is never reported done here: it ends at ``end``, which
        the engine handles as the end of the segment.
        """
        last = self.n - 1
        if last <= 0 or now <= self.t0:
            return 0
        y = (now - self.t0) * self.speed
        if y <= self.r_js or self.js >= last:
            base, a, b, y0 = 0, self.a1, self.b1, y
        else:
            base, a, b, y0 = self.js, self.a2, self.b2, y - self.r_js
        # m steps of a piece cost a*m + b*m*(m-1)/2; solve for the largest m <= y0
        # in the numerically stable form of the quadratic root.
        h = a - 0.5 * b
        disc = h * h + 2.0 * b * y0
        den = h + math.sqrt(disc) if disc > 0.0 else h
        est = 2.0 * y0 / den if den > 0.0 else float(last)
        k = base + int(est) if est < last else last
        k = min(max(k, 0), last)
        # Fix-up against the exact forward sum, so inverse(forward(k)) == k.
        while k < last and self.time_at(k + 1) <= now:
            k += 1
        while k > 0 and self.time_at(k) > now:
            k -= 1
        return k


__all__ = ["Segment"]
