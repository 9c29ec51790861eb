"""Workloads for the simulator: when requests arrive and how long they are.

A scenario's ``workload:`` section names an arrival process and two length
distributions (prompt tokens and generated tokens)::

    workload:
      duration_s: 600
      warmup_s: 60                       # carried for the report; not used here
      arrival: {process: poisson, load: 0.8}
      input_tokens: {dist: lognormal, mu: 6.6, sigma: 1.0, max: 8192}
      output_tokens: {dist: azure-conv}

Arrival processes (``process``)
-------------------------------
``poisson``
    Exponential inter-arrival times with mean ``1/rate`` (coefficient of
    variation 1).
``gamma``
    Gamma inter-arrival times with shape ``k = 1/cv**2`` and scale
    ``1/(rate*k)``: mean ``1/rate``, coefficient of variation ``cv``. ``cv > 1``
    is burstier than Poisson (BurstGPT's generator defaults to shape 0.25,
    i.e. cv 2; the Azure 2023 code trace has cv about 13), ``cv < 1`` is more
    regular, and ``cv = 1`` is Poisson.
``trace``
    A trace file (``path``): tailguard's JSONL, one request a line
    (``{"t": seconds, "input_tokens": n, "output_tokens": m}``, other keys
    ignored, lines in any order), Mooncake's JSONL, a gateway's recording, or
    the Azure or BurstGPT CSV (:mod:`tailguard.traffic.traces` detects which).
    Times count from its first request. Optionally ``start_s`` (the window
    starts that far into the trace; the workload's ``duration_s`` ends it),
    and ``speedup`` (divide every time), or ``rate``/``load`` (stretch the
    times so the trace's mean rate, ``n / t_last``, becomes that rate, its
    bursts kept). A length distribution given next to a trace replaces that
    column of the trace.

Poisson and gamma take exactly one of ``rate`` (requests per second) or
``load`` (a fraction of the fleet's capacity, which the simulator turns into a
rate; this module never sees the fleet).

Length distributions (``dist``): :mod:`tailguard.traffic.lengths`.

Determinism
-----------
:func:`generate` derives three independent streams (arrival gaps, input
lengths, output lengths) from the caller's ``random.Random``. The same seed
gives the same requests, and request ``i``'s lengths do not depend on the rate
or the arrival process, so a load sweep compares like with like.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tailguard.config.files import (
    check_keys,
    number,
    optional_number,
    require_mapping,
)
from tailguard.errors import ConfigError
from tailguard.traffic.lengths import (
    DISTS,
    PRESET_MAX,
    TOKEN_CAP,
    Component,
    Field,
    FixedLength,
    LengthDist,
    MixtureLength,
    UniformLength,
    parse_length_dist,
)
from tailguard.traffic.sessions import PrefixSpec, generate_sessions, parse_prefix
from tailguard.traffic.traces import Requests, read_trace, window, write_trace

__all__ = [
    "DISTS",
    "PRESET_MAX",
    "PROCESSES",
    "TOKEN_CAP",
    "ArrivalSpec",
    "Component",
    "FixedLength",
    "LengthDist",
    "MixtureLength",
    "Requests",
    "UniformLength",
    "WorkloadSpec",
    "generate",
    "parse_length_dist",
    "parse_workload",
    "read_trace",
    "sample_lengths",
    "write_trace",
]

Process = Literal["poisson", "gamma", "trace"]

PROCESSES: tuple[str, ...] = ("poisson", "gamma", "trace")



# --------------------------------------------------------------------------- specs


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """How requests arrive. ``cv`` is 1.0 for Poisson and None for a trace."""

    process: Process
    rate: float | None = None
    load: float | None = None
    cv: float | None = 1.0
    path: Path | None = None
    speedup: float = 1.0
    time_scale: float = 1.0  # multiplies a trace's times (0.5 replays it twice as fast)
    start_s: float = 0.0  # a trace's window starts this far in (before any scaling)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A validated ``workload:`` section.

    ``input_tokens`` and ``output_tokens`` are None only for a trace, which
    then supplies the lengths itself.
    """

    duration_s: float
    warmup_s: float
    arrival: ArrivalSpec
    input_tokens: LengthDist | None
    output_tokens: LengthDist | None
    # Shares of request priorities, e.g. {"high": 0.2, "normal": 0.6, "low": 0.2}
    # (None: all normal); used by the admission queue.
    priorities: Mapping[str, float] | None = None
    # Sessions with shared prefixes (tailguard.traffic.sessions); None: independent prompts.
    prefix: PrefixSpec | None = None


