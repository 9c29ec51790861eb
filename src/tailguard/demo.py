"""``tailguard demo``: why tailguard exists, in about two minutes on one machine.

A mixed fleet of emulated engines (A100s, V100s and L4s running the engine
model in real time) and one seeded load, run twice on fresh engines: first
behind a naive policy (``--baseline``, round robin by default, with the
straggler detector off: what a plain load balancer does), then behind
tailguard. Part-way through each run one fast node (an A100) is throttled to
a third of its speed, as a thermal throttle would, and later an L4 crashes.

The load comes from the simulator's capacity search: a little above what the
fleet can serve without its weakest class, so every class is needed (a fleet
left at 70% of its bound keeps its weak cards idle, and shows nothing).

In a terminal a live view refreshes every second: each node's GPU, state, in
flight (against its limit), TTFT and TPOT of its last answers against the
SLO, the detector's events as they happen, and the attainment so far. The
dashboard URL is printed before the load starts. At the end a side-by-side
table compares the runs (attainment, TTFT/TPOT p99, each GPU class's share)
and one sentence per run says what happened to the throttled node. Piped to
a file it prints the same header and results, and no progress. Ctrl-C stops
everything cleanly: engines, gateway and load all run in this one process.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tailguard.bench import BenchConfig, LoadGenerator
from tailguard.bench.loadgen import Record, summarize
from tailguard.config.fleet import parse_fleet
from tailguard.core.events import Event
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, parse_fault, run_emulator
from tailguard.gateway.app import RunningGateway, run_gateway
from tailguard.sim.fleet_bound import capacity_bound
from tailguard.traffic.workload import parse_length_dist

MODEL = "llama-3.1-8b"
FLEET = (("A100-80GB", 2), ("V100", 2), ("L4", 6))
INPUT = {"dist": "lognormal", "mu": 6.0, "sigma": 0.7, "max": 4096}
OUTPUT = {"dist": "uniform", "min": 16, "max": 128}
SLO = Slo(ttft_s=2.0, tpot_s=0.12)
STRAGGLER = "a100-0"  # throttled from THROTTLE[0] to THROTTLE[1] of the run
THROTTLE = (0.25, 0.8, 0.33)  # start, end (fractions of the run), speed factor
CRASHED = "l4-5"
CRASH = (0.55, 0.2)  # start and length (fractions of the run)
BASELINES = ("round_robin", "least_request", "random", "p2c", "peak_ewma", "seed_weighted")


def demo_rate(load: float | None = None) -> tuple[float, float, float]:
    """(offered req/s, the fleet's SLO capacity bound, the bound without its weakest class).

    ``load`` None: 5% above what the fleet serves without its weakest class (so
    that class is needed), at most 90% of the bound; else ``load`` x the bound.
    """
    full = capacity_bound(MODEL, SLO, FLEET, INPUT, OUTPUT)
    strong = capacity_bound(MODEL, SLO, FLEET[:-1], INPUT, OUTPUT)
    rate = min(1.05 * strong, 0.9 * full) if load is None else load * full
    return rate, full, strong


def _nodes() -> list[EmulatedNode]:
    return [EmulatedNode(f"{gpu.split('-')[0].lower()}-{i}", gpu, models=(MODEL,))
            for gpu, count in FLEET for i in range(count)]


@dataclass
class RunResult:
    """One run: what the clients measured, and what the gateway noticed."""

    label: str
    summary: dict[str, Any]
    shares: dict[str, float]  # of completed requests, by GPU class
    events: list[tuple[float, str, str, str]] = field(default_factory=list)  # t, node, state, why
    story: str = ""


def _tpot(r: Record) -> float:
    return (r.end - r.first) / (r.tokens - 1) if r.tokens > 1 else 0.0


def _meets(r: Record) -> bool:
    return r.error == "ok" and r.first - r.arrival <= SLO.ttft_s and _tpot(r) <= SLO.tpot_s


class LiveView:
    """The terminal view of a run in progress (rebuilt once a second)."""

    def __init__(self, label: str, gw: RunningGateway, gen: LoadGenerator,
                 gpu_of: dict[str, str], duration_s: float,
                 events: list[tuple[float, str, str, str]]) -> None:
        self.label = label
        self.gw = gw
        self.gen = gen
        self.gpu_of = gpu_of
        self.duration_s = duration_s
        self.events = events
        self.t0 = time.monotonic()

    def render(self) -> Group:
        now = time.monotonic() - self.t0
        done = [r for r in self.gen.records if r.end >= 0]
        recent: dict[str, list[Record]] = {}
        for r in done:
            if r.error == "ok" and r.end >= now - 10.0:
                recent.setdefault(r.node, []).append(r)
        table = Table(title=f"{self.label}: {min(now, self.duration_s):4.0f} / "
                            f"{self.duration_s:.0f} s", title_justify="left", expand=False)
        for col in ("node", "GPU", "state", "in flight", "served", "TTFT p90 / SLO",
                    "TPOT p90 / SLO"):
            table.add_column(col, justify="left" if col in ("node", "GPU", "state") else "right")
        served: dict[str, int] = {}
        for r in done:
            if r.error == "ok":
                served[r.node] = served.get(r.node, 0) + 1
        for node in self.gw.fleet.balancer.nodes.values():
            rs = recent.get(node.id, [])
            limit = f"/{node.limiter.limit}" if node.limiter is not None else ""
            ttft = _ratio([r.first - r.arrival for r in rs], SLO.ttft_s)
            tpot = _ratio([_tpot(r) for r in rs if r.tokens > 1], SLO.tpot_s)
            state = node.state.value
            style = {"healthy": "green", "degraded": "yellow", "probation": "cyan"}.get(state,
                                                                                      "red")
            table.add_row(node.id, self.gpu_of.get(node.id, "?"), Text(state, style=style),
                          f"{node.in_flight}{limit}", str(served.get(node.id, 0)), ttft, tpot)
        met = sum(1 for r in done if _meets(r))
        status = Text(f"attainment so far {met / len(done):.3f} of {len(done)} answered"
                      if done else "waiting for the first answers", style="bold")
        lines = [Text(f"  {t:5.1f} s  {node}: {state}  ({why})")
                 for t, node, state, why in self.events[-6:]]
        return Group(table, status, Text("events:" if lines else "events: none yet"), *lines)


def _ratio(values: list[float], slo: float) -> Text:
    if not values:
        return Text("-")
    r = float(np.percentile(values, 90)) / slo
    return Text(f"{r:.2f}", style="red" if r > 1.0 else "green")


async def one_run(label: str, policy: str, detect: bool, rate: float, duration_s: float,
                  faults: bool, console: Console, seed: int = 1) -> RunResult:
    nodes = _nodes()
    gpu_of = {n.id: n.gpu for n in nodes}
    events: list[tuple[float, str, str, str]] = []
    async with run_emulator(nodes, host="127.0.0.1") as emu:
        fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: {"policy": policy,
                              "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}}},
            "outliers": {"enabled": detect},
        })
        async with run_gateway(fleet, host="127.0.0.1", port=0) as gw:
            console.print(f"[bold]{label}[/bold]: gateway {gw.url}/v1, dashboard "
                          f"{gw.url}/dashboard, metrics {gw.url}/metrics")
            t0 = time.monotonic()

            def on_event(ev: Event) -> None:
                if ev.kind == "state":
                    events.append((time.monotonic() - t0, ev.node, ev.state, ev.reason))

            gw.fleet.event_listeners.append(on_event)
            gen = LoadGenerator(BenchConfig(
                gw.url, model=MODEL, rate=rate, duration_s=duration_s,
                input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
                slo=SLO, ignore_eos=True, drain_s=20.0, seed=seed, label=label))
            injector = asyncio.ensure_future(_faults(emu, duration_s, console)) if faults \
                else None
            view = LiveView(label, gw, gen, gpu_of, duration_s, events)
            try:
                if console.is_terminal:
                    with Live(view.render(), console=console, refresh_per_second=1,
                              transient=True) as live:
                        run = asyncio.ensure_future(gen.run())
                        while not run.done():
                            await asyncio.wait([run], timeout=1.0)
                            live.update(view.render())
                        run.result()
                else:
                    await gen.run()
            finally:
                if injector is not None:
                    injector.cancel()
    summary = summarize(gen.records, gen.cfg, gen.elapsed_s)
    by_class: dict[str, int] = {}
    for r in gen.records:
        if r.error == "ok":
            g = gpu_of.get(r.node, "?")
            by_class[g] = by_class.get(g, 0) + 1
    total = sum(by_class.values()) or 1
    shares = {g: by_class.get(g, 0) / total for g, _ in FLEET}
    result = RunResult(label, summary, shares, events)
    if faults:
        result.story = _story(label, gen.records, events, duration_s, detect)
    return result


async def _faults(emu: Any, duration_s: float, console: Console) -> None:
    """The throttle of a fast node, then the crash of an L4, at their moments."""
    start, end, factor = THROTTLE
    crash_at, crash_len = CRASH
    plan = sorted([
        (start * duration_s, STRAGGLER, {"kind": "throttle", "factor": factor,
                                         "duration_s": (end - start) * duration_s}),
        (crash_at * duration_s, CRASHED, {"kind": "crash", "duration_s": crash_len * duration_s}),
    ], key=lambda x: x[0])
    t0 = time.monotonic()
    for at, node, fault in plan:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        emu.server(node).inject(parse_fault(fault))
        what = (f"throttled to {fault['factor']:.0%} of its speed" if fault["kind"] == "throttle"
                else "crashed")
        console.log(f"fault: {node} {what} for {fault['duration_s']:.0f} s")


def _story(label: str, records: list[Record], events: list[tuple[float, str, str, str]],
           duration_s: float, detect: bool) -> str:
    """One sentence on the throttled node in this run."""
    start, end = THROTTLE[0] * duration_s, THROTTLE[1] * duration_s
    window = [r for r in records if start <= r.arrival < end and r.error == "ok"]
    mine = [r for r in window if r.node == STRAGGLER]
    share = len(mine) / len(window) if window else 0.0
    before = [r for r in records if r.arrival < start and r.error == "ok"]
    share_before = (sum(1 for r in before if r.node == STRAGGLER) / len(before)) if before \
        else 0.0
    tpots = [_tpot(r) for r in mine if r.tokens > 1]
    tpot_p99 = float(np.percentile(tpots, 99)) / SLO.tpot_s if tpots else 0.0
    flagged = [(t, s) for t, n, s, _ in events if n == STRAGGLER and t >= start]
    if flagged:
        first_t, first_state = flagged[0]
        worst = next((s for _, s in flagged if s == "quarantined"), first_state)
        detected = (f"was {first_state} {first_t - start:.1f} s after its throttle began"
                    + (f" and {worst} later" if worst != first_state else ""))
    else:
        detected = "was never flagged" if detect else "went unnoticed (no detector)"
    return (f"{label}: the throttled {STRAGGLER} {detected}; its share of requests went from "
            f"{share_before:.0%} to {share:.0%} while throttled"
            + (f", and their TPOT p99 was {tpot_p99:.1f}x the SLO" if tpots else "") + ".")


def comparison(runs: list[RunResult], rate: float) -> Table:
    table = Table(title=f"{rate:.1f} req/s offered; SLO TTFT {SLO.ttft_s:g} s, TPOT "
                        f"{SLO.tpot_s * 1000:.0f} ms", title_justify="left")
    table.add_column("")
    for r in runs:
        table.add_column(r.label, justify="right")

    def row(name: str, f: Any) -> None:
        table.add_row(name, *[f(r) for r in runs])

    row("SLO attainment", lambda r: f"{r.summary['slo_attainment']:.3f}")
    row("TTFT p99", lambda r: f"{r.summary['ttft_s']['p99']:.2f} s")
    row("TPOT p99", lambda r: f"{r.summary['tpot_s']['p99'] * 1000:.0f} ms")
    row("completed / failed", lambda r: f"{r.summary['completed']} / {r.summary['failed']}")
    for gpu, _ in FLEET:
        row(f"share {gpu}", lambda r, g=gpu: f"{r.shares.get(g, 0.0):.1%}")
    return table


async def run_demo(duration_s: float, load: float | None, console: Console, *,
                   baseline: str | None = "round_robin", faults: bool = True) -> list[RunResult]:
    # The capacity search takes a few seconds: say so rather than sit silent.
    with console.status("sizing the load from the fleet's SLO capacity bound (simulated)"):
        rate, full, strong = demo_rate(load)
    total = duration_s * (2 if baseline else 1)
    console.print(f"tailguard demo: {', '.join(f'{c} x {g}' for g, c in FLEET)} serving {MODEL} "
                  f"(emulated in real time); capacity bound {full:.1f} req/s, {strong:.1f} "
                  f"without the L4s; offering {rate:.1f} req/s for {duration_s:.0f} s per run "
                  f"(about {total + 30:.0f} s in all)")
    if faults:
        console.print(f"faults: {STRAGGLER} throttled to {THROTTLE[2]:.0%} from "
                      f"{THROTTLE[0] * duration_s:.0f} s to {THROTTLE[1] * duration_s:.0f} s; "
                      f"{CRASHED} crashes at {CRASH[0] * duration_s:.0f} s for "
                      f"{CRASH[1] * duration_s:.0f} s")
    runs = []
    if baseline:
        runs.append(await one_run(baseline, baseline, False, rate, duration_s, faults, console))
    runs.append(await one_run("tailguard", "tailguard", True, rate, duration_s, faults,
                              console))
    console.print(comparison(runs, rate))
    for r in runs:
        if r.story:
            console.print(r.story)
    return runs


def cmd_demo(args: argparse.Namespace) -> int:
    import logging

    from tailguard.adapters.runtime import loop_factory

    # The view shows states and faults; the request log (a 499 per request cut off
    # by Ctrl-C) and the monitor's lines would only scroll through it.
    for name in ("tailguard.request", "tailguard.adapters.monitor", "tailguard.gateway"):
        logging.getLogger(name).setLevel(logging.ERROR)
    console = Console()
    runner = asyncio.Runner(loop_factory=loop_factory)
    try:
        runner.run(run_demo(args.duration, args.load, console,
                            baseline=None if args.no_baseline else args.baseline,
                            faults=not args.no_faults))
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    finally:
        runner.close()
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="a mixed fleet with a straggler, behind a naive policy "
                                    "and behind tailguard")
    p.add_argument("--duration", type=float, default=36.0,
                   help="seconds of load per run (default 36)")
    p.add_argument("--load", type=float, default=None,
                   help="offered load as a fraction of the fleet's SLO capacity (default: just "
                        "above what the fleet serves without its weakest class)")
    p.add_argument("--baseline", default="round_robin", choices=BASELINES,
                   help="the naive policy of the first run (default round_robin)")
    p.add_argument("--no-baseline", action="store_true", help="only the tailguard run")
    p.add_argument("--no-faults", action="store_true", help="no throttle, no crash")
    p.set_defaults(func=cmd_demo)
