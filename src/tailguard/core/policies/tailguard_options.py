"""The ``tailguard`` policy's options (``policy_options`` in a fleet file or scenario).

Kept apart from the policy, which is compiled (``tailguard/_compiled.py``): the
configuration layer builds the option block's model from this dataclass's
fields, which a compiled dataclass hides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TailguardOptions:
    """``policy_options`` of ``tailguard`` (the file's bounds: ``config/options.py``)."""

    sample: int = 0  # nodes drawn per request (0: all; else at least 2)
    slo_headroom: float = 0.9  # the share of each SLO a prediction must keep
    ttft_weight: float | None = None  # a second of TTFT in decode seconds (None: as the SLOs)
    queue_weight: float = 1.0  # the weight of the wait a request imposes on those behind it
    # The SLO miss (relative excess) that even the best node is predicted to make,
    # past which a request goes to the node with the most engine room (the class
    # docstring's "Overload"); None (the default): never, the least miss wins.
    spill_excess: float | None = None


__all__ = ["TailguardOptions"]
