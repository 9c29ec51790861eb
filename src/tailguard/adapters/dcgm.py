"""GPU telemetry from an NVIDIA DCGM exporter page (``dcgm_url`` of a node).

dcgm-exporter serves one Prometheus sample per GPU and field, labelled
``gpu`` (the index), ``UUID`` and, in current releases, ``modelName``. This
module reads the fields that say whether a GPU runs at its speed:

==========================================  ====================================
``DCGM_FI_DEV_SM_CLOCK``                    SM clock, MHz
``DCGM_FI_DEV_MAX_SM_CLOCK``                its maximum, MHz
``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``      the NVML throttle bitmask (newer
(or ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``)   DCGM renames it "clocks event")
``DCGM_FI_DEV_GPU_TEMP``                    temperature, C
``DCGM_FI_DEV_POWER_USAGE``                 power, W
``DCGM_FI_DEV_FB_USED`` / ``_FB_FREE``      frame buffer, MiB
``DCGM_FI_DEV_GPU_UTIL``                    utilisation, %
``DCGM_FI_DEV_XID_ERRORS``                  the last XID error code (0: none)
==========================================  ====================================

DCGM writes "blank" values (no reading) as integers just below 2**63
(``DCGM_INT64_BLANK`` = 0x7ffffffffffffff0 and the codes above it; the
exporter's README shows 9223372036854775794 for a memory temperature): they
are read as missing, never as a temperature. Throttle bits follow NVML's
``nvmlClocksThrottleReasons`` (see ``docs/sources.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tailguard.config.fleet import NodeConfig
from tailguard.core.hardware import DEFAULT_CATALOG

BLANK = 0x7FFFFFFFFFFFFFF0  # DCGM_INT64_BLANK: at or above it, no reading
# NVML clocks-throttle-reason bits; GPU idle and the application clock setting
# are not slowdowns, and neither is a software power cap alone at low load.
THROTTLE_BITS = {
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
_FIELDS = {
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MAX_SM_CLOCK": "max_sm_clock_mhz",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_FB_USED": "fb_used_mib",
    "DCGM_FI_DEV_FB_FREE": "fb_free_mib",
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
}
SLOW_CLOCK = 0.85  # an SM clock below this share of its maximum is a slowdown


@dataclass(slots=True)
class GpuTelemetry:
    """One GPU's latest DCGM readings (None: not exported, or blank)."""

    index: int
    uuid: str = ""
    model: str = ""
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    throttle_reasons: int | None = None
    temp_c: float | None = None
    power_w: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    util_pct: float | None = None
    xid: int | None = None

    @property
    def clock_ratio(self) -> float | None:
        if self.sm_clock_mhz is None or not self.max_sm_clock_mhz:
            return None
        return self.sm_clock_mhz / self.max_sm_clock_mhz

    def slowdowns(self) -> list[str]:
        """What slows this GPU now: throttle reasons, or a low clock without one."""
        mask = self.throttle_reasons or 0
        out = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
        ratio = self.clock_ratio
        if ratio is not None and ratio < SLOW_CLOCK and not out and (self.util_pct or 0) > 0:
            out.append("low SM clock")
        return out

    def cause_kind(self) -> str | None:
        """``gpu_xid``, ``gpu_throttle`` or None: what remediation rules match on."""
        if self.xid:
            return "gpu_xid"
        if self.slowdowns():
            return "gpu_throttle"
        return None

    def cause(self, of: int | None = None) -> str | None:
        """``GPU 3 of 4: hardware thermal slowdown, SM clock 1.10 of 1.98 GHz``, or None."""
        slow = self.slowdowns()
        if not slow and not self.xid:
            return None
        parts = list(slow)
        if self.xid:
            parts.append(f"XID {self.xid}")
        ratio = self.clock_ratio
        if ratio is not None and self.sm_clock_mhz is not None and self.max_sm_clock_mhz:
            parts.append(f"SM clock {self.sm_clock_mhz / 1000:.2f} of "
                         f"{self.max_sm_clock_mhz / 1000:.2f} GHz")
        where = f"GPU {self.index}" + (f" of {of}" if of else "")
        return f"{where}: {', '.join(parts)}"

    def as_dict(self) -> dict[str, object]:
        return {"gpu": self.index, "uuid": self.uuid, "model": self.model,
                "sm_clock_mhz": self.sm_clock_mhz, "max_sm_clock_mhz": self.max_sm_clock_mhz,
                "throttle_reasons": self.throttle_reasons, "slowdowns": self.slowdowns(),
                "temp_c": self.temp_c, "power_w": self.power_w,
                "fb_used_mib": self.fb_used_mib, "fb_free_mib": self.fb_free_mib,
                "util_pct": self.util_pct, "xid": self.xid}


class DcgmError(ValueError):
    """The page is not a DCGM exporter page (or no GPU is on it)."""


def parse_dcgm(text: str) -> list[GpuTelemetry]:
    """The GPUs on a dcgm-exporter page, by index (raises :class:`DcgmError`)."""
    gpus: dict[int, GpuTelemetry] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise DcgmError(f"not a Prometheus page: {exc}") from exc
    for fam in families:
        for s in fam.samples:
            attr = _FIELDS.get(s.name)
            if attr is None or "gpu" not in s.labels:
                continue
            try:
                index = int(s.labels["gpu"])
            except ValueError:
                continue
            g = gpus.get(index)
            if g is None:
                g = gpus[index] = GpuTelemetry(index)
            g.uuid = g.uuid or s.labels.get("UUID", "")
            g.model = g.model or s.labels.get("modelName", "")
            v = s.value
            if v != v or v >= BLANK or v < 0:  # NaN, a DCGM blank, or nonsense
                continue
            setattr(g, attr, int(v) if attr in ("throttle_reasons", "xid") else float(v))
    if not gpus:
        raise DcgmError("no DCGM_FI_DEV_* sample with a gpu label on the page")
    return [gpus[i] for i in sorted(gpus)]


def gpu_mismatch(node: NodeConfig, gpus: list[GpuTelemetry]) -> str | None:
    """How the DCGM page contradicts the fleet file (GPU model or count), or None."""
    problems = []
    if len(gpus) != node.tp:
        problems.append(f"{len(gpus)} GPUs on its DCGM page, tp {node.tp} in the fleet file")
    models = {g.model for g in gpus if g.model}
    for model in sorted(models):
        found = DEFAULT_CATALOG.find_gpu(model)
        if node.gpu_spec is not None and found is not None and found.name != node.gpu_spec.name:
            problems.append(f"its GPUs are {model} ({found.name}), the fleet file says "
                            f"{node.gpu} ({node.gpu_spec.name})")
    return "; ".join(problems) or None


__all__ = ["DcgmError", "GpuTelemetry", "gpu_mismatch", "parse_dcgm"]
