"""Retry budget: retries may add at most a fixed share of load (Finagle's RetryBudget).

Retrying every failure doubles the load on a fleet that is failing because it
is overloaded; a budget bounds the extra load. Each request deposits
``ratio`` tokens, each retry withdraws one; on top, ``min_per_s`` tokens per
second trickle in (capped at one second's worth) so a quiet pool can still
fail over. The balance is capped at ``cap`` tokens, so a long healthy spell
cannot bank a retry storm.

Worked example, ratio 0.2, min 5/s: 100 requests in one second deposit 20
tokens plus 5 from the trickle: up to 25 retries in that second, whatever
share of the 100 failed.
"""

from __future__ import annotations

from dataclasses import dataclass

_ONE = 1.0 - 1e-9  # five deposits of 0.2 make one token despite rounding


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Failover before the first byte reached the client.

    ``attempts`` counts the first try; retries go to a node not tried yet.
    ``budget`` is the share of requests that may be retried (each request
    deposits ``budget`` tokens, each retry spends one), plus ``min_per_s``
    retries per second so a quiet pool can still fail over.
    """

    attempts: int = 3
    budget: float = 0.2
    min_per_s: float = 5.0

    def new_budget(self) -> RetryBudget:
        return RetryBudget(self.budget, self.min_per_s)


class RetryBudget:
    __slots__ = ("_t", "balance", "cap", "lent", "min_per_s", "ratio", "reserve")

    def __init__(self, ratio: float, min_per_s: float, cap: float = 1000.0) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.cap = cap
        self.balance = 0.0
        # What this gateway replica may borrow of the others' balance (set by the
        # shared-state driver); a retry on it puts the balance in debt.
        self.lent = 0.0
        self.reserve = min_per_s  # the time-based allowance, refilled per second
        self._t: float | None = None

    def deposit(self) -> None:
        """One request arrived."""
        b = self.balance + self.ratio
        self.balance = b if b < self.cap else self.cap

    def can_spend(self, now: float) -> bool:
        """Whether :meth:`try_spend` would allow a retry now (spends nothing)."""
        if self.balance + self.lent >= _ONE:
            return True
        r = self.reserve
        if self._t is not None and self.min_per_s > 0.0:
            r = min(r + (now - self._t) * self.min_per_s, self.min_per_s)
        return r >= _ONE

    def refund(self) -> None:
        """Give back a spent token: what it was spent on did not happen."""
        b = self.balance + 1.0
        self.balance = b if b < self.cap else self.cap

    def try_spend(self, now: float) -> bool:
        """Whether one retry may go now; spends it if so."""
        if self._t is not None and self.min_per_s > 0.0:
            r = self.reserve + (now - self._t) * self.min_per_s
            self.reserve = r if r < self.min_per_s else self.min_per_s
        self._t = now
        if self.balance + self.lent >= _ONE:
            self.balance -= 1.0
            return True
        if self.reserve >= _ONE:
            self.reserve -= 1.0
            return True
        return False
