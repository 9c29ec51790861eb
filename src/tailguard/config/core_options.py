"""The SLO and a replica's hardware, as scenario and fleet files spell them (the
core's option blocks, ``limits`` to ``retries``, are ``tailguard.config.options``).

A replica's hardware is one GPU type (``gpu``, ``tp``), or a pipeline
(:class:`~tailguard.core.pipeline.Layout`), in the same keys for a scenario's
fleet entry and a fleet file's node (:class:`ReplicaShape`)::

    {gpu: A100-80GB, tp: 2}
    {gpu: A100-80GB, tp: 2, pp: 2, split: even}
    {stages: [{gpu: H100-SXM}, {gpu: A100-80GB}], split: speed, overlap: true}
    {gpu: H100-SXM, role: prefill, kv_link: rdma-8x400}
    {gpu: A100-80GB, role: decode, kv_link: {gb_per_s: 12.5, setup_ms: 2}}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tailguard.config.parse import Block, block_for, parse
from tailguard.core.hardware import GPU, Catalog
from tailguard.core.kv_transfer import LINKS, Link
from tailguard.core.pipeline import Layout, StageSpec
from tailguard.core.policies import Slo
from tailguard.errors import ConfigError

SloBlock = block_for(Slo, bounds={"ttft_s": {"gt": 0.0}, "tpot_s": {"gt": 0.0},
                                  "attainment": {"gt": 0.0, "le": 1.0}})


class StageBlock(Block):
    """One pipeline stage: ``tp`` GPUs of one type."""

    gpu: str = Field(min_length=1)
    tp: int = Field(default=1, ge=1)


class LinkBlock(Block):
    """A KV path: its achieved bandwidth and the fixed cost of one transfer."""

    gb_per_s: float = Field(gt=0.0)
    setup_ms: float = Field(default=1.0, ge=0.0)

    def link(self) -> Link:
        return Link(self.gb_per_s, self.setup_ms / 1000.0)


def kv_link(given: str | LinkBlock | None, where: str) -> Link | None:
    """A ``kv_link`` value: a named link (:data:`~tailguard.core.kv_transfer.LINKS`),
    a :class:`LinkBlock`, or None."""
    if given is None or isinstance(given, LinkBlock):
        return None if given is None else given.link()
    link = LINKS.get(given)
    if link is None:
        raise ConfigError(where, f"unknown link {given!r}", sorted(LINKS))
    return link


class ReplicaShape(Block):
    """The hardware keys of one replica (a scenario's fleet entry, a fleet file's node),
    and its role in disaggregated serving with its own KV path (its NIC)."""

    gpu: str | None = Field(default=None, min_length=1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    stages: list[StageBlock] | None = Field(default=None, min_length=1)
    split: Literal["even", "speed"] | list[int] = "speed"
    overlap: bool = False
    microbatches: int = Field(default=0, ge=0)
    link_gbps: float = Field(default=0.0, ge=0.0)  # GB/s between stages (0: the GPU's interconnect)
    role: Literal["both", "prefill", "decode"] = "both"
    kv_link: str | LinkBlock | None = None

    def layout(self, catalog: Catalog, where: str) -> Layout | None:
        """The replica's pipeline; None for a replica of one stage."""
        given = self.model_fields_set
        if self.stages is None and self.pp == 1:
            for key in ("split", "overlap", "microbatches", "link_gbps"):
                if key in given:
                    raise ConfigError(f"{where}.{key}", "applies to a pipeline: set pp or stages")
            return None
        if self.stages is not None:
            for key in ("gpu", "tp", "pp"):
                if key in given:
                    raise ConfigError(f"{where}.{key}", "give it per stage, under stages")
            stages = [StageSpec(catalog.gpu(s.gpu, f"{where}.stages[{j}].gpu"), s.tp)
                      for j, s in enumerate(self.stages)]
        else:
            stages = [StageSpec(self.gpu_of(catalog, where), self.tp)] * self.pp
        split = tuple(self.split) if isinstance(self.split, list) else self.split
        return Layout(tuple(stages), split, self.microbatches, self.overlap, self.link_gbps)

    def gpu_of(self, catalog: Catalog, where: str) -> GPU:
        """The catalog's GPU of a one-type replica (required and known)."""
        if self.gpu is None:
            raise ConfigError(f"{where}.gpu", "is required", [x.name for x in catalog.gpus])
        return catalog.gpu(self.gpu, f"{where}.gpu")


def parse_slo(raw: Any, where: str = "slo") -> Slo:
    """An ``slo:`` block (fleet pools and scenarios): absent keys take :class:`Slo`'s
    defaults."""
    slo: Slo = parse(SloBlock, raw, where).core()
    return slo


__all__ = ["LinkBlock", "ReplicaShape", "SloBlock", "StageBlock", "kv_link", "parse_slo"]
