"""The one way a configuration block is read: :func:`parse`.

Every block of a fleet file, scenario or inventory is a pydantic v2 model
(:class:`Block`: unknown keys refused, values strict, so ``"8"`` is not a
number and ``true`` not an integer), validated here, and a failure becomes a
:class:`~tailguard.errors.ConfigError` naming the dotted field
(``pools.m.limits.kind``), which the CLI turns into one line and exit code 2.
Keys starting with ``x-`` are the user's own (notes, tooling) and are ignored.

A block that configures part of the decision core is built from that part's
frozen dataclass (:func:`block_for`): the dataclass stays the one place its
fields, types and defaults are written, the block adds the bounds a file's
values must keep, and :meth:`Block.core` returns the dataclass.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from tailguard.errors import ConfigError

B = TypeVar("B", bound="Block")


class FieldError(ValueError):
    """A validator's complaint that names the field to fix (``field``, under the
    block it checks; None: the field validated) and, where the set is finite, the
    values allowed."""

    def __init__(self, field: str | None, message: str,
                 allowed: list[str] | tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.allowed = list(allowed) if allowed is not None else None


class Block(BaseModel):
    """A configuration block (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True,
                              allow_inf_nan=False)
    # The core dataclass this block builds (None: a block of its own).
    CORE: ClassVar[Any] = None
    # A bare value standing for the whole block, as this key (``retries: 2``).
    SHORTHAND: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        if cls.SHORTHAND is not None and not isinstance(data, Mapping) and data is not None:
            return {cls.SHORTHAND: data}
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items()
                    if not (isinstance(k, str) and k.startswith("x-"))}
        return data

    def core(self) -> Any:
        """The core's frozen dataclass of this block."""
        assert self.CORE is not None, f"{type(self).__name__} builds no core object"
        return self.CORE(**{name: getattr(self, name) for name in type(self).model_fields})


def block_for(cls: type[Any], *, bounds: Mapping[str, Mapping[str, Any]] | None = None,
              aliases: Mapping[str, str] | None = None, shorthand: str | None = None,
              types: Mapping[str, Any] | None = None,
              validators: Mapping[str, Any] | None = None) -> type[Block]:
    """A :class:`Block` with the fields of the dataclass ``cls``, their defaults, and
    ``bounds`` (pydantic ``Field`` arguments by field). Without bounds of their own,
    integers must be >= 1 and numbers >= 0 (and finite). ``aliases``: the key a file
    spells a field with; ``types``: a narrower type for a field (a ``Literal``);
    ``validators``: pydantic validators, for rules across fields."""
    hints = {**typing.get_type_hints(cls), **(types or {})}
    bounds = dict(bounds or {})
    aliases = dict(aliases or {})
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        factory: Any = f.default_factory
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif factory is not dataclasses.MISSING:
            default = factory()
        else:
            default = ...  # required
        limits = bounds.pop(f.name, None)
        if limits is None:
            base = typing.get_args(kind)[0] if isinstance(kind, _UnionType) else kind
            limits = {"ge": 1} if base is int else {"ge": 0.0} if base is float else {}
        fields[f.name] = (kind, Field(default, alias=aliases.pop(f.name, None), **limits))
    assert not bounds and not aliases, f"no such field of {cls.__name__}: {bounds or aliases}"
    model = create_model(f"{cls.__name__}Block", __base__=Block,
                         __validators__=dict(validators or {}), **fields)
    model.CORE = cls
    model.SHORTHAND = shorthand
    return model


def retype(model: type[Block], **annotations: Any) -> None:
    """Give ``model``'s fields typed :class:`Block` the type of the block they hold.

    Blocks made by :func:`block_for` exist only at run time, so a class that
    nests one declares the field as ``Block`` for the type checker and is
    retyped here, for validation and the JSON Schema."""
    for name, kind in annotations.items():
        model.model_fields[name].annotation = kind
    model.model_rebuild(force=True)


