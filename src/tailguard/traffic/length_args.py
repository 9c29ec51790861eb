"""Token-length distributions written on a command line.

The simulator's scenario files give a length distribution as a mapping
(``{dist: lognormal, mu: 6.6, sigma: 1.0}``, parsed by
:func:`tailguard.traffic.workload.parse_length_dist`); a flag needs one word. The
word is ``NAME[:ARGS]`` and becomes that mapping, so both spellings accept and
reject exactly the same distributions:

==========================  ==========================================
``200``                     ``{dist: fixed, value: 200}``
``fixed:200``               the same
``uniform:10,100``          ``{dist: uniform, min: 10, max: 100}``
``lognormal:6.6,1.0``       ``{dist: lognormal, mu: 6.6, sigma: 1.0}``
``lognormal:6.6,1.0,4096``  ... with ``max: 4096``
``azure-conv``              the Azure 2023 conversation fit
``azure-code:max=2048``     a preset with a key given by name
==========================  ==========================================

Arguments are positional in the order of the table or ``key=value``.
"""

from __future__ import annotations

from typing import Any, Literal

from tailguard.errors import ConfigError
from tailguard.traffic.workload import DISTS, LengthDist, parse_length_dist

_POSITIONAL = {
    "fixed": ("value",),
    "uniform": ("min", "max"),
    "lognormal": ("mu", "sigma", "max", "min"),
    "azure-conv": ("max", "min"),
    "azure-code": ("max", "min"),
}


def _number(text: str, flag: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ConfigError(flag, f"not a number: {text!r}") from None


def length_dist_mapping(text: str, flag: str = "--tokens") -> dict[str, Any]:
    """The scenario-style mapping for a command-line distribution word."""
    text = text.strip()
    name, _, args = text.partition(":")
    name = name.strip().lower()
    if name and name[0].isdigit() and not args:
        return {"dist": "fixed", "value": _number(name, flag)}
    if name not in _POSITIONAL:
        raise ConfigError(flag, f"unknown distribution {name!r} in {text!r}", list(DISTS))
    out: dict[str, Any] = {"dist": name}
    keys = _POSITIONAL[name]
    for i, part in enumerate(p.strip() for p in args.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq:
            if i >= len(keys):
                raise ConfigError(flag, f"too many values for {name}: {text!r}")
            key, value = keys[i], part
        out[key.strip()] = _number(value.strip(), flag)
    return out


def parse_length_arg(
    text: str, flag: str, field: Literal["input_tokens", "output_tokens"]
) -> LengthDist:
    """Parse ``text`` (see the module docstring); ``field`` picks the preset's column."""
    return parse_length_dist(length_dist_mapping(text, flag), flag, field)
