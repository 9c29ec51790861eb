"""The GPU inventory that ``tailguard plan --inventory`` forms replicas from.

::

    hosts:
      - {name: h1, gpu: H100-SXM, count: 8, link: nvlink}
      - {name: a1, gpu: A100-80GB, count: 4, link: pcie}
      - {name: l1, gpu: L4, count: 8}              # link: pcie unless the GPU has NVLink
    prices: {H100-SXM: 4.0, L4: 0.7}               # $/GPU-hour (default: the catalog's)
    network_gbps: 25                               # between hosts, GB/s (pipeline sends)

``link`` is the link inside a host that tensor parallelism all-reduces over:
``nvlink`` (the catalog's figure for the GPU; an error for a card without
NVLink), ``pcie`` (PCIe 4.0 x16, 32 GB/s, or less where the catalog says so)
or a number of GB/s. A host whose link differs from the catalog's figure gets
its own GPU variant (``A100-80GB@pcie``), so that its replicas are modelled
and compared apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tailguard.config.files import check_keys, integer, number, require_mapping
from tailguard.core.hardware import DEFAULT_CATALOG, DEFAULT_PERF, GPU, Catalog
from tailguard.errors import ConfigError

PCIE_GBPS = 32.0
# A card whose catalog link is at most this has no NVLink (PCIe 5.0 x16 is 64).
NVLINK_MIN_GBPS = 64.0


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    gpu: GPU  # with the host's link as its interconnect and its price
    count: int
    link: str  # as written: nvlink, pcie or "<n> GB/s"
    catalog_gpu: str  # the catalog's name of the GPU (what a fleet file says)
    devices: tuple[int, ...] = ()  # the GPU indices to use (default: 0 .. count-1)

    @property
    def usable(self) -> tuple[int, ...]:
        return self.devices or tuple(range(self.count))


@dataclass(frozen=True, slots=True)
class Inventory:
    hosts: tuple[Host, ...]
    network_gbps: float  # between hosts, for pipeline stages on different hosts
    prices: tuple[GPU, ...] = ()  # the GPUs ``prices:`` names, at those prices (buyable)

    @property
    def cost_per_hour(self) -> float:
        return sum(h.count * h.gpu.price_per_hour for h in self.hosts)

    def gpu_counts(self) -> dict[GPU, int]:
        """The usable GPUs of each type (a host's link makes its own type)."""
        out: dict[GPU, int] = {}
        for h in self.hosts:
            out[h.gpu] = out.get(h.gpu, 0) + len(h.usable)
        return out

    def catalog(self, base: Catalog = DEFAULT_CATALOG) -> Catalog:
        """``base`` with the hosts' GPU variants added (what a scenario needs)."""
        out = Catalog(tuple(base.gpus), tuple(base.models))
        for h in self.hosts:
            out.add_gpu(h.gpu)
        return out


def exclude(inv: Inventory, gpus: str) -> Inventory:
    """``inv`` without the GPUs ``HOST:INDEX[,HOST:INDEX...]`` names (a straggling or
    failed GPU to re-form around); a host left with none is dropped."""
    out: dict[str, set[int]] = {}
    by_name = {h.name: h for h in inv.hosts}
    for item in (x.strip() for x in gpus.split(",") if x.strip()):
        host, sep, index = item.rpartition(":")
        if not sep or host not in by_name or not index.isdigit():
            raise ConfigError("--exclude", f"must be HOST:GPU_INDEX of the inventory "
                              f"(hosts: {', '.join(by_name)}), got {item!r}")
        if int(index) not in by_name[host].usable:
            raise ConfigError("--exclude", f"{host} has no GPU {index} "
                              f"(0..{by_name[host].count - 1})")
        out.setdefault(host, set()).add(int(index))
    hosts = []
    for h in inv.hosts:
        left = tuple(i for i in h.usable if i not in out.get(h.name, set()))
        if left:
            hosts.append(replace(h, count=len(left), devices=left))
    if not hosts:
        raise ConfigError("--exclude", "leaves no GPU")
    return replace(inv, hosts=tuple(hosts))


def _link(raw: Any, gpu: GPU, where: str) -> tuple[float, str]:
    if raw is None:
        return gpu.interconnect_gbps, ("nvlink" if gpu.interconnect_gbps > NVLINK_MIN_GBPS
                                       else "pcie")
    if raw == "nvlink":
        if gpu.interconnect_gbps <= NVLINK_MIN_GBPS:
            raise ConfigError(where, f"{gpu.name} has no NVLink (catalog link "
                              f"{gpu.interconnect_gbps:g} GB/s); say pcie")
        return gpu.interconnect_gbps, "nvlink"
    if raw == "pcie":
        return min(gpu.interconnect_gbps, PCIE_GBPS), "pcie"
    if isinstance(raw, int | float) and not isinstance(raw, bool) and raw > 0:
        return float(raw), f"{raw:g} GB/s"
    raise ConfigError(where, f"must be nvlink, pcie or GB/s > 0, got {raw!r}")


def parse_inventory(raw: Any, catalog: Catalog = DEFAULT_CATALOG) -> Inventory:
    m = require_mapping(raw, "inventory")
    check_keys(m, ("hosts", "prices", "network_gbps"), "")
    prices: Mapping[str, Any] = require_mapping(m.get("prices") or {}, "prices")
    price_of: dict[str, float] = {}
    for name in prices:
        g = catalog.gpu(str(name), f"prices.{name}")
        price_of[g.name] = number(prices, name, "prices")  # $/GPU-hour
    net = number(m, "network_gbps", "", DEFAULT_PERF.pp_link_gbps)
    hosts_raw = m.get("hosts")
    if not isinstance(hosts_raw, list) or not hosts_raw:
        raise ConfigError("hosts", "must be a non-empty list of {name, gpu, count}")
    hosts: list[Host] = []
    names: set[str] = set()
    for i, item in enumerate(hosts_raw):
        w = f"hosts[{i}]"
        h = require_mapping(item, w)
        check_keys(h, ("name", "gpu", "count", "link"), w)
        if "gpu" not in h:
            raise ConfigError(f"{w}.gpu", "is required", [g.name for g in catalog.gpus])
        base = catalog.gpu(str(h["gpu"]), f"{w}.gpu")
        name = str(h.get("name", f"host{i}"))
        if name in names:
            raise ConfigError(f"{w}.name", f"duplicate host {name!r}")
        names.add(name)
        count = integer(h, "count", w, 1)
        gbps, link = _link(h.get("link"), base, f"{w}.link")
        gpu = replace(base, price_per_hour=price_of.get(base.name, base.price_per_hour),
                      interconnect_gbps=gbps, aliases=())
        if gbps != base.interconnect_gbps:
            gpu = replace(gpu, name=f"{base.name}@{link.replace(' ', '').replace('/', '')}")
        hosts.append(Host(name, gpu, count, link, base.name))
    buyable = tuple(replace(catalog.gpu(n), price_per_hour=v) for n, v in price_of.items())
    return Inventory(tuple(hosts), float(net), buyable)


__all__ = ["Host", "Inventory", "exclude", "parse_inventory"]
