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
import functools
import time
from collections.abc import Callable
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


def _meets(r: Record, slo: Slo = SLO) -> bool:
    return r.error == "ok" and r.first - r.arrival <= slo.ttft_s and _tpot(r) <= slo.tpot_s


class LiveView:
    """The terminal view of a run in progress (rebuilt once a second)."""

    def __init__(self, label: str, gw: RunningGateway, gen: LoadGenerator,
                 gpu_of: dict[str, str], duration_s: float,
                 events: list[tuple[float, str, str, str]], slo: Slo = SLO) -> None:
        self.slo = slo
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
            ttft = _ratio([r.first - r.arrival for r in rs], self.slo.ttft_s)
            tpot = _ratio([_tpot(r) for r in rs if r.tokens > 1], self.slo.tpot_s)
            state = node.state.value
            style = {"healthy": "green", "degraded": "yellow", "probation": "cyan"}.get(state,
                                                                                      "red")
            table.add_row(node.id, self.gpu_of.get(node.id, "?"), Text(state, style=style),
                          f"{node.in_flight}{limit}", str(served.get(node.id, 0)), ttft, tpot)
        met = sum(1 for r in done if _meets(r, self.slo))
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
                await _watched(gen, view, console)
            finally:
                if injector is not None:
                    injector.cancel()
    summary = summarize(gen.records, gen.cfg, gen.elapsed_s)
    shares = _class_shares(gen.records, gpu_of, [g for g, _ in FLEET])
    result = RunResult(label, summary, shares, events)
    if faults:
        result.story = _story(label, gen.records, events, duration_s, detect)
    return result


def _class_shares(records: list[Record], gpu_of: dict[str, str],
                  classes: list[str]) -> dict[str, float]:
    """Each GPU class's share of the answers completed."""
    counts = dict.fromkeys(classes, 0)
    for r in records:
        if r.error == "ok":
            g = gpu_of.get(r.node, "?")
            counts[g] = counts.get(g, 0) + 1
    total = sum(counts.values()) or 1
    return {g: n / total for g, n in counts.items()}


def _share(gpu: str, r: RunResult) -> str:
    return f"{r.shares.get(gpu, 0.0):.1%}"


async def _watched(gen: LoadGenerator, view: LiveView, console: Console) -> None:
    """Run the load, with the live view refreshed every second in a terminal."""
    if not console.is_terminal:
        await gen.run()
        return
    with Live(view.render(), console=console, refresh_per_second=1, transient=True) as live:
        run = asyncio.ensure_future(gen.run())
        while not run.done():
            await asyncio.wait([run], timeout=1.0)
            live.update(view.render())
        run.result()


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


def _side_by_side(runs: list[RunResult], rate: float,
                  slo: Slo) -> tuple[Table, Callable[[str, Callable[[RunResult], str]], None]]:
    """A table with a column per run, and the function that adds a row to it."""
    table = Table(title=f"{rate:.1f} req/s offered; SLO TTFT {slo.ttft_s:g} s, TPOT "
                        f"{slo.tpot_s * 1000:.0f} ms", title_justify="left")
    table.add_column("")
    for r in runs:
        table.add_column(r.label, justify="right")

    def row(name: str, f: Callable[[RunResult], str]) -> None:
        table.add_row(name, *[f(r) for r in runs])

    return table, row


def comparison(runs: list[RunResult], rate: float) -> Table:
    table, row = _side_by_side(runs, rate, SLO)
    row("SLO attainment", lambda r: f"{r.summary['slo_attainment']:.3f}")
    row("TTFT p99", lambda r: f"{r.summary['ttft_s']['p99']:.2f} s")
    row("TPOT p99", lambda r: f"{r.summary['tpot_s']['p99'] * 1000:.0f} ms")
    row("completed / failed", lambda r: f"{r.summary['completed']} / {r.summary['failed']}")
    for gpu, _ in FLEET:
        row(f"share {gpu}", functools.partial(_share, gpu))
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


# ``--pd``: long prompts on a fleet that can split them, co-located and disaggregated.
PD_FLEET = (("h100-0", "H100-SXM", "prefill"), ("l40s-0", "L40S", "prefill"),
            ("l40s-1", "L40S", "prefill"), ("a100-0", "A100-80GB", "decode"),
            ("a100-1", "A100-80GB", "decode"), ("a100-2", "A100-80GB", "decode"))
