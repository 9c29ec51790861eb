"""What the active faults of an emulated engine add up to.

Faults come from the fleet file or ``POST /admin/faults``, in the vocabulary
the simulator shares (:mod:`tailguard.config.faults`). ``at_s`` counts from
emulator start for a fleet file's schedule and from the call for the admin
API; ``duration_s`` (default: until cleared) ends a fault.

While several faults overlap, their effects combine the way independent
causes would: throttle factors multiply (0.5 and 0.5 make 0.25), error rates
combine as ``1 - prod(1 - r)``, network delays add up, and a node hangs or is
down while any hang or crash is active. A stall is an event, not a state:
clearing faults does not give back a pause already taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailguard.config import parse
from tailguard.config.faults import FaultBlock, FaultSpec
from tailguard.errors import ConfigError

__all__ = ["FaultSpec", "FaultState", "combine", "parse_fault"]


def parse_fault(raw: object, where: str = "fault") -> FaultSpec:
    """One fault object; errors name the field (``nodes[2].faults[0].factor``)."""
    fault: FaultSpec = parse(FaultBlock, raw, where).core()
    if fault.kind == "kv_link":
        raise ConfigError(f"{where}.kind", "an emulated engine's KV link has no fault yet "
                          "(a scenario's kv_link fault is the simulator's)")
    return fault


@dataclass(frozen=True, slots=True)
class FaultState:
    """The combined effect of the active faults (see the module docstring)."""

    speed_factor: float = 1.0
    error_rate: float = 0.0
    hang: bool = False
    crash: bool = False
    delay_s: float = 0.0  # network: fixed wait before each write
    jitter_s: float = 0.0  # network: upper bound of the random extra wait
    # Throttle factors by GPU index (one GPU's fault), and of every GPU (the node's).
    gpu_factors: tuple[tuple[int, float], ...] = ()
    all_gpus: float = 1.0

    def gpu_factor(self, index: int) -> float:
        """How fast GPU ``index`` of the replica runs (1: its full clock)."""
        own = dict(self.gpu_factors).get(index, 1.0)
        return self.all_gpus * own

    @property
    def slow_link(self) -> bool:
        return self.delay_s + self.jitter_s > 0.0


def combine(faults: list[FaultSpec]) -> FaultState:
    speed, ok, hang, crash = 1.0, 1.0, False, False
    delay = jitter = 0.0
    per_gpu: dict[int, float] = {}
    for f in faults:
        if f.kind == "throttle" and f.gpu_index is not None:
            per_gpu[f.gpu_index] = per_gpu.get(f.gpu_index, 1.0) * f.factor
        elif f.kind == "throttle":
            speed *= f.factor
        elif f.kind == "errors":
            ok *= 1.0 - f.rate
        elif f.kind == "hang":
            hang = True
        elif f.kind == "crash":
            crash = True
        elif f.kind == "network":
            delay += f.delay_s
            jitter += f.jitter_s
    # A tensor-parallel step waits for its slowest rank: the replica runs at the
    # pace of its slowest GPU.
    slowest = min(per_gpu.values(), default=1.0)
    return FaultState(speed * slowest, 1.0 - ok, hang, crash, delay, jitter,
                      tuple(sorted(per_gpu.items())), speed)
