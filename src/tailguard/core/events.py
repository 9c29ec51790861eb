"""What the decision core reports to its drivers: :class:`Event`.

Kept in its own module so that every part of the core (the balancer, the
outlier detector) can produce events without importing the facade.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Event:
    """Something the core decided or noticed, for logs, metrics and reports."""

    t: float
    node: str
    kind: str  # "state" (a state change) or "detect" (a detection without a change)
    state: str
    reason: str
    # What the driver found behind it ("" unknown): gpu_throttle, gpu_xid (the
    # node's DCGM page shows it), gpus_healthy (DCGM shows nothing wrong: the
    # engine, the host or the network then). The core itself never sets it.
    cause: str = ""
