"""Online estimators with explicit timestamps: EWMA, peak-EWMA, and a node's capacity.

Time-decayed EWMA: a sample taken ``dt`` seconds after the previous one gets
weight ``1 - exp(-dt/tau)``, so the estimate forgets at the same speed however
often samples arrive (Finagle's and Linkerd's load balancers use this form).

Peak-EWMA (Finagle ``PeakEwma``; Linkerd): a sample above the current cost
replaces it at once, a lower one decays it with ``w = exp(-dt/tau)``::

    cost = rtt                    if rtt > cost
    cost = cost*w + rtt*(1 - w)   otherwise

Worked example, tau = 10 s: cost 0.10, a sample of 0.30 at t=0 makes it 0.30;
a sample of 0.10 five seconds later gives w = exp(-0.5) = 0.607 and
cost = 0.30*0.607 + 0.10*0.393 = 0.221.

:class:`CapacityEstimate` keeps, per node, how much slower (or faster) than
its roofline prior the node actually runs, separately for decode (time per
output token at the batch it ran at) and prefill (time to first token over the
prompt work ahead of it). The prior is the roofline model of
:mod:`tailguard.core.hardware`; measurements correct it multiplicatively, in
log space, so that one 10x outlier moves the estimate by the same amount as
ten 1.26x samples would.
"""

from __future__ import annotations

import math


class Ewma:
    """Time-decayed exponentially weighted moving average."""

    __slots__ = ("_t", "count", "tau", "value")

    def __init__(self, tau: float, initial: float = 0.0) -> None:
        self.tau = tau
        self.value = initial
        self.count = 0
        self._t: float | None = None

    def update(self, sample: float, now: float) -> float:
        if self._t is None:
            self.value = sample
        else:
            dt = now - self._t
            w = math.exp(-dt / self.tau) if dt > 0 else 1.0
            # A burst of samples at the same instant still moves the estimate a little.
            w = min(w, 1.0 - 1.0 / (self.count + 2) if self.count < 8 else 0.9)
            self.value = self.value * w + sample * (1.0 - w)
        self._t = now
        self.count += 1
        return self.value


class PeakEwma:
    """Finagle-style peak-sensitive EWMA: jumps up at once, decays down slowly."""

    __slots__ = ("_t", "cost", "tau")

    def __init__(self, tau: float = 10.0, initial: float = 0.0) -> None:
        self.tau = tau
        self.cost = initial
        self._t: float | None = None

    def update(self, rtt: float, now: float) -> float:
        if self._t is None or rtt > self.cost:
            self.cost = rtt
        else:
            w = math.exp(-(now - self._t) / self.tau)
            self.cost = self.cost * w + rtt * (1.0 - w)
        self._t = now
        return self.cost

    def decayed(self, now: float) -> float:
        """The cost as it would read now with no new sample (decays toward zero)."""
        if self._t is None:
            return self.cost
        return self.cost * math.exp(-(now - self._t) / self.tau)


class LogRatio:
    """EWMA of ``log(observed / expected)``, so ratios average geometrically.

    ``weight`` counts samples as pseudo-observations: the first few samples move
    the estimate strongly, later ones by ``1 - alpha`` each, and the prior of
    ratio 1.0 counts as ``prior_weight`` samples.
    """

    __slots__ = ("alpha", "log_ratio", "samples", "weight")

    def __init__(self, alpha: float = 0.1, prior_weight: float = 2.0) -> None:
        self.alpha = alpha
        self.log_ratio = 0.0
        self.weight = prior_weight
        self.samples = 0

    def update(self, observed: float, expected: float) -> None:
        if observed <= 0.0 or expected <= 0.0:
            return
        x = math.log(observed / expected)
        # Clamp single samples: one hiccup must not swing capacity by 100x.
        if x > 3.0:
            x = 3.0
        elif x < -3.0:
            x = -3.0
        self.weight += 1.0
        step = 1.0 / self.weight
        if step < self.alpha:
            step = self.alpha
        self.log_ratio += step * (x - self.log_ratio)
        self.samples += 1

    @property
    def ratio(self) -> float:
        return math.exp(self.log_ratio)


class CapacityEstimate:
    """A node's speed relative to its roofline prior, learned from completions.

    ``decode`` is observed TPOT over the modelled decode step at the batch the
    request ran with; ``prefill`` is observed TTFT over the modelled time of
    the prompt work ahead of the request. Both start at 1.0 (the prior).
    """

    __slots__ = ("decode", "prefill")

    def __init__(self, alpha: float = 0.1) -> None:
        self.decode = LogRatio(alpha)
        self.prefill = LogRatio(alpha)

    @property
    def decode_slowdown(self) -> float:
        return self.decode.ratio

    @property
    def prefill_slowdown(self) -> float:
        return self.prefill.ratio
