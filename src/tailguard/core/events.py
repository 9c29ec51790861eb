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
    # What to do about it, from the cause (:func:`remedy`); "" when unknown.
    advice: str = ""


def remedy(cause: str, gpu: int | None, gpus: int) -> str:
    """What an operator (or a remediation rule) should do about a slow replica whose
    GPU telemetry says ``cause``: ``gpu`` is the index of the GPU behind it (None:
    all of them, or unknown), ``gpus`` the replica's GPU count."""
    if cause == "gpus_healthy":
        return "its GPUs are healthy: restart the engine, or look at the host and network"
    if cause not in ("gpu_throttle", "gpu_xid"):
        return ""
    what = "showing XID errors" if cause == "gpu_xid" else "throttling"
    if gpu is None:
        return (f"all its GPUs are {what}: check the host's cooling and power, or move "
                "the replica to another host")
    if gpus == 1:
        return (f"GPU {gpu} is {what}: move the replica to another GPU (re-form: "
                f"tailguard plan --inventory ... --exclude HOST:{gpu})")
    return (f"GPU {gpu} of {gpus} is {what} and holds the whole replica back: restart the "
            f"replica on {gpus} other GPUs, or re-form without it (tailguard plan "
            f"--inventory ... --exclude HOST:{gpu})")
