"""Length distributions for the simulator's workloads: how long prompts and answers are.

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
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal, Protocol

from tailguard.config.files import check_keys, integer, number, require_mapping
from tailguard.errors import ConfigError

Field = Literal["input_tokens", "output_tokens"]
DISTS: tuple[str, ...] = ("fixed", "uniform", "lognormal", "azure-conv", "azure-code")
#: Hard cap on any token count (int32), so an unbounded lognormal stays finite.
TOKEN_CAP = 2**31 - 1
#: Default ``max`` of the Azure presets, per field.
PRESET_MAX: Mapping[str, int] = {"input_tokens": 8192, "output_tokens": 4096}

_STD = NormalDist()


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


__all__ = ["DISTS", "PRESET_MAX", "TOKEN_CAP", "Component", "Field", "FixedLength", "LengthDist",
           "MixtureLength", "UniformLength", "parse_length_dist"]
