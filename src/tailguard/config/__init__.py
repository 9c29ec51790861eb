"""One configuration layer for fleet files, scenarios, inventories and the core's
option blocks: pydantic models read through one entry point, :func:`parse`."""

from tailguard.config.parse import Block, FieldError, block_for, parse, parse_core

__all__ = ["Block", "FieldError", "block_for", "parse", "parse_core"]
