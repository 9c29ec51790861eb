"""Faults, one vocabulary for the simulator (a scenario's ``faults:``) and the
emulated engines (a fleet node's ``faults:`` and ``POST /admin/faults``)::

    {kind: throttle, factor: 0.4, duration_s: 60}    # steps take 1/0.4 as long
    {kind: throttle, factor: 0.4, gpu_index: 1}      # one GPU of a TP replica
    {kind: stall, seconds: 5}                        # one pause of the engine
    {kind: stall, seconds: 1, period_s: 10}          # a pause every 10 s while active
    {kind: errors, rate: 0.2}                        # 20% of requests fail (HTTP 500)
    {kind: hang}                                     # accept requests, never answer
    {kind: crash, duration_s: 30}                    # fail all, refuse connections
    {kind: network, delay_s: 0.2, jitter_s: 0.1}     # a slow link: each write waits
    {kind: kv_link, factor: 0.1}                     # its KV path at a tenth of its rate

``at_s`` (default 0) delays the start; ``duration_s`` (default: to the end)
ends it. A scenario's fault names its ``node``; a fleet node's faults are its
own. The simulator has no request timeouts, so it refuses ``hang``; the
emulated engines do not slow their KV link, so they refuse ``kv_link``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from tailguard.config.parse import Block, FieldError

KINDS = ("throttle", "stall", "errors", "hang", "crash", "network", "kv_link")
FaultKind = Literal["throttle", "stall", "errors", "hang", "crash", "network", "kv_link"]
# Spellings older files used, and what they are now: refused with the new name.
RENAMED = {"error_rate": "errors", "slow_network": "network", "pause": "stall",
           "slow": "throttle", "pause_s": "seconds"}
# The parameters each kind takes, besides kind, node, at_s and duration_s.
PARAMETERS: dict[str, tuple[str, ...]] = {
    "throttle": ("factor", "gpu_index"),
    "stall": ("seconds", "period_s"),
    "errors": ("rate",),
    "hang": (),
    "crash": (),
    "network": ("delay_s", "jitter_s"),
    "kv_link": ("factor",),
}


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One fault: what happens to a node, from when, for how long."""

    kind: str  # one of KINDS
    at_s: float = 0.0
    duration_s: float | None = None  # None: until the end (or until cleared)
    node: str | None = None  # a scenario's: which node
    factor: float = 1.0  # throttle: speed multiplier (0.4 = 2.5x slower steps); kv_link: rate
    gpu_index: int | None = None  # throttle: one GPU of the replica (its slowest rank paces it)
    seconds: float = 0.0  # stall: length of one pause
    period_s: float | None = None  # stall: repeat the pause this often while active
    rate: float = 0.0  # errors: share of requests that fail
    delay_s: float = 0.0  # network: every write waits this long...
    jitter_s: float = 0.0  # ...plus a uniform draw from [0, jitter_s)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "at_s": self.at_s,
                               "duration_s": self.duration_s}
        if self.node is not None:
            out["node"] = self.node
        for key in PARAMETERS[self.kind]:
            value = getattr(self, key)
            if value is not None or key == "period_s":
                out[key] = value
        return out


class FaultBlock(Block):
    """One fault, as a file or the admin API spells it (see the module docstring)."""

    kind: FaultKind
    node: str | None = Field(default=None, min_length=1)
    at_s: float = Field(default=0.0, ge=0.0)
    duration_s: float | None = Field(default=None, gt=0.0)
    factor: float | None = Field(default=None, gt=0.0)
    gpu_index: int | None = Field(default=None, ge=0)
    seconds: float | None = Field(default=None, gt=0.0)
    period_s: float | None = Field(default=None, gt=0.0)
    rate: float | None = Field(default=None, gt=0.0, le=1.0)
    delay_s: float | None = Field(default=None, ge=0.0)
    jitter_s: float | None = Field(default=None, ge=0.0)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("kind")
            if isinstance(kind, str) and kind in RENAMED:
                raise FieldError("kind", f"{kind!r} is spelled {RENAMED[kind]!r} now")
            if "pause_s" in data:
                raise FieldError("pause_s", "is spelled seconds now")
        return data

    @model_validator(mode="after")
    def _parameters_of_kind(self) -> FaultBlock:
        given = {k for k in self.model_fields_set
                 if k not in ("kind", "node", "at_s", "duration_s")}
        stray = sorted(given - set(PARAMETERS[self.kind]))
        if stray:
            raise FieldError(stray[0], f"does not apply to a {self.kind} fault (it takes "
                             f"{', '.join(PARAMETERS[self.kind]) or 'no parameters'})")
        if self.kind == "throttle" and self.factor is None:
            raise FieldError("factor", "is required for a throttle (speed factor, e.g. 0.4)")
        if self.kind == "kv_link" and self.factor is None:
            raise FieldError("factor", "is required for a kv_link fault (its share of the "
                             "link's rate, e.g. 0.1)")
        if self.kind == "stall":
            if self.seconds is None:
                raise FieldError("seconds", "is required for a stall (the length of one pause)")
            if self.period_s is not None and self.period_s <= self.seconds:
                raise FieldError("period_s", f"must be > seconds ({self.seconds})")
        if self.kind == "errors" and self.rate is None:
            raise FieldError("rate", "is required for errors (the share that fails, in (0, 1])")
        if self.kind == "network" and (self.delay_s or 0.0) + (self.jitter_s or 0.0) <= 0.0:
            raise FieldError("delay_s", "delay_s + jitter_s must be > 0")
        return self

    def core(self) -> FaultSpec:
        return FaultSpec(self.kind, self.at_s, self.duration_s, self.node,
                         factor=self.factor if self.factor is not None else 1.0,
                         gpu_index=self.gpu_index, seconds=self.seconds or 0.0,
                         period_s=self.period_s, rate=self.rate or 0.0,
                         delay_s=self.delay_s or 0.0, jitter_s=self.jitter_s or 0.0)


__all__ = ["KINDS", "PARAMETERS", "RENAMED", "FaultBlock", "FaultKind", "FaultSpec"]