PD_INPUT = {"dist": "lognormal", "mu": 8.5, "sigma": 0.6, "min": 256, "max": 24000}  # ~6k
PD_OUTPUT = {"dist": "fixed", "value": 64}
PD_SLO = Slo(ttft_s=3.0, tpot_s=0.1)
PD_CLASSES = list(dict.fromkeys(gpu for _, gpu, _ in PD_FLEET))


async def pd_run(label: str, roles: bool, rate: float, duration_s: float,
                 console: Console, seed: int = 1) -> RunResult:
    """The P/D fleet behind tailguard, its nodes' roles given (or all ``both``)."""
    nodes = [EmulatedNode(nid, gpu, models=(MODEL,)) for nid, gpu, _ in PD_FLEET]
    gpu_of = {n.id: n.gpu for n in nodes}
    async with run_emulator(nodes, host="127.0.0.1") as emu:
        fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": nid, "url": emu.urls[nid], "gpu": gpu, "models": [MODEL],
                       "role": role if roles else "both"} for nid, gpu, role in PD_FLEET],
            "pools": {MODEL: {"policy": "tailguard",
                              "slo": {"ttft_s": PD_SLO.ttft_s, "tpot_s": PD_SLO.tpot_s}}},
        })
        async with run_gateway(fleet, host="127.0.0.1", port=0) as gw:
            console.print(f"[bold]{label}[/bold]: gateway {gw.url}/v1, dashboard "
                          f"{gw.url}/dashboard")
            gen = LoadGenerator(BenchConfig(
                gw.url, model=MODEL, rate=rate, duration_s=duration_s,
                input_tokens=parse_length_dist(PD_INPUT, "input_tokens", "input_tokens"),
                output_tokens=parse_length_dist(PD_OUTPUT, "output_tokens", "output_tokens"),
                slo=PD_SLO, ignore_eos=True, drain_s=20.0, seed=seed, label=label))
            await _watched(gen, LiveView(label, gw, gen, gpu_of, duration_s, [], PD_SLO),
                           console)
    summary = summarize(gen.records, gen.cfg, gen.elapsed_s)
    return RunResult(label, summary, _class_shares(gen.records, gpu_of, PD_CLASSES))


async def run_pd_demo(duration_s: float, rate: float, console: Console) -> list[RunResult]:
    """The same long-prompt load on the same fleet, co-located, then disaggregated."""
    console.print(f"tailguard demo --pd: {', '.join(f'{n} ({r})' for n, _, r in PD_FLEET)} "
                  f"serving {MODEL} (emulated in real time); long prompts (lognormal, mean "
                  f"about 6k tokens), 64-token answers; {rate:g} req/s for {duration_s:.0f} s "
                  "per run, first with every node doing both phases, then with the roles")
    runs = [await pd_run("co-located", False, rate, duration_s, console),
            await pd_run("disaggregated", True, rate, duration_s, console)]
    table, row = _side_by_side(runs, rate, PD_SLO)

    def legs(r: RunResult, key: str) -> str:
        pd = r.summary.get("disaggregated")
        return "-" if pd is None else key.format(**pd, p50=pd["prefill_leg_s"]["p50"])

    row("SLO attainment", lambda r: f"{r.summary['slo_attainment']:.3f}")
    row("TTFT p50 / p99", lambda r: f"{r.summary['ttft_s']['p50']:.2f} / "
                                    f"{r.summary['ttft_s']['p99']:.2f} s")
    row("TPOT p50 / p99", lambda r: f"{r.summary['tpot_s']['p50'] * 1000:.0f} / "
                                    f"{r.summary['tpot_s']['p99'] * 1000:.0f} ms")
    row("completed / failed", lambda r: f"{r.summary['completed']} / {r.summary['failed']}")
    row("prompts computed remotely", lambda r: legs(r, "{remote_share:.1%}"))
    row("prefill leg p50", lambda r: legs(r, "{p50:.2f} s"))
    for gpu in PD_CLASSES:
        row(f"answers from {gpu}", functools.partial(_share, gpu))
    console.print(table)
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
        if args.pd:
            runner.run(run_pd_demo(args.duration, args.rate, console))
        else:
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
    p.add_argument("--pd", action="store_true",
                   help="instead: long prompts on a fleet with prefill and decode nodes, "
                        "served co-located and disaggregated side by side")
    p.add_argument("--rate", type=float, default=4.0,
                   help="with --pd: requests/s offered (default 4)")
    p.set_defaults(func=cmd_demo)
