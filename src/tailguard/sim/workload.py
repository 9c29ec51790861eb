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
    A JSONL file, one request a line: ``{"t": seconds, "input_tokens": n,
    "output_tokens": m}`` (other keys are ignored, lines may be in any order).
    ``t`` counts seconds from the start of the run. Optionally ``speedup``
    (divide every ``t``), or ``rate``/``load`` (stretch the times so the
    trace's mean rate, ``n / t_last``, becomes that rate). A length
    distribution given next to a trace replaces that column of the trace.

Poisson and gamma take exactly one of ``rate`` (requests per second) or
``load`` (a fraction of the fleet's capacity, which the simulator turns into a
rate; this module never sees the fleet).

Length distributions (``dist``)
-------------------------------
Every length is a continuous draw rounded to the nearest integer and clamped
to ``[min, max]`` (``min`` defaults to 1).

``fixed``      ``value``.
``uniform``    ``min`` and ``max``, both inclusive.
``lognormal``  ``mu``, ``sigma`` of the underlying normal; optional ``max``
               (otherwise only capped at :data:`TOKEN_CAP`) and ``min``.
``azure-conv`` and ``azure-code``: fits to the Azure LLM inference trace 2023
(Patel et al., "Splitwise", ISCA 2024; traces published as
``AzurePublicDataset/AzureLLMInferenceTrace_{conv,code}``), as recorded in
``docs/sources.md``:

=========== ============================ ======================================
preset      input_tokens                 output_tokens
=========== ============================ ======================================
azure-conv  lognormal(mu 6.63, sig 0.99) 0.665*lognormal(4.50, 0.55)
                                         + 0.335*normal(426, 69)
azure-code  lognormal(mu 7.00, sig 1.36) lognormal(mu 2.79, sigma 0.85)
=========== ============================ ======================================

Presets accept ``max`` (default 8192 for input, 4096 for output) and ``min``.
The fits reproduce the trace's means well (conversation output 212 vs 211
reported; code input 2084 vs 2048 once clamped at 8192) but not every
quantile: the conversation-input fit has median ``e**6.63 = 757`` where the
trace reports 1020, and the code-output fit has mean 23 and median 16 where
the trace reports 28 and 13.

Worked example (azure-conv output): the lognormal part has mean
``exp(4.50 + 0.55**2/2) = 104.7``, so the mixture mean is
``0.665*104.7 + 0.335*426 = 212.3`` tokens; its median solves
``0.665*F_ln(x) + 0.335*F_n(x) = 0.5``, where the normal part is still ~0, so
``F_ln(x) = 0.752`` and ``x = exp(4.50 + 0.55*0.680) = 131``.

Determinism
-----------
:func:`generate` derives three independent streams (arrival gaps, input
lengths, output lengths) from the caller's ``random.Random``. The same seed
gives the same requests, and request ``i``'s lengths do not depend on the rate
or the arrival process, so a load sweep compares like with like.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal, Protocol

from tailguard.config_file import (
    check_keys,
    integer,
    number,
    optional_number,
    require_mapping,
)
from tailguard.errors import ConfigError
from tailguard.sim.sessions import PrefixSpec, generate_sessions, parse_prefix

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
Field = Literal["input_tokens", "output_tokens"]

PROCESSES: tuple[str, ...] = ("poisson", "gamma", "trace")
DISTS: tuple[str, ...] = ("fixed", "uniform", "lognormal", "azure-conv", "azure-code")
#: Hard cap on any token count (int32), so an unbounded lognormal stays finite.
TOKEN_CAP = 2**31 - 1
#: Default ``max`` of the Azure presets, per field.
PRESET_MAX: Mapping[str, int] = {"input_tokens": 8192, "output_tokens": 4096}

_STD = NormalDist()


# --------------------------------------------------------------------------- lengths


