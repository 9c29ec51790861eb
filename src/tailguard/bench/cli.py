"""``tailguard bench``: offer load to an OpenAI-compatible endpoint and report latency and SLOs.

Exit codes: 0 when the run completed (whatever the servers answered), 1 when
the target could not be reached at all, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tailguard.bench.loadgen import BenchConfig, Progress, run_bench
from tailguard.config.files import read_yaml
from tailguard.core.policies import Slo
from tailguard.errors import ConfigError
from tailguard.traffic.length_args import parse_length_arg
from tailguard.traffic.workload import Requests, generate, parse_workload


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (gateway or engine)",
                       description=__doc__)
    p.add_argument("--target", required=True,
                   help="base URL, e.g. http://127.0.0.1:8080; several, comma-separated, take "
                        "the requests in turn (gateway replicas behind a Service)")
    p.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    g.add_argument("--concurrency", type=int, help="closed loop: this many clients back to back")
    g.add_argument("--workload", metavar="FILE",
                   help="a simulator workload (YAML: a workload: section, or a scenario "
                        "holding one) with an arrival rate or a trace: its requests at their "
                        "times, shared prefixes as shared text (sessions, Mooncake traces); "
                        "its duration_s replaces --duration")
    g.add_argument("--trace", metavar="FILE",
                   help="replay a trace at its times: tailguard's or Mooncake's JSONL, a "
                        "gateway recording, or the Azure or BurstGPT CSV (--duration seconds "
                        "of it, from --trace-start)")
    p.add_argument("--trace-start", type=float, default=0.0, metavar="S",
                   help="with --trace: start this many seconds into it (default 0)")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="with --trace: replay it this many times faster (default 1)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (default 30)")
    p.add_argument("--input-tokens", default="200", metavar="DIST",
                   help="prompt lengths: 200, fixed:200, uniform:10,100, lognormal:6.6,1.0, "
                        "azure-conv, azure-code (default 200)")
    p.add_argument("--output-tokens", default="200", metavar="DIST",
                   help="answer lengths (max_tokens), same forms (default 200)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO in seconds (default 0.1)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream responses (default) or not")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--api-key", default=os.environ.get("TAILGUARD_API_KEY"),
                   help="bearer token (default: $TAILGUARD_API_KEY)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask vLLM-style engines for exactly max_tokens tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-requests", type=int, help="stop sending after this many requests")
    p.add_argument("--drain", type=float, default=60.0,
                   help="seconds to let requests finish after the last arrival (default 60)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (default 600)")
    p.add_argument("--json", help="write the result document here (tailguard sim's shape)")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.set_defaults(func=cmd_bench)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    for target in args.target.split(","):
        parts = urlsplit(target.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("--target", f"must be an http(s) URL (or several, comma-separated: "
                                          f"requests go to them in turn), got {target!r}")
    for flag, value in (("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot),
                        ("--drain", args.drain), ("--timeout", args.timeout)):
        if not value > 0:
            raise ConfigError(flag, f"must be > 0, got {value}")
    if args.max_requests is not None and args.max_requests < 1:
        raise ConfigError("--max-requests", "must be >= 1")
    workload = None
    duration = args.duration
    if getattr(args, "workload", None):
        workload, duration = load_bench_workload(args.workload, args.seed)
    elif getattr(args, "trace", None):
        workload = trace_workload(args.trace, args.trace_start, args.speedup, duration,
                                  args.seed)
    try:
        return BenchConfig(
            target=args.target, model=args.model, rate=args.rate, concurrency=args.concurrency,
            duration_s=duration, workload=workload,
            input_tokens=parse_length_arg(args.input_tokens, "--input-tokens", "input_tokens"),
            output_tokens=parse_length_arg(args.output_tokens, "--output-tokens", "output_tokens"),
            slo=Slo(args.slo_ttft, args.slo_tpot), stream=args.stream, endpoint=args.endpoint,
            api_key=args.api_key, ignore_eos=args.ignore_eos, seed=args.seed,
            max_requests=args.max_requests, drain_s=args.drain, timeout_s=args.timeout)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        flag = "--rate" if args.rate is not None else "--concurrency"
        if "duration" in str(exc):
            flag = "--duration"
        raise ConfigError(flag, str(exc)) from exc


def load_bench_workload(path: str, seed: int) -> tuple[Requests, float]:
    """The requests of a workload file, and its duration (see ``--workload``)."""
    file = Path(path)
    raw = read_yaml(file, "--workload")
    section = raw.get("workload", raw) if isinstance(raw, dict) else raw
    spec = parse_workload(section, "workload", file.parent)
    if spec.arrival.load is not None:
        raise ConfigError("workload.arrival.load", "a benchmark knows no fleet capacity: give "
                                                   "a rate (requests/s; a trace: or time_scale)")
    return generate(spec, None, random.Random(f"{seed}:workload")), spec.duration_s


def trace_workload(path: str, start_s: float, speedup: float, duration_s: float,
                   seed: int) -> Requests:
    """``--trace``: the trace's requests in ``[start_s, start_s + duration_s)`` of its
    own time, replayed ``speedup`` times faster (the same rules as a workload's)."""
    for flag, value, low in (("--trace-start", start_s, 0.0), ("--speedup", speedup, 0.0)):
        if not value >= low or (flag == "--speedup" and value == 0.0):
            raise ConfigError(flag, f"must be {'> 0' if flag == '--speedup' else '>= 0'}, "
                                    f"got {value}")
    spec = parse_workload({"duration_s": duration_s,
                           "arrival": {"process": "trace", "path": str(Path(path).resolve()),
                                       "start_s": start_s, "speedup": speedup}},
                          "--trace", None)
    requests = generate(spec, None, random.Random(f"{seed}:workload"))
    if not len(requests):
        raise ConfigError("--trace", f"{path}: no request in the {duration_s:g} s from "
                                     f"{start_s:g} s")
    return requests


def _f(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def result_tables(doc: dict[str, Any]) -> list[Table]:
    tables = []
    for label, r in doc["results"].items():
        t = Table(title=f"{label}: {doc['target']} ({doc['model']}), SLO ttft "
                        f"{doc['slo']['ttft_s']} s / tpot {doc['slo']['tpot_s']} s")
        for c in ("offered/s", "sent", "done", "failed", "429", "req/s", "tok/s", "SLO att.",
                  "goodput/s"):
            t.add_column(c, justify="right")
        t.add_row(_f(r["offered_rps"], 1), str(r["requests"]), str(r["completed"]),
                  str(r["failed"]), str(r["rejected"]), _f(r["throughput_rps"], 2),
                  _f(r["output_tokens_per_s"], 0), _f(r["slo_attainment"], 4),
                  _f(r["goodput_rps"], 2))
        tables.append(t)
        lat = Table(title="latency (s)")
        lat.add_column("")
        for c in ("mean", "p50", "p90", "p99", "max"):
            lat.add_column(c, justify="right")
        for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E", "e2e_s")):
            lat.add_row(name, *(_f(r[key][q], 4) for q in ("mean", "p50", "p90", "p99", "max")))
        tables.append(lat)
        nodes = Table(title="per node (x-tailguard-node)")
        for c in ("node", "sent", "share", "done", "TTFT p50", "TTFT p99", "TPOT p50",
                  "TPOT p99", "SLO att."):
            nodes.add_column(c, justify="left" if c == "node" else "right")
        for node, s in r["per_node"].items():
            nodes.add_row(node, str(s["requests"]), _f(s["share"]), str(s["completed"]),
                          _f(s["ttft_p50_s"]), _f(s["ttft_p99_s"]), _f(s["tpot_p50_s"]),
                          _f(s["tpot_p99_s"]), _f(s["slo_attainment"], 4))
        tables.append(nodes)
        pd = r.get("disaggregated")
        if pd is not None:
            legs = Table(title=f"disaggregated: {100 * pd['remote_share']:.1f}% of the answers "
                               "had their prompt computed on another node (s)")
            legs.add_column("")
            for c in ("mean", "p50", "p90", "p99", "max"):
                legs.add_column(c, justify="right")
            for name, key in (("prefill leg", "prefill_leg_s"),
                              ("then first token", "after_prefill_s")):
                legs.add_row(name, *(_f(pd[key][q], 4) for q in ("mean", "p50", "p90", "p99",
                                                                   "max")))
            tables.append(legs)
        if r["errors"]:
            errs = Table(title="errors by kind")
            errs.add_column("kind")
            errs.add_column("count", justify="right")
            for kind, count in r["errors"].items():
                errs.add_row(kind, str(count))
            tables.append(errs)
    return tables


async def _run(cfg: BenchConfig, quiet: bool) -> dict[str, Any]:
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return await run_bench(cfg)
    with RichProgress(TextColumn("bench"), BarColumn(), TextColumn("{task.fields[line]}"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("bench", total=cfg.duration_s, line="")

        def show(p: Progress) -> None:
            bar.update(task, completed=min(p.elapsed_s, p.duration_s), line=(
                f"sent {p.sent}  done {p.completed}  failed {p.failed}  429 {p.rejected}  "
                f"in flight {p.in_flight}  tok/s {p.tokens / max(p.elapsed_s, 1e-9):.0f}"))

        return await run_bench(cfg, show)


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - no uvloop on Windows
        runner = asyncio.run
    try:
        doc = runner(_run(cfg, args.quiet))
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        print(f"tailguard: bench: cannot use {cfg.target}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    out = Console()
    for table in result_tables(doc):
        out.print(table)
    return 0