_UnionType = type(int | None)
_COMPARISONS = (("greater than or equal to ", ">= "), ("less than or equal to ", "<= "),
                ("greater than ", "> "), ("less than ", "< "))
_TYPE_TAGS = frozenset({"int", "str", "float", "bool", "list", "tuple", "dict", "none"})


def parse(model: type[B], raw: Any, where: str) -> B:
    """``raw`` (a parsed YAML or JSON value; None: every default) as ``model``, or a
    ConfigError naming the first bad field under ``where``."""
    try:
        return model.model_validate({} if raw is None else raw)
    except ValidationError as exc:
        raise _config_error(model, exc, where) from None


def parse_core(model: type[Block], raw: Any, where: str, *, optional: bool = False) -> Any:
    """The core dataclass of a block (:meth:`Block.core`); None for an ``optional``
    block the file leaves out (no limits, no queue)."""
    if optional and raw is None:
        return None
    return parse(model, raw, where).core()


def json_schema(model: type[Block]) -> dict[str, Any]:
    """The JSON Schema of a file format whose top level is ``model``: what the block
    validation accepts, ``x-`` keys and bare-value shorthands included."""
    doc = model.model_json_schema()
    shorthands = {cls.__name__: cls.SHORTHAND for cls in _subclasses(Block)
                  if cls.SHORTHAND is not None}
    for name, body in [("", doc), *doc.get("$defs", {}).items()]:
        if body.get("additionalProperties") is False:
            body["patternProperties"] = {"^x-": {}}
        key = shorthands.get(name)
        if key is not None:
            bare = dict(body["properties"][key])
            bare.pop("default", None)
            whole = {k: body.pop(k) for k in list(body) if k not in ("title", "description")}
            body["anyOf"] = [whole, bare]
    return doc


def _subclasses(cls: type[Block]) -> list[type[Block]]:
    out = []
    for sub in cls.__subclasses__():
        out.extend([sub, *_subclasses(sub)])
    return out


def _config_error(model: type[Block], exc: ValidationError, where: str) -> ConfigError:
    errors = exc.errors(include_url=False)
    # An unknown key first: it is most likely a typo of the key another error misses.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    path = where
    for part in err["loc"]:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            continue  # which member of a union the value was tried as
        if isinstance(part, int):
            path += f"[{part}]"
        elif part:
            path = f"{path}.{part}" if path else str(part)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        target = _model_at(model, err["loc"][:-1])
        allowed = [info.alias or name for name, info in target.model_fields.items()]
        return ConfigError(path, "unknown key", allowed)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return ConfigError(path, f"must be a mapping, got {type(value).__name__}")
    if kind == "missing":
        return ConfigError(path, "is required")
    message = str(err["msg"])
    if kind == "value_error":  # a validator's own words, whole
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, FieldError):
            if cause.field:
                path = f"{path}.{cause.field}" if path else cause.field
            return ConfigError(path, str(cause), cause.allowed)
        return ConfigError(path, message.removeprefix("Value error, "))
    for prefix, said in (("Input should be ", "must be "), ("Input should ", "must ")):
        if message.startswith(prefix):
            message = said + message[len(prefix):]
    message = message[:1].lower() + message[1:]
    for words, sign in _COMPARISONS:
        message = message.replace(words, sign)
    if not isinstance(value, Mapping):
        if isinstance(value, float) and not math.isfinite(value):
            message = "must be finite"
        message += f", got {value!r}"
    return ConfigError(path, message)


def _model_at(model: type[Block], loc: tuple[Any, ...]) -> type[Block]:
    """The (nested) block a location's last key belongs to."""
    for part in loc:
        if isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            break
        inner = info.annotation
        for arg in (inner, *typing.get_args(inner)):
            if isinstance(arg, type) and issubclass(arg, Block):
                model = arg
                break
    return model


__all__ = ["Block", "FieldError", "block_for", "json_schema", "parse", "parse_core", "retype"]