class LengthDist(Protocol):
    """A distribution of token counts, all within ``[min_tokens, max_tokens]``."""

    @property
    def name(self) -> str: ...

    @property
    def min_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...

    def sample(self, rng: random.Random) -> int: ...

    def sample_many(self, rng: random.Random, n: int) -> list[int]: ...

    def mean(self) -> float: ...

    def quantile(self, q: float) -> int: ...


def _std_normals(rng: random.Random, n: int) -> list[float]:
    """``n`` standard normal draws by Box-Muller, two per pair of uniforms.

    Same method as ``random.gauss`` without its per-call overhead.
    """
    rand, log, sqrt, cos, sin = rng.random, math.log, math.sqrt, math.cos, math.sin
    two_pi = 2.0 * math.pi
    out: list[float] = []
    append = out.append
    for _ in range((n + 1) // 2):
        r = sqrt(-2.0 * log(1.0 - rand()))  # 1 - U lies in (0, 1]: log never sees 0
        theta = two_pi * rand()
        append(r * cos(theta))
        append(r * sin(theta))
    del out[n:]
    return out


def _check_q(q: float) -> None:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")


@dataclass(frozen=True, slots=True)
class FixedLength:
    """Every request has exactly ``value`` tokens."""

    value: int
    name: str = "fixed"

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError(f"value must be >= 1, got {self.value}")

    @property
    def min_tokens(self) -> int:
        return self.value

    @property
    def max_tokens(self) -> int:
        return self.value

    def sample(self, rng: random.Random) -> int:
        return self.value

    def sample_many(self, rng: random.Random, n: int) -> list[int]:
        return [self.value] * n

    def mean(self) -> float:
        return float(self.value)

    def quantile(self, q: float) -> int:
        _check_q(q)
        return self.value


@dataclass(frozen=True, slots=True)
class UniformLength:
    """Integers from ``lo`` to ``hi``, both inclusive, equally likely."""

    lo: int
    hi: int
    name: str = "uniform"

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"need 1 <= lo <= hi, got lo={self.lo} hi={self.hi}")

    @property
    def min_tokens(self) -> int:
        return self.lo

    @property
    def max_tokens(self) -> int:
        return self.hi

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def sample_many(self, rng: random.Random, n: int) -> list[int]:
        randint, lo, hi = rng.randint, self.lo, self.hi
        return [randint(lo, hi) for _ in range(n)]

    def mean(self) -> float:
        return (self.lo + self.hi) / 2.0

    def quantile(self, q: float) -> int:
        _check_q(q)
        return min(self.hi, self.lo + math.floor(q * (self.hi - self.lo + 1)))


@dataclass(frozen=True, slots=True)
class Component:
    """One continuous part of a mixture: a lognormal or a normal."""

    kind: Literal["lognormal", "normal"]
    weight: float
    mu: float
    sigma: float

    def cdf(self, x: float) -> float:
        if self.kind == "lognormal":
            return 0.0 if x <= 0.0 else _STD.cdf((math.log(x) - self.mu) / self.sigma)
        return _STD.cdf((x - self.mu) / self.sigma)

    def quantile(self, q: float) -> float:
        """Continuous quantile for ``0 < q < 1``."""
        z = self.mu + self.sigma * _STD.inv_cdf(q)
        return math.exp(min(z, 700.0)) if self.kind == "lognormal" else z

    def clamped_mean(self, lo: float, hi: float) -> float:
        """``E[min(max(X, lo), hi)]``, in closed form."""
        f_lo, s_hi = self.cdf(lo), 1.0 - self.cdf(hi)
        return lo * f_lo + self._partial_mean(lo, hi) + hi * s_hi

    def _partial_mean(self, lo: float, hi: float) -> float:
        """``E[X; lo < X < hi]``."""
        mu, s = self.mu, self.sigma
        if self.kind == "lognormal":
            a = -math.inf if lo <= 0.0 else (math.log(lo) - mu - s * s) / s
            b = -math.inf if hi <= 0.0 else (math.log(hi) - mu - s * s) / s
            mass = _STD.cdf(b) - _STD.cdf(a)
            # exp(mu + s^2/2) may overflow while the mass is tiny: add in logs.
            return math.exp(mu + s * s / 2.0 + math.log(mass)) if mass > 0.0 else 0.0
        a, b = (lo - mu) / s, (hi - mu) / s
        return mu * (_STD.cdf(b) - _STD.cdf(a)) + s * (_STD.pdf(a) - _STD.pdf(b))


