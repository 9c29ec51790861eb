"""The decode batch of the engine model, kept as aggregates (no per-request work per step).

Every decoding request stores ``e = prompt + generated - step_counter`` at the
moment it joins, so its context at engine step ``s`` is ``e + s`` and its
token count follows the step counter. The batch keeps ``sum(e)``,
``sum(e // bs)`` and a ``block_size``-bin histogram of ``e % bs``: its KV
blocks at any future step, and the first step at which they outgrow the
cache, take ``O(block_size)``. Finishing steps sit in a heap, with lazy
deletion (an ``epoch`` per stay) when a request is cancelled or preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heappop, heappush

from tailguard.engine.request import DECODE, WAITING, Request

_NONE: tuple[Request, ...] = ()


class DecodeBatch:
    """The requests past their prefill, one token each per step."""

    __slots__ = ("bs", "e", "epoch", "g", "heap", "hist", "n", "q")

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.n = 0
        self.e = 0  # sum of e
        self.q = 0  # sum of e // bs
        self.hist = [0] * block_size  # histogram of e % bs
        self.g = 0  # sum of g0 - s0: tokens of the batch at step s are g + n*s
        self.heap: list[tuple[int, int, int, Request]] = []  # (finish step, id, epoch, req)
        self.epoch = 0

    def clear(self) -> None:
        self.n = self.e = self.q = self.g = 0
        self.hist = [0] * self.bs
        self.heap.clear()

    def join(self, r: Request, s: int) -> None:
        """``r`` (holding ``r.gen`` tokens) decodes from step ``s`` on."""
        g0 = r.gen
        e = r.prompt + g0 - s
        q, rem = divmod(e, self.bs)
        self.n += 1
        self.e += e
        self.q += q
        self.hist[rem] += 1
        self.g += g0 - s
        self.epoch += 1
        r.state = DECODE
        r.g0 = g0
        r.s0 = s
        r.epoch = self.epoch
        heappush(self.heap, (s + r.output - g0, r.rid, self.epoch, r))

    def leave(self, r: Request, s: int) -> None:
        """``r`` leaves at step ``s``; ``r.gen`` becomes its token count (callers set its state)."""
        e = r.prompt + r.g0 - r.s0
        q, rem = divmod(e, self.bs)
        self.n -= 1
        self.e -= e
        self.q -= q
        self.hist[rem] -= 1
        self.g -= r.g0 - r.s0
        r.gen = r.g0 + s - r.s0
        r.state = WAITING

    def finished_by(self, s: int) -> Sequence[Request]:
        """Pop the members whose last token is at a step before ``s`` (still members)."""
        heap = self.heap
        if not heap or heap[0][0] > s:
            return _NONE  # the usual case: no allocation
        done: list[Request] = []
        while heap and heap[0][0] <= s:
            _, _, epoch, r = heappop(heap)
            if r.epoch == epoch and r.state == DECODE:
                done.append(r)  # else stale: cancelled or preempted
        return done

    def blocks(self, s: int) -> int:
        """KV blocks the batch needs for step ``s``: sum of ceil((e_i + s)/bs)."""
        n = self.n
        if n == 0:
            return 0
        bs = self.bs
        m, j = divmod(s, bs)
        # (e_i + s) = bs*(q_i + m) + (r_i + j) with 0 <= r_i + j <= 2*bs - 2
        total = self.q + n * m + n
        if j == 0:
            total -= self.hist[0]
        elif j > 1:
            total += sum(self.hist[bs + 1 - j :])
        return total

    def run_length(self, s: int, free: int) -> int:
        """Steps of a pure-decode run from step ``s``: up to the first finish or KV overflow."""
        heap = self.heap
        while True:  # drop stale heap tops (cancelled or preempted requests)
            top = heap[0]
            r = top[3]
            if r.epoch == top[2] and r.state == DECODE:
                break
            heappop(heap)
        n_fin = top[0] - s
        # Blocks gained by step s+k: sum_i floor((k + u_i)/bs), u_i = (ctx_i(s) - 1) % bs.
        # With free = n*m0 + rem, the first overflow is at k = m0*bs + j for the smallest
        # j whose count of u_i >= bs - j exceeds rem (else at (m0 + 1)*bs).
        bs = self.bs
        m0, rem = divmod(free, self.n)
        if m0 * bs >= n_fin:
            return n_fin
        hist = self.hist
        shift = (s - 1) % bs  # u = (r + s - 1) % bs for e % bs == r
        cum = 0
        n_kv = (m0 + 1) * bs
        for j in range(1, bs):
            cum += hist[(bs - j - shift) % bs]
            if cum > rem:
                n_kv = m0 * bs + j
                break
        return n_fin if n_fin < n_kv else n_kv
