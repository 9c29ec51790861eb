"""The detector's settings (:class:`OutlierConfig`) and what it needs of a pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tailguard.core.fleet import Node


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Detection thresholds and lifecycle timings (defaults from the issue and Envoy)."""

    enabled: bool = True
    interval_s: float = 5.0
    consecutive_intervals: int = 2  # K: flagged intervals in a row before acting
    # ...except a decode flag this slow whose excess outlived the requests that
    # showed it first, which acts at once: TPOT carries no queue, and such an
    # excess is neither a burst of contention nor one stall seen by every request
    # in flight. By default every decode flag (slow_ratio); higher asks more.
    sure_ratio: float = 1.5
    # A stream's decode is judged in pieces of at least this long (and
    # MIN_DECODE_TOKENS tokens) as its tokens arrive, where the driver reports them
    # (the gateway and the simulator do): a straggler shows before its answers
    # end; a node's decode samples within one such window count as one. 0: whole
    # answers only, each its own sample.
    segment_s: float = 1.0
    slow_ratio: float = 1.5  # recent slowness for its class that flags a node
    # TTFT carries the queue and, on a shared host, the neighbours' contention:
    # load spilled off a throttled node read 1.5-2.4x on its healthy peers' TTFT
    # (three llama.cpp servers on two cores, CI runs), so a TTFT flag asks the
    # quarantine ratio, and only against class peers (a node's own history is
    # from other conditions); milder slowness is TPOT's to find.
    prefill_slow_ratio: float = 3.0
    # Slow but working nodes are degraded (priced at their measured speed);
    # only this slow are they worth nothing to the pool and quarantined.
    quarantine_ratio: float = 3.0
    evidence: float = 6.0  # h: CUSUM evidence (in sigmas) before a flag
    sigma_floor: float = 0.1  # per-sample noise floor, log space
    # A node's sample noise before it has any, learnt within ~20 samples:
    # cautious for TTFT (a real engine's spreads by 2x and more with what it
    # computes beside it), less for TPOT (0.25-0.3 measured on llama.cpp).
    prefill_sigma_prior: float = 0.5
    decode_sigma_prior: float = 0.3
    min_samples: int = 2  # samples in the current excess before a flag (one is never enough)
    level_half_life_s: float = 15.0  # how fast a quiet bucket's level loses its weight
    recover_intervals: int = 3  # clean intervals before a degraded node is healthy
    # A degraded node the router stops using gives no samples to clear it: it
    # regains weight by this factor per interval without samples (up to 1).
    regain_factor: float = 1.25
    consecutive_failures: int = 5
    failure_ratio: float = 0.25
    failure_min_requests: int = 20
    failure_window: int = 6  # intervals
    # A non-streamed answer gives the core no first token, only its finish:
    # hang_s must exceed the longest such generation a node may run alone.
    hang_s: float = 120.0
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    jitter: float = 0.1
    canary_weight: float = 0.1
    # Share of a pool's requests sent to each node on probation whatever the
    # policy says: a policy that prices the canary weight strictly would send it
    # nothing at light load, and probation would then test nothing.
    canary_share: float = 0.02
    slow_start_s: float = 30.0
    max_ejection_share: float = 0.34
    min_weight: float = 0.05


class PoolView(Protocol):
    """What the detector needs of a pool: its nodes, and a cache to drop."""

    @property
    def nodes(self) -> list[Node]: ...

    def invalidate(self) -> None: ...