@dataclass(frozen=True, slots=True)
class MixtureLength:
    """A mixture of lognormal/normal parts, rounded and clamped to ``[lo, hi]``.

    A plain lognormal is a mixture of one part. ``weights`` need not sum to 1;
    they are normalised.
    """

    components: tuple[Component, ...]
    lo: int = 1
    hi: int = TOKEN_CAP
    name: str = "lognormal"

    def __post_init__(self) -> None:
        if not self.components:
            raise ValueError("a mixture needs at least one component")
        if not 1 <= self.lo <= self.hi <= TOKEN_CAP:
            raise ValueError(f"need 1 <= lo <= hi <= {TOKEN_CAP}, got lo={self.lo} hi={self.hi}")
        for c in self.components:
            if not (c.weight > 0.0 and math.isfinite(c.weight)):
                raise ValueError(f"component weight must be > 0, got {c.weight}")
            if not (c.sigma > 0.0 and math.isfinite(c.sigma) and math.isfinite(c.mu)):
                raise ValueError(f"component needs finite mu and sigma > 0, got {c}")

    @classmethod
    def lognormal(
        cls, mu: float, sigma: float, lo: int = 1, hi: int = TOKEN_CAP, name: str = "lognormal"
    ) -> MixtureLength:
        return cls((Component("lognormal", 1.0, mu, sigma),), lo, hi, name)

    @property
    def min_tokens(self) -> int:
        return self.lo

    @property
    def max_tokens(self) -> int:
        return self.hi

    def _weights(self) -> list[float]:
        total = sum(c.weight for c in self.components)
        return [c.weight / total for c in self.components]

    def sample(self, rng: random.Random) -> int:
        return self.sample_many(rng, 1)[0]

    def sample_many(self, rng: random.Random, n: int) -> list[int]:
        # Hot path (200k draws must take well under a second): batched normals,
        # local names, and a threshold test before exp() so huge draws cannot
        # overflow.
        exp = math.exp
        lo, hi = self.lo, self.hi
        top = hi - 0.5  # x >= top rounds to hi
        log_top = math.log(top)
        if len(self.components) > 1:
            # Component picks get their own stream so that draw i is the same
            # whatever n is (a prefix of a longer run is the shorter run).
            uniform = random.Random(rng.getrandbits(64)).random
        normals = _std_normals(rng, n)
        if len(self.components) == 1:
            c = self.components[0]
            mu, sigma = c.mu, c.sigma
            if c.kind == "lognormal":
                return [
                    hi if v >= log_top else max(lo, int(exp(v) + 0.5))
                    for v in [mu + sigma * z for z in normals]
                ]
            return [
                hi if v >= top else max(lo, int(v + 0.5)) for v in [mu + sigma * z for z in normals]
            ]
        comps = [(c.kind == "lognormal", c.mu, c.sigma) for c in self.components]
        cum: list[float] = []
        acc = 0.0
        for w in self._weights():
            acc += w
            cum.append(acc)
        last = len(comps) - 1
        out: list[int] = []
        append = out.append
        for z in normals:
            i = 0
            u = uniform()
            while i < last and u >= cum[i]:
                i += 1
            is_log, mu, sigma = comps[i]
            v = mu + sigma * z
            if is_log:
                if v >= log_top:
                    append(hi)
                    continue
                v = exp(v)
            elif v >= top:
                append(hi)
                continue
            k = int(v + 0.5)
            append(k if k > lo else lo)
        return out

    def mean(self) -> float:
        """Mean of the clamped distribution (rounding is left out: it moves the
        mean by well under a token for any smooth density)."""
        return sum(
            w * c.clamped_mean(self.lo, self.hi)
            for w, c in zip(self._weights(), self.components, strict=True)
        )

    def cdf(self, x: float) -> float:
        """CDF of the continuous mixture before rounding and clamping."""
        return sum(w * c.cdf(x) for w, c in zip(self._weights(), self.components, strict=True))

    def quantile(self, q: float) -> int:
        _check_q(q)
        if q == 0.0:
            return self.lo
        if q == 1.0:
            return self.hi
        if len(self.components) == 1:
            x = self.components[0].quantile(q)
        else:
            # The mixture's quantile lies between its parts' quantiles: bisect.
            parts = [c.quantile(q) for c in self.components]
            a, b = min(parts), max(parts)
            for _ in range(100):
                m = (a + b) / 2.0
                if self.cdf(m) < q:
                    a = m
                else:
                    b = m
            x = (a + b) / 2.0
        if x >= self.hi - 0.5:
            return self.hi
        return max(self.lo, int(x + 0.5))


