"""The DCGM exporter page an emulated node serves (``/dcgm``), one series per GPU,
in dcgm-exporter's metric names and labels, consistent with the node's faults."""

from __future__ import annotations

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.emulator.faults import FaultState
from tailguard.emulator.fleet import EmulatedNode

# Maximum SM clocks (MHz) of the catalog's cards, from NVIDIA's data sheets; others 1800.
_MAX_SM_CLOCK = {"H100-SXM": 1980, "H100-PCIe": 1755, "H200": 1980, "A100-80GB": 1410,
                 "A100-40GB": 1410, "L40S": 2520, "L4": 2040, "A10G": 1710, "T4": 1590,
                 "V100": 1530}
_DCGM_FIELDS = (("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
                ("DCGM_FI_DEV_MAX_SM_CLOCK", "Maximum SM clock frequency (in MHz)."),
                ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons."),
                ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
                ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
                ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
                ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
                ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."))


def dcgm_page(node: EmulatedNode, state: FaultState) -> str:
    """The node's GPUs as dcgm-exporter shows them, throttled as the faults say:
    a throttle with ``gpu_index`` is that GPU's hardware thermal slowdown (its SM
    clock at the fault's factor; the replica runs at its slowest rank's pace), one
    without it every GPU's."""
    gpu = DEFAULT_CATALOG.gpu(node.gpu, f"node {node.id}: gpu")
    model = next((a for a in gpu.aliases if a.startswith("NVIDIA")), gpu.name)
    max_clock = _MAX_SM_CLOCK.get(gpu.name, 1800)
    total_mib = gpu.mem_gb * 1024
    lines = []
    for name, help_text in _DCGM_FIELDS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for i in range(node.tp):
            factor = state.gpu_factor(i)
            hot = factor < 1.0
            value = {
                "DCGM_FI_DEV_SM_CLOCK": round(max_clock * factor),
                "DCGM_FI_DEV_MAX_SM_CLOCK": max_clock,
                "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x40 if hot else 0,
                "DCGM_FI_DEV_GPU_TEMP": 91 if hot else 62,
                "DCGM_FI_DEV_FB_USED": round(total_mib * 0.9),  # what vLLM preallocates
                "DCGM_FI_DEV_FB_FREE": round(total_mib * 0.1),
                "DCGM_FI_DEV_GPU_UTIL": 100,
                "DCGM_FI_DEV_XID_ERRORS": 0,
            }[name]
            lines.append(f'{name}{{gpu="{i}",UUID="GPU-{node.id}-{i}",device="nvidia{i}",'
                         f'modelName="{model}",Hostname="{node.id}"}} {value}')
    return "\n".join(lines) + "\n"
