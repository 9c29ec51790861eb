"""The SLO and a replica's pipeline, as scenario and fleet files spell them (the
core's option blocks, ``limits`` to ``retries``, are ``tailguard.config.options``).

A replica's pipeline (:class:`~tailguard.core.pipeline.Layout`) is a key set of
a scenario's fleet entry and of a fleet file's node::

    {gpu: A100-80GB, tp: 2, pp: 2, split: even}
    {stages: [{gpu: H100-SXM}, {gpu: A100-80GB}], split: speed, overlap: true}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tailguard.config_file import check_keys, integer, number, require_mapping
from tailguard.core.hardware import Catalog
from tailguard.core.pipeline import Layout, StageSpec
from tailguard.core.policies import Slo
from tailguard.errors import ConfigError

# The keys a pipeline adds to a fleet entry or node (besides gpu and tp).
PIPELINE_KEYS = ("pp", "stages", "split", "overlap", "microbatches", "link_gbps")


def parse_layout(g: Mapping[str, Any], w: str, catalog: Catalog) -> Layout | None:
    """A fleet entry's pipeline (``pp`` stages of ``tp`` x ``gpu``, or ``stages``);
    None for a replica of one stage. Scenario fleets and ``tailguard serve``'s
    nodes spell it alike (``PIPELINE_KEYS``)."""
    has_stages, pp = "stages" in g, integer(g, "pp", w, 1)
    if not has_stages and pp == 1:
        for key in ("split", "overlap", "microbatches", "link_gbps"):
            if key in g:
                raise ConfigError(f"{w}.{key}", "applies to a pipeline: set pp or stages")
        return None
    if has_stages:
        for key in ("gpu", "tp", "pp"):
            if key in g:
                raise ConfigError(f"{w}.{key}", "give it per stage, under stages")
        raw = g["stages"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{w}.stages", "must be a non-empty list of {gpu, tp}")
        stages = []
        for j, item in enumerate(raw):
            sw = f"{w}.stages[{j}]"
            st = require_mapping(item, sw)
            check_keys(st, ("gpu", "tp"), sw)
            if "gpu" not in st:
                raise ConfigError(f"{sw}.gpu", "is required", [x.name for x in catalog.gpus])
            stages.append(StageSpec(catalog.gpu(str(st["gpu"]), f"{sw}.gpu"),
                                    integer(st, "tp", sw, 1)))
    else:
        if "gpu" not in g:
            raise ConfigError(f"{w}.gpu", "is required", [x.name for x in catalog.gpus])
        one = StageSpec(catalog.gpu(str(g["gpu"]), f"{w}.gpu"), integer(g, "tp", w, 1))
        stages = [one] * pp
    split: str | tuple[int, ...] = "speed"
    raw_split = g.get("split", "speed")
    if isinstance(raw_split, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in raw_split):
            raise ConfigError(f"{w}.split", f"must be even, speed or layers per stage, "
                              f"got {raw_split!r}")
        split = tuple(raw_split)
    elif raw_split in ("even", "speed"):
        split = str(raw_split)
    else:
        raise ConfigError(f"{w}.split", f"must be even, speed or layers per stage, "
                          f"got {raw_split!r}")
    overlap = g.get("overlap", False)
    if not isinstance(overlap, bool):
        raise ConfigError(f"{w}.overlap", "must be true or false")
    link = number(g, "link_gbps", w, 0.0, positive=False, minimum=0.0)  # GB/s
    return Layout(tuple(stages), split, integer(g, "microbatches", w, 0, minimum=0), overlap,
                  float(link))


def parse_slo(raw: Any, where: str = "slo") -> Slo:
    """An ``slo:`` block (fleet pools and scenarios): null or absent keys take
    :class:`Slo`'s defaults."""
    if raw is None:
        return Slo()
    m = require_mapping(raw, where)
    check_keys(m, ("ttft_s", "tpot_s", "attainment"), where, extensions=True)
    base = Slo()
    att = number(m, "attainment", where, base.attainment)
    if att > 1.0:
        raise ConfigError(f"{where}.attainment", f"must be in (0, 1], got {att!r}")
    return Slo(number(m, "ttft_s", where, base.ttft_s), number(m, "tpot_s", where, base.tpot_s),
               att)