# --------------------------------------------------------------------------- parsing


def _parse_arrival(raw: object, where: str, base_dir: Path | None) -> ArrivalSpec:
    spec = require_mapping(raw, where)
    if "process" not in spec:
        raise ConfigError(f"{where}.process", "is required", list(PROCESSES))
    process = spec["process"]
    if process not in PROCESSES:
        raise ConfigError(f"{where}.process", f"unknown process {process!r}", list(PROCESSES))
    if process == "trace":
        check_keys(spec, ("process", "path", "speedup", "time_scale", "rate", "load",
                          "start_s"), where)
        scalings = [k for k in ("speedup", "time_scale", "rate", "load") if k in spec]
        if len(scalings) > 1:
            raise ConfigError(
                f"{where}.{scalings[1]}",
                f"give at most one of speedup, rate, load (got {', '.join(scalings)})",
            )
        path_value = spec.get("path")
        if not isinstance(path_value, str | Path) or not str(path_value):
            raise ConfigError(f"{where}.path", f"must be a file path, got {path_value!r}")
        path = Path(path_value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ConfigError(f"{where}.path", f"no such file: {path}")
        return ArrivalSpec(
            process="trace",
            rate=optional_number(spec, "rate", where),
            load=optional_number(spec, "load", where),
            cv=None,
            path=path,
            speedup=number(spec, "speedup", where, default=1.0),
            time_scale=number(spec, "time_scale", where, default=1.0),
            start_s=number(spec, "start_s", where, default=0.0, positive=False, minimum=0.0),
        )
    allowed = ("process", "rate", "load") + (("cv",) if process == "gamma" else ())
    check_keys(spec, allowed, where)
    if ("rate" in spec) == ("load" in spec):
        raise ConfigError(f"{where}.rate", "give exactly one of rate (req/s) or load (fraction)")
    rate, load = optional_number(spec, "rate", where), optional_number(spec, "load", where)
    if process == "gamma":
        cv = number(spec, "cv", where)
        return ArrivalSpec(process="gamma", rate=rate, load=load, cv=cv)
    return ArrivalSpec(process="poisson", rate=rate, load=load, cv=1.0)


def parse_workload(
    raw: Mapping[str, Any], where: str = "workload", base_dir: Path | None = None
) -> WorkloadSpec:
    """Validate a ``workload:`` mapping; every problem is a :class:`ConfigError`
    naming the dotted field. Relative trace paths resolve against ``base_dir``
    (the scenario file's folder), else the working directory."""
    spec = require_mapping(raw, where)
    check_keys(spec, ("duration_s", "warmup_s", "arrival", "input_tokens", "output_tokens",
                      "priorities", "prefix"), where)
    duration = number(spec, "duration_s", where)
    warmup = number(spec, "warmup_s", where, default=0.0, positive=False, minimum=0.0)
    if warmup >= duration:
        raise ConfigError(
            f"{where}.warmup_s", f"must be < duration_s ({duration:g}), got {warmup:g}"
        )
    if "arrival" not in spec:
        raise ConfigError(f"{where}.arrival", "is required")
    arrival = _parse_arrival(spec["arrival"], f"{where}.arrival", base_dir)
    lengths: dict[Field, LengthDist | None] = {}
    for field in ("input_tokens", "output_tokens"):
        if field in spec:
            lengths[field] = parse_length_dist(spec[field], f"{where}.{field}", field)
        elif arrival.process == "trace":
            lengths[field] = None
        else:
            raise ConfigError(f"{where}.{field}", "is required (only a trace supplies lengths)")
    return WorkloadSpec(
        duration_s=duration,
        warmup_s=warmup,
        arrival=arrival,
        input_tokens=lengths["input_tokens"],
        output_tokens=lengths["output_tokens"],
        priorities=_parse_priorities(spec.get("priorities"), f"{where}.priorities"),
        prefix=_parse_prefix(spec, arrival, where),
    )


def _parse_prefix(spec: Mapping[str, Any], arrival: ArrivalSpec,
                  where: str) -> PrefixSpec | None:
    if "prefix" not in spec:
        return None
    if arrival.process == "trace":
        raise ConfigError(f"{where}.prefix", "a trace brings its own prefixes (hash_ids)")
    return parse_prefix(spec["prefix"], f"{where}.prefix")


def _parse_priorities(raw: Any, where: str) -> Mapping[str, float] | None:
    if raw is None:
        return None
    m = require_mapping(raw, where)
    check_keys(m, ("high", "normal", "low"), where)
    out: dict[str, float] = {}
    for name, share in m.items():
        if isinstance(share, bool) or not isinstance(share, int | float) or share < 0:
            raise ConfigError(f"{where}.{name}", f"must be a share >= 0, got {share!r}")
        out[str(name)] = float(share)
    if not sum(out.values()) > 0:
        raise ConfigError(where, "the shares must add up to more than 0")
    return out


# --------------------------------------------------------------------------- generation


def _streams(rng: random.Random) -> tuple[random.Random, random.Random, random.Random]:
    """Three independent generators (arrivals, input, output) from one seed."""
    return (
        random.Random(rng.getrandbits(64)),
        random.Random(rng.getrandbits(64)),
        random.Random(rng.getrandbits(64)),
    )


def _arrival_times(
    arrival: ArrivalSpec, rate: float, duration: float, rng: random.Random
) -> list[float]:
    times: list[float] = []
    append = times.append
    t = 0.0
    if arrival.process == "gamma" and arrival.cv is not None and arrival.cv != 1.0:
        shape = 1.0 / (arrival.cv * arrival.cv)
        scale = 1.0 / (rate * shape)
        gamma = rng.gammavariate
        while True:
            t += gamma(shape, scale)
            if t >= duration:
                return times
            append(t)
    expo = rng.expovariate
    while True:
        t += expo(rate)
        if t >= duration:
            return times
        append(t)


def _trace_times(spec: WorkloadSpec, rate: float | None, times: list[float]) -> list[float]:
    arrival = spec.arrival
    target = rate if rate is not None else arrival.rate
    if arrival.rate is not None or arrival.load is not None:
        if target is None or not target > 0.0:
            raise ValueError("trace with rate/load scaling needs a resolved rate > 0")
        if not times or times[-1] <= 0.0:
            return times
        native = len(times) / times[-1]
        factor = native / target
        return [t * factor for t in times]
    if arrival.speedup != 1.0:
        return [t / arrival.speedup for t in times]
    if arrival.time_scale != 1.0:
        return [t * arrival.time_scale for t in times]
    return times


def generate(
    spec: WorkloadSpec,
    rate: float | None,
    rng: random.Random,
    duration_s: float | None = None,
) -> Requests:
    """Draw the requests of one run, arrival times in ``[0, duration)``.

    ``rate`` is the resolved request rate (req/s): required when the spec
    gives ``load``; when None, the spec's own ``rate`` is used. For a trace it
    matters only if the trace is scaled by ``rate``/``load``. ``duration_s``
    overrides ``spec.duration_s``. Deterministic for a given ``rng`` state.
    """
    duration = spec.duration_s if duration_s is None else duration_s
    if not duration > 0.0:
        raise ValueError(f"duration must be > 0, got {duration}")
    time_rng, in_rng, out_rng = _streams(rng)
    arrival = spec.arrival
    if arrival.process == "trace":
        assert arrival.path is not None
        trace = window(read_trace(arrival.path, "workload.arrival.path"), arrival.start_s)
        times = _trace_times(spec, rate, trace.arrival_s)
        n = sum(1 for t in times if t < duration)
        times = times[:n]
        n_in = (
            spec.input_tokens.sample_many(in_rng, n)
            if spec.input_tokens is not None
            else trace.input_tokens[:n]
        )
        n_out = (
            spec.output_tokens.sample_many(out_rng, n)
            if spec.output_tokens is not None
            else trace.output_tokens[:n]
        )
        if trace.blocks is None or spec.input_tokens is not None:
            return Requests(times, n_in, n_out)  # resampled prompts lose their blocks
        return Requests(times, n_in, n_out, trace.blocks[:n], trace.block_tokens,
                        trace.session[:n] if trace.session is not None else None)
    resolved = rate if rate is not None else arrival.rate
    if resolved is None:
        raise ValueError("the workload gives a load: resolve it to a rate and pass `rate`")
    if not (resolved > 0.0 and math.isfinite(resolved)):
        raise ValueError(f"rate must be a finite number > 0, got {resolved}")
    assert spec.input_tokens is not None and spec.output_tokens is not None
    if spec.prefix is not None:
        return _sessions(spec, spec.prefix,
                         _arrival_times(arrival, resolved / spec.prefix.requests_per_session,
                                        duration, time_rng), duration, in_rng)
    times = _arrival_times(arrival, resolved, duration, time_rng)
    n = len(times)
    return Requests(
        times,
        spec.input_tokens.sample_many(in_rng, n),
        spec.output_tokens.sample_many(out_rng, n),
    )


def _sessions(spec: WorkloadSpec, prefix: PrefixSpec, starts: list[float], duration: float,
              rng: random.Random) -> Requests:
    got = generate_sessions(prefix, starts, duration,
                            {"input_tokens": spec.input_tokens,
                             "output_tokens": spec.output_tokens}, rng)
    return Requests(got.arrival_s, got.input_tokens, got.output_tokens, got.blocks,
                    prefix.block_tokens, got.session)


def sample_lengths(spec: WorkloadSpec, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """``n`` (input, output) length pairs without times, for capacity estimates.

    A trace column without a distribution is resampled with replacement (rows
    are drawn whole, so input and output stay paired). A prefix workload's
    prompts carry their history: sessions all started at once give the mix of
    turns (the estimate prices every prompt uncached).
    """
    _, in_rng, out_rng = _streams(rng)
    if spec.prefix is not None:
        sessions = math.ceil(n / spec.prefix.requests_per_session) + 1
        got = _sessions(spec, spec.prefix, [0.0] * sessions, math.inf, in_rng)
        while len(got) < n:
            sessions *= 2
            got = _sessions(spec, spec.prefix, [0.0] * sessions, math.inf, in_rng)
        chosen = out_rng.sample(range(len(got)), n)
        return [got.input_tokens[i] for i in chosen], [got.output_tokens[i] for i in chosen]
    trace: Requests | None = None
    rows: list[int] = []
    if spec.input_tokens is None or spec.output_tokens is None:
        assert spec.arrival.path is not None
        trace = read_trace(spec.arrival.path, "workload.arrival.path")
        if not len(trace):
            raise ConfigError("workload.arrival.path", f"trace {spec.arrival.path} is empty")
        pick = in_rng.randrange
        size = len(trace)
        rows = [pick(size) for _ in range(n)]
    if spec.input_tokens is not None:
        n_in = spec.input_tokens.sample_many(in_rng, n)
    else:
        assert trace is not None
        n_in = [trace.input_tokens[i] for i in rows]
    if spec.output_tokens is not None:
        n_out = spec.output_tokens.sample_many(out_rng, n)
    else:
        assert trace is not None
        n_out = [trace.output_tokens[i] for i in rows]
    return n_in, n_out
