"""Faults an emulated engine can suffer, from the fleet file or ``POST /admin/faults``.

One JSON/YAML object per fault::

    {"kind": "throttle", "factor": 0.4, "duration_s": 60}   # steps take 1/0.4 as long
    {"kind": "throttle", "factor": 0.4, "gpu_index": 1}      # one GPU of a TP replica
    {"kind": "stall", "seconds": 5}                          # one pause of the engine
    {"kind": "stall", "seconds": 1, "period_s": 10, "duration_s": 120}   # a pause every 10 s
    {"kind": "errors", "rate": 0.2}                          # 20% of requests get HTTP 500
    {"kind": "hang"}                                         # accept requests, never answer
    {"kind": "crash", "duration_s": 30}                      # fail all, refuse connections
    {"kind": "network", "delay_s": 0.2, "jitter_s": 0.1}     # a slow link: each write waits

``at_s`` (default 0) delays the start, counted from emulator start for a
fleet-file schedule and from the call for the admin API; ``duration_s``
(default: until cleared) ends it. The simulator's scenario spellings are
accepted too (``error_rate`` for ``errors``, ``pause_s`` for ``seconds``), so a
scenario's fault list can be pasted into a fleet file.

While several faults overlap, their effects combine the way independent
causes would: throttle factors multiply (0.5 and 0.5 make 0.25), error rates
combine as ``1 - prod(1 - r)``, network delays add up, and a node hangs or is down while any hang or
crash is active. A stall is an event, not a state: clearing faults does not
give back a pause already taken.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailguard.errors import ConfigError

KINDS = ("throttle", "stall", "errors", "hang", "crash", "network")
_ALIASES = {"error_rate": "errors", "pause": "stall", "slow": "throttle", "slow_network": "network"}
_KEYS = ("kind", "node", "at_s", "duration_s", "factor", "seconds", "pause_s", "period_s", "rate",
         "delay_s", "jitter_s", "gpu_index")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    at_s: float = 0.0
    duration_s: float | None = None
    factor: float = 1.0  # throttle: speed multiplier (0.4 = 2.5x slower steps)
    seconds: float = 0.0  # stall: length of one pause
    period_s: float | None = None  # stall: repeat the pause this often while active
    rate: float = 0.0  # errors: share of requests answered with HTTP 500
    delay_s: float = 0.0  # network: every write to a client waits this long...
    jitter_s: float = 0.0  # ...plus a uniform draw from [0, jitter_s)
    gpu_index: int | None = None  # throttle: one GPU of the replica (its slowest rank paces it)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "at_s": self.at_s,
                               "duration_s": self.duration_s}
        if self.kind == "throttle":
            out["factor"] = self.factor
            if self.gpu_index is not None:
                out["gpu_index"] = self.gpu_index
        elif self.kind == "stall":
            out["seconds"] = self.seconds
            out["period_s"] = self.period_s
        elif self.kind == "errors":
            out["rate"] = self.rate
        elif self.kind == "network":
            out["delay_s"] = self.delay_s
            out["jitter_s"] = self.jitter_s
        return out


def _num(raw: Mapping[str, Any], key: str, where: str, *, low: float = 0.0,
         strict: bool = False) -> float | None:
    if raw.get(key) is None:
        return None
    value = raw[key]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{where}.{key}", f"must be a finite number, got {value!r}")
    if value < low or (strict and value == low):
        raise ConfigError(f"{where}.{key}", f"must be {'>' if strict else '>='} {low}, got {value}")
    return float(value)


def parse_fault(raw: object, where: str = "fault") -> FaultSpec:
    """Validate one fault object; errors name the field (``nodes[2].faults[0].factor``)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in _KEYS:
            raise ConfigError(f"{where}.{key}", "unknown key", list(_KEYS))
    kind = raw.get("kind")
    kind = _ALIASES.get(kind, kind) if isinstance(kind, str) else kind
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind", f"unknown fault kind {raw.get('kind')!r}", list(KINDS))
    at_s = _num(raw, "at_s", where) or 0.0
    duration = _num(raw, "duration_s", where, strict=True)
    if kind == "throttle":
        factor = _num(raw, "factor", where, strict=True)
        if factor is None:
            raise ConfigError(f"{where}.factor", "is required for a throttle (speed factor, e.g. 0.4)")
        gpu = raw.get("gpu_index")
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0):
            raise ConfigError(f"{where}.gpu_index", f"must be a GPU index >= 0, got {gpu!r}")
        return FaultSpec("throttle", at_s, duration, factor=factor, gpu_index=gpu)
    if kind == "stall":
        seconds = _num(raw, "seconds", where, strict=True)
        if seconds is None:
            seconds = _num(raw, "pause_s", where, strict=True)
        if seconds is None:
            raise ConfigError(f"{where}.seconds", "is required for a stall (pause length)")
        period = _num(raw, "period_s", where, strict=True)
        if period is not None and period <= seconds:
            raise ConfigError(f"{where}.period_s", f"must be > seconds ({seconds})")
        return FaultSpec("stall", at_s, duration, seconds=seconds, period_s=period)
    if kind == "errors":
        rate = _num(raw, "rate", where)
        if rate is None or not 0.0 < rate <= 1.0:
            raise ConfigError(f"{where}.rate", f"must be in (0, 1], got {raw.get('rate')!r}")
        return FaultSpec("errors", at_s, duration, rate=rate)
    if kind == "network":
        delay = _num(raw, "delay_s", where)
        if delay is None:
            raise ConfigError(f"{where}.delay_s", "is required for a network fault (seconds)")
        jitter = _num(raw, "jitter_s", where) or 0.0
        if delay + jitter == 0.0:
            raise ConfigError(f"{where}.delay_s", "delay_s + jitter_s must be > 0")
        return FaultSpec("network", at_s, duration, delay_s=delay, jitter_s=jitter)
    return FaultSpec(str(kind), at_s, duration)


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
