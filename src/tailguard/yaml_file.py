"""Reading a YAML configuration file, with errors the CLI turns into exit code 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tailguard.errors import ConfigError


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed document of ``path``; ``what`` names the file in errors ("scenario")."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("", f"cannot read {what} {str(p)!r}: {exc.strerror}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{p}: not valid YAML: {exc}") from exc