def _preset(dist: str, field: Field, lo: int, hi: int) -> MixtureLength:
    """The Azure 2023 fits (see the module docstring)."""
    if field == "input_tokens":
        mu, sigma = (6.63, 0.99) if dist == "azure-conv" else (7.00, 1.36)
        return MixtureLength.lognormal(mu, sigma, lo, hi, name=dist)
    if dist == "azure-conv":
        parts = (
            Component("lognormal", 0.665, 4.50, 0.55),
            Component("normal", 0.335, 426.0, 69.0),
        )
        return MixtureLength(parts, lo, hi, name=dist)
    return MixtureLength.lognormal(2.79, 0.85, lo, hi, name=dist)


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
    # Sessions with shared prefixes (tailguard.sim.sessions); None: independent prompts.
    prefix: PrefixSpec | None = None


@dataclass(frozen=True, slots=True)
class Requests:
    """Parallel lists, one entry per request, sorted by arrival time.

    With shared prefixes, ``blocks[i]`` holds the hashes of request ``i``'s full
    ``block_tokens``-token blocks (prompt, then answer where known) and
    ``session[i]`` its session (a key for session affinity).
    """

    arrival_s: list[float]
    input_tokens: list[int]
    output_tokens: list[int]
    blocks: list[tuple[int, ...]] | None = None
    block_tokens: int = 0
    session: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_tokens) != n or len(self.output_tokens) != n:
            raise ValueError(
                f"parallel lists differ in length: {n}, "
                f"{len(self.input_tokens)}, {len(self.output_tokens)}"
            )
        for extra in (self.blocks, self.session):
            if extra is not None and len(extra) != n:
                raise ValueError(f"parallel lists differ in length: {n}, {len(extra)}")
        if self.blocks is not None and self.block_tokens < 1:
            raise ValueError("blocks need block_tokens >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)


# --------------------------------------------------------------------------- parsing


def _tokens(raw: Mapping[str, Any], key: str, where: str, default: int | None) -> int:
    """A token count: an integer in ``[1, TOKEN_CAP]``."""
    return integer(raw, key, where, default, minimum=1, maximum=TOKEN_CAP)


def parse_length_dist(raw: object, where: str, field: Field) -> LengthDist:
    """Parse one ``{dist: ...}`` mapping; ``field`` selects the preset table."""
    spec = require_mapping(raw, where)
    if "dist" not in spec:
        raise ConfigError(f"{where}.dist", "is required", list(DISTS))
    dist = spec["dist"]
    if dist not in DISTS:
        raise ConfigError(f"{where}.dist", f"unknown distribution {dist!r}", list(DISTS))
    if dist == "fixed":
        check_keys(spec, ("dist", "value"), where)
        return FixedLength(_tokens(spec, "value", where, None))
    if dist == "uniform":
        check_keys(spec, ("dist", "min", "max"), where)
        lo, hi = _tokens(spec, "min", where, None), _tokens(spec, "max", where, None)
        if lo > hi:
            raise ConfigError(f"{where}.max", f"must be >= min ({lo}), got {hi}")
        return UniformLength(lo, hi)
    if dist == "lognormal":
        check_keys(spec, ("dist", "mu", "sigma", "min", "max"), where)
        mu = number(spec, "mu", where, positive=False)
        sigma = number(spec, "sigma", where)
        default_hi = TOKEN_CAP
    else:
        check_keys(spec, ("dist", "min", "max"), where)
        mu = sigma = 0.0
        default_hi = PRESET_MAX[field]
    lo = _tokens(spec, "min", where, 1)
    hi = _tokens(spec, "max", where, default_hi)
    if lo > hi:
        raise ConfigError(f"{where}.max", f"must be >= min ({lo}), got {hi}")
    if dist == "lognormal":
        return MixtureLength.lognormal(mu, sigma, lo, hi)
    return _preset(dist, field, lo, hi)


def _parse_arrival(raw: object, where: str, base_dir: Path | None) -> ArrivalSpec:
    spec = require_mapping(raw, where)
    if "process" not in spec:
        raise ConfigError(f"{where}.process", "is required", list(PROCESSES))
    process = spec["process"]
    if process not in PROCESSES:
        raise ConfigError(f"{where}.process", f"unknown process {process!r}", list(PROCESSES))
    if process == "trace":
        check_keys(spec, ("process", "path", "speedup", "time_scale", "rate", "load"), where)
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


# --------------------------------------------------------------------------- traces


def write_trace(path: str | Path, requests: Requests) -> None:
    """Write one JSON object a line: ``{"t", "input_tokens", "output_tokens"}``.

    Times are written with full float precision, so :func:`read_trace` gives
    back exactly the same requests.
    """
    with Path(path).open("w", encoding="utf-8") as out:
        for t, n_in, n_out in zip(
            requests.arrival_s, requests.input_tokens, requests.output_tokens, strict=True
        ):
            out.write(json.dumps({"t": t, "input_tokens": n_in, "output_tokens": n_out}))
            out.write("\n")


# Tokens per block of the Mooncake traces' hash_ids.
MOONCAKE_BLOCK_TOKENS = 512


def _mooncake_row(row: Mapping[str, Any], at: str, where: str) -> tuple[float, int, int,
                                                                       tuple[int, ...]]:
    """A Mooncake FAST'25 trace line: ``timestamp`` (ms), ``input_length``,
    ``output_length``, ``hash_ids`` (one per 512-token block of the input)."""
    ts = row.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise ConfigError(where, f"{at}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    counts = _row_counts(row, ("input_length", "output_length"), at, where)
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                            for h in ids):
        raise ConfigError(where, f"{at}: 'hash_ids' must be a list of integers")
    return float(ts) / 1000.0, counts[0], counts[1], tuple(ids)


def _row_counts(row: Mapping[str, Any], keys: tuple[str, str], at: str,
                where: str) -> list[int]:
    """A trace line's two token counts, each an integer in ``[1, TOKEN_CAP]``."""
    counts: list[int] = []
    for key in keys:
        n = row.get(key)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= TOKEN_CAP:
            raise ConfigError(where, f"{at}: {key!r} must be an integer >= 1, got {n!r}")
        counts.append(n)
    return counts


def read_trace(path: str | Path, where: str = "trace") -> Requests:
    """Read a JSONL trace, sorted by time (stable for equal times).

    Two formats: tailguard's (``t`` in seconds, ``input_tokens``,
    ``output_tokens``) and Mooncake's FAST'25 release (``timestamp`` in ms,
    ``input_length``, ``output_length``, ``hash_ids`` of 512-token prompt
    blocks, which the engines' prefix caches key on). Blank lines are skipped
    and unknown keys ignored. A bad line raises a :class:`ConfigError` on
    ``where`` that names the file and line.
    """
    file = Path(path)
    rows: list[tuple[float, int, int]] = []
    hashed: list[tuple[float, int, int, tuple[int, ...]]] = []
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(where, f"cannot read trace {file}: {exc.strerror or exc}") from exc
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{file}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(where, f"{at}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ConfigError(where, f"{at}: expected an object, got {type(row).__name__}")
        if "op" in row:  # a gateway's decision recording, not a trace
            return requests_from_recording(text, where, file)
        if "timestamp" in row:
            hashed.append(_mooncake_row(row, at, where))
            continue
        t = row.get("t")
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0.0:
            raise ConfigError(where, f"{at}: 't' must be a finite number >= 0, got {t!r}")
        counts = _row_counts(row, ("input_tokens", "output_tokens"), at, where)
        rows.append((float(t), counts[0], counts[1]))
    if hashed:
        if rows:
            raise ConfigError(where, f"{file}: mixes Mooncake lines (timestamp) with t lines")
        hashed.sort(key=lambda r: r[0])
        return Requests([r[0] for r in hashed], [r[1] for r in hashed], [r[2] for r in hashed],
                        blocks=[r[3] for r in hashed], block_tokens=MOONCAKE_BLOCK_TOKENS,
                        session=[r[3][0] if r[3] else -1 for r in hashed])
    rows.sort(key=lambda r: r[0])
    return Requests([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def requests_from_recording(text: str, where: str, file: Path) -> Requests:
    """The requests a live gateway saw, from its ``--record`` file.

    Each first attempt (a ``pick`` or an ``admit`` without excluded nodes,
    admitted, queued or shed alike) is one arrival, at its time relative to the
    first one, with its prompt length; its answer length is what the finish
    of its ticket (for a queued request: the ticket ``poll_queue`` dispatched
    it with) reported when it succeeded, else its ``max_tokens``, else the
    median of the successful answers.
    """
    # t, prompt, max_tokens, ticket, waiter
    picks: list[tuple[float, int, int | None, int | None, int | None]] = []
    outputs: dict[int, int] = {}
    dispatched: dict[int, int] = {}  # waiter -> ticket
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(where, f"{file}:{lineno}: not JSON ({exc.msg})") from exc
        op = rec.get("op")
        if op == "pick" and not rec.get("exclude"):
            picks.append((float(rec["t"]), int(rec["prompt_tokens"]), rec.get("max_tokens"),
                          rec.get("ticket"), None))
        elif op == "admit" and not rec.get("exclude"):
            result = rec.get("result") or {}
            picks.append((float(rec["t"]), int(rec["prompt_tokens"]), rec.get("max_tokens"),
                          result.get("ticket"), result.get("queued")))
        elif op == "poll_queue":
            for d in rec.get("decisions", ()):
                if "ticket" in d:
                    dispatched[int(d["waiter"])] = int(d["ticket"])
        elif op == "finish" and rec.get("outcome") == "ok" and rec.get("output_tokens", 0) > 0:
            outputs[int(rec["ticket"])] = int(rec["output_tokens"])
    if not picks:
        raise ConfigError(where, f"{file}: the recording holds no requests")
    known = sorted(outputs.values())
    fallback = known[len(known) // 2] if known else 1
    picks.sort(key=lambda p: p[0])
    t0 = picks[0][0]
    arrivals, prompts, answers = [], [], []
    for t, prompt, max_tokens, ticket, waiter in picks:
        if ticket is None and waiter is not None:
            ticket = dispatched.get(waiter)
        arrivals.append(t - t0)
        prompts.append(max(1, prompt))
        out = outputs.get(ticket) if ticket is not None else None
        answers.append(out if out is not None else int(max_tokens or fallback))
    return Requests(arrivals, prompts, answers)


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
        trace = read_trace(arrival.path, "workload.arrival.path")
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
