"""The ``catalog:`` block of a fleet file or scenario: GPUs and models to add to (or
replace in) the built-in catalog, each entry naming the fields of the core's
:class:`~tailguard.core.hardware.GPU` or :class:`~tailguard.core.hardware.Model`::

    catalog:
      gpus: [{name: X1, tflops: 100, mem_bw_gbps: 500, mem_gb: 32, tdp_w: 200,
              price_per_hour: 1.0}]
      models: [{name: tiny-1b, params: 1.0e9, layers: 16, hidden: 2048, kv_heads: 8,
                head_dim: 64}]
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tailguard.config.parse import Block, block_for, parse, retype
from tailguard.core.hardware import GPU, Catalog, Model

# Every figure of a card or a model is positive; a card may have no link of its own.
_POSITIVE = {"gt": 0.0}
_ALIASES = {"strict": False}  # a list in the file, a tuple in the core

GpuBlock = block_for(GPU, bounds={
    "tflops": _POSITIVE, "mem_bw_gbps": _POSITIVE, "mem_gb": _POSITIVE, "tdp_w": _POSITIVE,
    "price_per_hour": _POSITIVE, "interconnect_gbps": {"ge": 0.0}, "aliases": _ALIASES,
})

ModelBlock = block_for(Model, bounds={
    "params": _POSITIVE, "bytes_per_weight": _POSITIVE, "aliases": _ALIASES,
})


class CatalogBlock(Block):
    # The entries' blocks are made at import (block_for): typed as Blocks here.
    gpus: list[Block] = Field(default_factory=list)
    models: list[Block] = Field(default_factory=list)


retype(CatalogBlock, gpus=list[GpuBlock], models=list[ModelBlock])  # type: ignore[valid-type]


def extend_catalog(catalog: Catalog, raw: Any, where: str = "catalog") -> Catalog:
    """``catalog`` with a file's ``catalog:`` block added."""
    block = raw if isinstance(raw, CatalogBlock) else parse(CatalogBlock, raw, where)
    return catalog.extend([g.core() for g in block.gpus], [m.core() for m in block.models])


__all__ = ["CatalogBlock", "GpuBlock", "ModelBlock", "extend_catalog"]
