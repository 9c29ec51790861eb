"""Recording what the balancer is told, so a live run can be replayed offline.

With a ``recorder`` the :class:`~tailguard.core.balancer.Balancer` hands every
input it receives to it as a plain dict (JSON-ready), in order, each with the
``now`` it was given, and every decision it returned:

``init``        the routing RNG's state and the model parameters
``add_pool``    ``replace_pool``  ``add_node``  ``remove_node``  ``set_state``
``pick``        the request's inputs and the node chosen (``ticket`` numbers it)
``admit``       the same for a pool with limits/admission, and its ``result``: a
                ticket and node, a queue place (``queued``: the waiter's number),
                a ``shed`` reason, or ``none``
``poll_queue``  the queued requests dispatched (ticket, node) or shed since the last
``cancel_queued`` a queued request whose client left
``first_token`` ``no_first_token`` ``finish``   for a ticket
``engine_metrics`` ``tick``  and ``events`` (what a tick decided)

Replaying the same inputs into a fresh balancer must give the same decisions
(:mod:`tailguard.core.replay`): this is how a live incident is studied in the
simulator, and how a test proves that the gateway and the simulator drive the
same core. Conversion is generic over dataclasses, so config types can grow
fields without touching this module.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from random import Random
from typing import Any

from tailguard.core.hardware import PerfParams

RECORD_VERSION = 1


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and mappings as JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict | types.MappingProxyType):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "value") and hasattr(type(value), "__members__"):  # an Enum
        return value.value
    return value


def from_jsonable(cls: Any, data: Any) -> Any:
    """Rebuild a value of type ``cls`` (a dataclass, possibly nested) from JSON data."""
    if data is None:
        return None
    origin = typing.get_origin(cls)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(cls):
            if arg is type(None):
                continue
            try:
                return from_jsonable(arg, data)
            except (TypeError, ValueError):
                continue
        return data
    if origin is tuple:
        args = typing.get_args(cls)
        inner = args[0] if args else Any
        return tuple(from_jsonable(inner, v) for v in data)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        kwargs = {f.name: from_jsonable(hints.get(f.name, Any), data[f.name])
                  for f in dataclasses.fields(cls) if f.init and f.name in data}
        return cls(**kwargs)
    if isinstance(cls, type) and hasattr(cls, "__members__"):  # an Enum
        return cls(data)
    return data


def record_init(rng: Random, perf_params: PerfParams, outliers: Any = None,
                probes: Any = None) -> dict[str, Any]:
    version, state, gauss = rng.getstate()
    return {"op": "init", "version": RECORD_VERSION,
            "rng_state": [version, list(state), gauss],
            "perf_params": to_jsonable(perf_params), "outliers": to_jsonable(outliers),
            "probes": to_jsonable(probes)}


def rng_from_init(rec: dict[str, Any]) -> Random:
    rng = Random()
    version, state, gauss = rec["rng_state"]
    rng.setstate((version, tuple(state), gauss))
    return rng


def spec_to_dict(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = to_jsonable(spec)
    return out


def pool_to_dict(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = to_jsonable(config)
    return out


def event_to_dict(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = to_jsonable(event)
    if not out.get("cause"):
        out.pop("cause", None)  # the driver's, never the core's: recordings stay as they were
    return out
