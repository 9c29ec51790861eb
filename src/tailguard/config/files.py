"""Reading and checking configuration files (scenarios, fleet files).

Errors are :class:`ConfigError` naming the dotted field, which the CLI turns
into exit code 2 and one line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tailguard.errors import ConfigError


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed document of ``path``; ``what`` names the file in errors ("scenario")."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read {what} {str(p)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"{p}: not UTF-8 text (byte {exc.start}: "
                              f"{exc.object[exc.start:exc.start + 1]!r})") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{p}: not valid YAML: {exc}") from exc


def require_mapping(raw: Any, where: str) -> Mapping[str, Any]:
    """``raw`` itself if it is a mapping, else an error naming ``where``."""
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"must be a mapping, got {type(raw).__name__}")
    return raw


def check_keys(raw: Mapping[str, Any], allowed: Sequence[str], where: str,
               extensions: bool = False) -> None:
    """Reject keys outside ``allowed``; with ``extensions``, keys starting ``x-`` pass."""
    for key in raw:
        if extensions and isinstance(key, str) and key.startswith("x-"):
            continue
        if key not in allowed:
            raise ConfigError(field_name(where, str(key)), "unknown key",
                              list(allowed))


def field_name(where: str, key: str) -> str:
    """``where.key``, or ``key`` at the top level (``where`` empty)."""
    return f"{where}.{key}" if where else key


def _given(raw: Mapping[str, Any], key: str, name: str, default: object) -> Any:
    """The value under ``key`` (None when absent or null, an error if then required)."""
    value = raw.get(key)
    if value is None and default is None:
        raise ConfigError(name, "is required")
    return value


def number(raw: Mapping[str, Any], key: str, where: str, default: float | None = None,
           positive: bool = True, minimum: float | None = None) -> float:
    """A number under ``key``: > 0 when ``positive``, >= ``minimum`` when given;
    ``default`` when absent or null (None: the key is required)."""
    name = field_name(where, key)
    value = _given(raw, key, name, default)
    if value is None:
        return default  # type: ignore[return-value]  # _given raised if both are None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):  # YAML's .inf and .nan (NaN passed every bound)
        raise ConfigError(name, f"must be finite, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(name, f"must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be >= {minimum:g}, got {value!r}")
    return float(value)


def optional_number(raw: Mapping[str, Any], key: str, where: str, positive: bool = True,
                    minimum: float | None = None) -> float | None:
    """:func:`number`, or None when ``key`` is absent or null."""
    if raw.get(key) is None:
        return None
    return number(raw, key, where, positive=positive, minimum=minimum)


def integer(raw: Mapping[str, Any], key: str, where: str, default: int | None = None,
            minimum: int = 1, maximum: int | None = None) -> int:
    """An integer in [``minimum``, ``maximum``] under ``key``; ``default`` when absent
    or null (None: the key is required)."""
    name = field_name(where, key)
    value = _given(raw, key, name, default)
    if value is None:
        return default  # type: ignore[return-value]  # _given raised if both are None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, f"must be <= {maximum}, got {value!r}")
    return value
