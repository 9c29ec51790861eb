"""Errors that the CLI turns into exit code 2 with one clear message."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration, scenario or catalog value is invalid.

    ``field`` is the dotted path of the offending key (``fleet[1].gpu``) so the
    message can name it; ``allowed`` lists the accepted values when the set is
    finite.
    """

    def __init__(self, field: str, message: str, allowed: list[str] | None = None) -> None:
        self.field = field
        self.message = message
        self.allowed = allowed
        text = f"{field}: {message}" if field else message
        if allowed:
            text += f" (allowed: {', '.join(allowed)})"
        super().__init__(text)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, list[str] | None]]:
        # Picklable with its own arguments (a process pool sends errors back).
        return (type(self), (self.field, self.message, self.allowed))
