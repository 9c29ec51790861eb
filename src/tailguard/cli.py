"""Command line: ``tailguard demo | serve | emulate | bench | sim | capacity | gpus | models``.

Configuration errors exit with code 2 and one line naming the field; they never
print a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tailguard.errors import ConfigError

EXIT_CONFIG = 2


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def _sim_table(doc: dict[str, Any]) -> Table:
    slo = doc["slo"]
    bands = doc.get("capacity_bands")
    split = (" split by prompt tokens: " + ", ".join(
        f"{gpu} to {band['prompt_tokens'][1]}" for gpu, band in bands.items())) if bands else ""
    table = Table(title=f"{doc['scenario']}: capacity bound {doc['capacity_bound_rps']:.1f} req/s"
                        f"{split}, SLO ttft {slo['ttft_s']} s / tpot {slo['tpot_s']} s")
    for col in ("policy", "offered/s", "done", "failed", "TTFT p50", "TTFT p99", "TPOT p50",
                "TPOT p99", "E2E p99", "SLO att.", "goodput/s"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    has_goodput = any("max_goodput_rps" in r for r in doc["results"].values())
    has_shed = any("shed" in r for r in doc["results"].values())
    if has_shed:
        table.add_column("shed (429)", justify="right")
    if has_goodput:
        table.add_column("max goodput/s", justify="right")
    for name, r in doc["results"].items():
        row = [
            name, _fmt(r["offered_rps"], 1), str(r["completed"]), str(r["failed"]),
            _fmt(r["ttft_s"]["p50"]), _fmt(r["ttft_s"]["p99"]), _fmt(r["tpot_s"]["p50"]),
            _fmt(r["tpot_s"]["p99"]), _fmt(r["e2e_s"]["p99"], 2), _fmt(r["slo_attainment"], 4),
            _fmt(r["goodput_rps"], 2),
        ]
        if has_shed:
            row.append(str(r.get("shed", 0)))
        if has_goodput:
            row.append(_fmt(r.get("max_goodput_rps", 0.0), 2))
        table.add_row(*row)
    return table


def _per_gpu_table(doc: dict[str, Any]) -> Table:
    table = Table(title="per GPU class")
    for col in ("policy", "gpu", "nodes", "share", "util. of SLO cap.", "TTFT p99", "TPOT p99",
                "SLO att."):
        table.add_column(col, justify="left" if col in ("policy", "gpu") else "right")
    for name, r in doc["results"].items():
        for gpu, g in r["per_gpu"].items():
            table.add_row(name, gpu, str(g["nodes"]), _fmt(g["share"]), _fmt(g["utilization"], 2),
                          _fmt(g["ttft_p99_s"]), _fmt(g["tpot_p99_s"]), _fmt(g["slo_attainment"], 4))
    return table


def _prefix_table(doc: dict[str, Any]) -> Table | None:
    """Prefix-cache use per policy, for workloads with shared prefixes."""
    if not any("prefix" in r for r in doc["results"].values()):
        return None
    table = Table(title="prefix caches (prompt tokens the engines served from cache)")
    for col in ("policy", "hit rate", "requests hit", "prefill saved", "prefill done",
                "TTFT p99 cached", "TTFT p99 uncached"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in doc["results"].items():
        p = r.get("prefix")
        if p is None:
            continue
        table.add_row(name, _fmt(p["hit_rate"]), _fmt(p["requests_hit"]),
                      f"{p['prefill_tokens_saved']:,}", f"{p['prefill_tokens']:,}",
                      _fmt(p["ttft_cached_s"]["p99"]), _fmt(p["ttft_uncached_s"]["p99"]))
    return table


def _pd_table(doc: dict[str, Any]) -> Table | None:
    """Per-phase figures, for fleets whose nodes have prefill/decode roles."""
    if not any("disaggregation" in r for r in doc["results"].values()):
        return None
    table = Table(title="disaggregation (prompts computed on another node than their decode)")
    for col in ("policy", "remote", "prefill by GPU", "prefill leg p99", "KV transfer p50",
                "KV transfer p99", "TPOT p99 remote", "TPOT p99 local"):
        table.add_column(col, justify="left" if col in ("policy", "prefill by GPU") else "right")
    for name, r in doc["results"].items():
        p = r.get("disaggregation")
        if p is None:
            continue
        by_gpu = ", ".join(f"{g} {share:.2f}" for g, share in p["prefill_share_by_gpu"].items())
        table.add_row(name, _fmt(p["remote_share"]), by_gpu or "-",
                      _fmt(p["prefill_leg_s"]["p99"]), _fmt(p["kv_transfer_s"]["p50"], 4), _fmt(p["kv_transfer_s"]["p99"], 4),
                      _fmt(p["tpot_p99_s"]["remote"]), _fmt(p["tpot_p99_s"]["local"]))
    return table


def cmd_sim(args: argparse.Namespace) -> int:
    from tailguard.sim.run import RunOptions, simulate
    from tailguard.sim.scenario import load_scenario, parse_policies
    from tailguard.sim.sweep import parse_sweep, run_sweep

    scn = load_scenario(args.scenario)
    policies = parse_policies(args.policies, "--policies") if args.policies else None
    loads = parse_sweep(args.sweep) if args.sweep else None
    if loads and (args.load is not None or args.rate is not None):
        raise ConfigError("--sweep", "sets the loads itself; drop --load/--rate")
    records: dict[str, Any] | None = {} if args.report else None
    opts = RunOptions(rate=args.rate, load=args.load, duration_s=args.duration, seed=args.seed,
                      find_goodput=args.find_goodput, attainment=args.attainment)
    console = Console(stderr=True)
    quiet = args.quiet or not console.is_terminal
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[t]}"),
                  TimeElapsedColumn(), console=console, disable=quiet, transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(label: str, t: float, horizon: float) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=horizon, t="")
            bar.update(tasks[label], completed=min(t, horizon), t=f"{t:.0f}/{horizon:.0f} s")

        doc = simulate(scn, policies, opts, progress, records)
        if loads:
            doc["sweep"] = run_sweep(scn, loads, policies, opts, progress)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    out = Console() if Console().is_terminal else Console(width=160)
    for warning in doc.get("warnings", ()):
        console.print(f"[yellow]warning:[/yellow] {warning}")
    out.print(_sim_table(doc))
    out.print(_per_gpu_table(doc))
    for extra in (_prefix_table(doc), _pd_table(doc)):
        if extra is not None:
            out.print(extra)
    from tailguard.sim.stragglers import straggler_table

    strag = straggler_table(doc)
    if strag is not None:
        out.print(strag)
    if loads:
        out.print(_sweep_table(doc))
    if args.report:
        from tailguard.sim.report import write_scenario_report

        write_scenario_report(args.report, scn, opts, doc, records or {}, args.report_figures)
        out.print(f"report: {args.report}")
    return 0


def _sweep_table(doc: dict[str, Any]) -> Table:
    sweep = doc["sweep"]
    names = list(sweep[0]["results"]) if sweep else []
    table = Table(title="SLO attainment against load (--sweep)")
    for col in ("load", "offered/s", *names):
        table.add_column(col, justify="right")
    for p in sweep:
        table.add_row(f"{p['load']:g}", _fmt(p["offered_rps"], 1),
                      *(_fmt(p["results"][n]["slo_attainment"], 4) for n in names))
    return table


def cmd_capacity(args: argparse.Namespace) -> int:
    from tailguard.sim.capacity import misses_alone
    from tailguard.sim.fleet_bound import binding_slos, fleet_bound
    from tailguard.sim.scenario import load_scenario

    scn = load_scenario(args.scenario)
    console = Console(stderr=True)
    with Progress(TextColumn("capacity search"), BarColumn(), TextColumn("{task.fields[node]}"),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=args.quiet or not console.is_terminal) as bar:
        task = bar.add_task("capacity", total=len(scn.nodes()), node="")

        def step(done: int, total: int, node: str) -> None:
            bar.update(task, completed=done, node=f"{node} ({done}/{total})")

        fc = fleet_bound(scn, progress=step)
        binds = binding_slos(scn, fc)
    cap = fc.nodes
    plans = {p.id: p for p in scn.nodes()}
    split = fc.bands is not None
    title = "SLO capacity of each node" + (" on its band of the requests" if split else " alone")
    table = Table(title=f"{title} ({scn.model}, TTFT <= {scn.slo.ttft_s} s, TPOT <= "
                        f"{scn.slo.tpot_s} s, attainment {scn.slo.attainment})")
    cols = ["node", "gpu", "tp", "KV tokens", "capacity req/s",
            *(["prompt tokens", "share"] if split else []), "binds", "missed alone"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("node", "gpu", "binds") else "right")
    misses = {nid: misses_alone(scn, plans[nid]) for nid in cap}
    for nid, rps in cap.items():
        p = plans[nid]
        name = nid.split("#")[0]
        missed = ", ".join(f"{share:.1%} {why.upper()}" for why, share in
                           sorted(misses[nid].items(), key=lambda kv: -kv[1])) or "-"
        band = (fc.bands or {}).get(name)
        cells = [f"{band.prompt_min}-{band.prompt_max}", f"{band.share:.1%}"] if band else \
            (["-", "-"] if split else [])
        table.add_row(nid, p.perf.gpu.name, str(p.perf.tp), str(p.perf.kv_capacity_tokens),
                      f"{rps:.2f}", *cells, binds.get(name, "-").upper(), missed)
    table.add_row("fleet", "", "", "", f"{fc.bound:.2f}", *(["", ""] if split else []), "", "",
                  style="bold")
    out = Console() if Console().is_terminal else Console(width=160)
    out.print(table)
    if any(g.role != "both" for g in scn.fleet):
        out.print("Prefill/decode roles are not rated here: every node is rated serving both "
                  "phases (`tailguard sim --find-goodput` measures the fleet as it is).")
    allowed = 1.0 - scn.slo.attainment
    if split:
        lost = (f"; {fc.lost_share:.2%} of a larger draw, {fc.lost_work_s:.1f} s each on one "
                f"{fc.lost_class} node: they miss, and that class's rate counts the time they "
                "take it") if fc.lost_work_s else ""
        out.print("Some nodes cannot serve the whole mix (\"missed alone\"), so the fleet is "
                  "split: each class is rated on its band of the requests by prompt length, "
                  "its nodes pooled, and the fleet's bound is the rate at which every class "
                  f"carries its share ({fc.missed:.2%} of the requests no node serves{lost}).")
        if fc.missed > allowed:
            out.print(f"Those {fc.missed:.1%} are more than the {allowed:.1%} the attainment "
                      f"target allows: no rate reaches it on this fleet (at most "
                      f"{1.0 - fc.missed:.1%}), and the bound is the rate at which the rest "
                      "meet it.")
    else:
        blocked = sorted({plans[nid].perf.gpu.name for nid, m in misses.items()
                          if sum(m.values()) > allowed})
        if blocked:
            out.print(f"{', '.join(blocked)}: more than {allowed:.1%} of the requests miss "
                      "the SLO on such a node even alone (\"missed alone\"), so its capacity "
                      "is 0.")
    if args.json:
        doc: dict[str, Any] = {
            "scenario": scn.name, "capacity_bound_rps": fc.bound, "node_capacity_rps": cap,
            "node_missed_alone": misses, "binds": binds}
        if fc.bands:
            doc["capacity_bands"] = {name: {"prompt_tokens": [b.prompt_min, b.prompt_max],
                                            "share": b.share} for name, b in fc.bands.items()}
            doc["missed_by_all"] = fc.missed
            doc["missed_work"] = {"share": fc.lost_share, "class": fc.lost_class,
                                  "seconds_each": fc.lost_work_s}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from tailguard.core.replay import replay
    from tailguard.gateway.recording import read_decisions

    try:
        records = read_decisions(args.recording)
    except (OSError, ValueError) as exc:
        raise ConfigError("", f"cannot read recording {args.recording!r}: {exc}") from exc
    try:
        res = replay(records)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError("", f"{args.recording}: not a tailguard recording ({exc})") from exc
    print(f"{res.records} records, {res.decisions} decisions replayed, "
          f"{len(res.differences)} differ")
    for d in res.differences[: args.show]:
        print(f"  record {d['record']} ({d['op']} at t={d['t']}): recorded {d['recorded']!r}, "
              f"replayed {d['replayed']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"records": res.records,
                                               "decisions": res.decisions,
                                               "differences": res.differences}, indent=2) + "\n")
    return 0 if not res.differences else 1


def cmd_gpus(args: argparse.Namespace) -> int:
    from tailguard.core.hardware import DEFAULT_CATALOG

    table = Table(title="GPU catalog (dense BF16/FP16)")
    for col in ("name", "TFLOP/s", "GB/s", "GB", "TDP W", "$/h", "aliases"):
        table.add_column(col)
    for g in DEFAULT_CATALOG.gpus:
        table.add_row(g.name, f"{g.tflops:g}", f"{g.mem_bw_gbps:g}", f"{g.mem_gb:g}",
                      f"{g.tdp_w:g}", f"{g.price_per_hour:.2f}", ", ".join(g.aliases))
    Console().print(table)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tailguard.core.hardware import DEFAULT_CATALOG

    table = Table(title="model catalog")
    for col in ("name", "params", "layers", "hidden", "KV heads", "head dim", "bytes/w",
                "KV KiB/token"):
        table.add_column(col)
    for m in DEFAULT_CATALOG.models:
        table.add_row(m.name, f"{m.params / 1e9:.1f}B", str(m.layers), str(m.hidden),
                      str(m.kv_heads), str(m.head_dim), f"{m.bytes_per_weight:g}",
                      f"{m.kv_bytes_per_token / 1024:.0f}")
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sim", help="simulate a scenario with one or more routing policies")
    p.add_argument("scenario")
    p.add_argument("--policies", help="comma-separated policy names (default: the scenario's)")
    p.add_argument("--json", help="write the result document here")
    p.add_argument("--seed", type=int)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--load", type=float, help="offered load as a fraction of the capacity bound")
    g.add_argument("--rate", type=float, help="offered rate in requests/s")
    p.add_argument("--duration", type=float, help="seconds of arrivals")
    p.add_argument("--find-goodput", action="store_true",
                   help="also search the highest rate meeting the attainment target")
    p.add_argument("--attainment", type=float, help="target for --find-goodput (default 0.99)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report", metavar="HTML",
                   help="write an HTML report with figures (latency CDFs, load per node, "
                        "state timeline, the sweep)")
    p.add_argument("--report-figures", metavar="DIR", help="also save the figures as PNGs here")
    p.add_argument("--sweep", metavar="START:STOP:STEP",
                   help="also run every policy at these loads, e.g. 0.5:1.2:0.1")
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("capacity", help="each node's SLO capacity and the fleet's bound")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("scenario")
    p.add_argument("--json")
    p.set_defaults(func=cmd_capacity)

    # Commands that live with their subsystem: each module has add_parser(sub).
    from tailguard import demo
    from tailguard.bench import cli as bench_cli
    from tailguard.emulator import cli as emulator_cli
    from tailguard.epp import cli as epp_cli
    from tailguard.gateway import cli as gateway_cli
    from tailguard.planner import cli as planner_cli

    for mod in (gateway_cli, epp_cli, emulator_cli, bench_cli, demo, planner_cli):
        mod.add_parser(sub)

    p = sub.add_parser("replay", help="replay a `serve --record` file into a fresh balancer "
                                      "and report every decision that differs")
    p.add_argument("recording")
    p.add_argument("--show", type=int, default=20, help="differences to print (default 20)")
    p.add_argument("--json", help="write the differences here")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("schema", help="print the JSON Schema of a fleet file or a scenario "
                                      "(for editors: yaml-language-server, VS Code)")
    p.add_argument("format", choices=sorted(SCHEMAS))
    p.add_argument("-o", "--output", help="write it here instead of to stdout")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("gpus", help="list the GPU catalog")
    p.set_defaults(func=cmd_gpus)
    p = sub.add_parser("models", help="list the model catalog")
    p.set_defaults(func=cmd_models)
    return parser


SCHEMAS = ("fleet", "scenario")


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of a file format: ``fleet`` or ``scenario``."""
    from tailguard.config.fleet import FleetFile
    from tailguard.config.parse import json_schema
    from tailguard.sim.scenario import ScenarioFile

    body = json_schema(FleetFile if name == "fleet" else ScenarioFile)
    body.pop("title", None)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"tailguard {name} file", **body}


def cmd_schema(args: argparse.Namespace) -> int:
    text = json.dumps(schema(args.format), indent=2, sort_keys=False) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as exc:
        print(f"tailguard: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
