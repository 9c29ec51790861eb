"""Reading and checking configuration files (scenarios, fleet files).

Errors are :class:`ConfigError` naming the dotted field, which the CLI turns
into exit code 2 and one line.
"""

from __future__ import annotations

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
            raise ConfigError(f"{where}.{key}" if where else str(key), "unknown key",
                              list(allowed))
