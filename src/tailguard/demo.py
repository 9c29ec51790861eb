"""``tailguard demo``: a live mixed fleet on one machine, in about a minute.

Starts emulated engines for a mixed fleet (H100, A100 and L4 cards running the
engine model in real time), a tailguard gateway in front of them with the
default policy, and the load generator at about 70% of the fleet's SLO
capacity (computed by the simulator's capacity search for the same token
lengths). Prints the gateway and metrics URLs while it runs and a result
table per GPU class at the end. Ctrl-C stops everything; nothing is left
running (all three run in this one process).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from rich.console import Console
from rich.table import Table

from tailguard.bench import BenchConfig, run_bench
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import run_gateway
from tailguard.gateway.config import parse_fleet
from tailguard.sim.capacity import capacity_bound
from tailguard.sim.workload import parse_length_dist

MODEL = "llama-3.1-8b"
FLEET = (("H100-SXM", 1), ("A100-80GB", 2), ("L4", 4))
INPUT = {"dist": "azure-conv", "max": 4096}
OUTPUT = {"dist": "uniform", "min": 16, "max": 160}
SLO = Slo(ttft_s=2.0, tpot_s=0.10)


def demo_capacity() -> float:
    """The fleet's SLO capacity bound (req/s) for the demo's token lengths."""
    return capacity_bound(MODEL, SLO, FLEET, INPUT, OUTPUT)


def _nodes() -> list[EmulatedNode]:
    out = []
    for gpu, count in FLEET:
        for i in range(count):
            out.append(EmulatedNode(f"{gpu.split('-')[0].lower()}-{i}", gpu, models=(MODEL,)))
    return out


def per_gpu(doc: dict[str, Any], gpu_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """The bench's per-node results folded into GPU classes."""
    out: dict[str, dict[str, float]] = {}
    for gpu in sorted(set(gpu_of.values())):
        out[gpu] = {"nodes": 0, "requests": 0, "completed": 0, "share": 0.0, "met": 0.0,
                    "ttft_p99_s": 0.0, "tpot_p99_s": 0.0}
        out[gpu]["nodes"] = sum(1 for g in gpu_of.values() if g == gpu)
    for node, info in doc["results"]["bench"].get("per_node", {}).items():
        g = out.get(gpu_of.get(node, ""))
        if g is None:
            continue
        g["requests"] += info["requests"]
        g["completed"] += info["completed"]
        g["share"] += info["share"]
        g["met"] += info["slo_attainment"] * info["requests"]
        g["ttft_p99_s"] = max(g["ttft_p99_s"], info["ttft_p99_s"])
        g["tpot_p99_s"] = max(g["tpot_p99_s"], info["tpot_p99_s"])
    return out


def _table(doc: dict[str, Any], gpu_of: dict[str, str]) -> Table:
    res = doc["results"]["bench"]
    table = Table(title=f"demo: {res['completed']} requests completed at {res['offered_rps']:.1f} "
                        f"req/s offered; SLO attainment {res['slo_attainment']:.4f}, TTFT p99 "
                        f"{res['ttft_s']['p99']:.3f} s, TPOT p99 {res['tpot_s']['p99']:.3f} s")
    for col in ("GPU class", "nodes", "requests", "share", "SLO att.", "TTFT p99 (worst node)",
                "TPOT p99 (worst node)"):
        table.add_column(col, justify="left" if col == "GPU class" else "right")
    for gpu, g in per_gpu(doc, gpu_of).items():
        att = f"{g['met'] / g['requests']:.4f}" if g["requests"] else "-"
        table.add_row(gpu, str(int(g["nodes"])), str(int(g["requests"])), f"{g['share']:.3f}", att,
                      f"{g['ttft_p99_s']:.3f}", f"{g['tpot_p99_s']:.3f}")
    return table


async def run_demo(duration_s: float, load: float, console: Console) -> tuple[
        dict[str, Any], dict[str, str]]:
    bound = demo_capacity()
    rate = load * bound
    nodes = _nodes()
    gpu_of = {n.id: n.gpu for n in nodes}
    async with run_emulator(nodes, host="127.0.0.1") as emu:
        fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: {"policy": "tailguard",
                              "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}}},
        })
        async with run_gateway(fleet, host="127.0.0.1", port=0) as gw:
            console.print(f"gateway:  {gw.url}/v1   (OpenAI-compatible; try /v1/models)")
            console.print(f"metrics:  {gw.url}/metrics")
            console.print(f"dashboard: {gw.url}/dashboard   (live, in a browser)")
            console.print(f"fleet capacity bound {bound:.1f} req/s; offering {rate:.1f} req/s "
                          f"({load:.0%}) for {duration_s:.0f} s ...")
            doc = await run_bench(BenchConfig(
                gw.url, model=MODEL, rate=rate, duration_s=duration_s,
                input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
                slo=SLO, ignore_eos=True, drain_s=30.0,
            ))
    console.print(_table(doc, gpu_of))
    return doc, gpu_of


def cmd_demo(args: argparse.Namespace) -> int:
    from tailguard.gateway.server import _loop_factory

    console = Console()
    runner = asyncio.Runner(loop_factory=_loop_factory)
    try:
        runner.run(run_demo(args.duration, args.load, console))
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    finally:
        runner.close()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="a live emulated mixed fleet behind the gateway, under load")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--load", type=float, default=0.7,
                   help="offered load as a fraction of the fleet's SLO capacity (default 0.7)")
    p.set_defaults(func=cmd_demo)
