"""``tailguard plan --inventory``: replicas, engine flags, fleet file and $ per token."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any

import yaml

from tailguard.config.files import read_yaml
from tailguard.core.hardware import DEFAULT_CATALOG, GPU
from tailguard.core.policies import Slo
from tailguard.errors import ConfigError
from tailguard.planner.formation import (
    Formation,
    Rated,
    Rater,
    Replica,
    plan_formation,
    usd_per_million_tokens,
)
from tailguard.planner.inventory import Inventory, exclude, parse_inventory
from tailguard.planner.naive import one_per_gpu, tp_across_types
from tailguard.planner.roles import (
    RoleChoice,
    candidates,
    choose_roles,
    chosen_part,
    is_split,
    measure,
    naive_splits,
    whole_inventory,
)
from tailguard.planner.verify import (
    attainment_at,
    base_scenario,
    measured_goodput,
    plan_for_demand,
)
from tailguard.sim.scenario import load_scenario

BASE_PORT = 8000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inventory", help="GPUs per host, links and prices (YAML; see "
                                       "docs/planner.md): form replicas from them")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="with --inventory: share of requests within both SLOs that "
                        "defines SLO goodput (default 0.9)")
    p.add_argument("--objective", choices=["per-dollar", "goodput"], default="per-dollar",
                   help="with --inventory: per-dollar (default) keeps only the shapes of "
                        "the best SLO goodput per dollar; goodput uses every GPU that adds "
                        "SLO goodput (GPUs already paid for)")
    p.add_argument("--rate", type=float, help="with --inventory: the workload's req/s; the "
                   "cheapest formation that carries it (default: as much as the inventory can)")
    p.add_argument("--budget", type=float, help="with --inventory: $/h to spend; GPUs beyond it "
                   "are dropped, and what is left buys more of the best goodput per dollar")
    p.add_argument("--lengths", choices=["azure-conv", "azure-code"], default="azure-conv",
                   help="with --inventory: prompt and answer length distributions the "
                        "replicas are rated under (default azure-conv)")
    p.add_argument("--scenario", help="with --inventory: take the lengths from this "
                                      "scenario's workload instead")
    p.add_argument("--verify", action="store_true",
                   help="with --inventory: measure the formation's SLO goodput behind "
                        "tailguard in the simulator, beside two naive formations")
    p.add_argument("--roles", choices=["both", "auto"], default="both",
                   help="with --inventory: auto measures prefill/decode splits of the "
                        "formation's replicas in the simulator and keeps the best "
                        "(docs/planner.md); both (default) serves both phases everywhere")
    p.add_argument("--fleet-out", help="with --inventory: write the fleet file here")
    p.add_argument("--exclude", help="with --inventory: GPUs to form around, HOST:INDEX[,...] "
                                     "(a straggling or failed GPU a detector event named)")


def _positive(args: argparse.Namespace, name: str) -> None:
    value = getattr(args, name)
    if value is not None and not value > 0:
        raise ConfigError("--" + name.replace("_", "-"), f"must be > 0, got {value}")


def cmd_inventory(args: argparse.Namespace) -> int:
    for name in ("rate", "budget"):
        _positive(args, name)
    if not 0 < args.attainment <= 1:
        raise ConfigError("--attainment", f"must be in (0, 1], got {args.attainment}")
    inv = parse_inventory(read_yaml(args.inventory, "inventory"))
    if args.exclude:
        inv = exclude(inv, args.exclude)
    model = DEFAULT_CATALOG.model(args.model, "--model")
    slo = Slo(args.slo_ttft, args.slo_tpot, args.attainment)
    lengths: tuple[Any, Any] = ({"dist": args.lengths}, {"dist": args.lengths})
    base = base_scenario(model.name, slo, inv.catalog(), *lengths)
    if args.scenario:
        w = load_scenario(args.scenario).workload
        base = replace(base, workload=replace(base.workload, input_tokens=w.input_tokens,
                                              output_tokens=w.output_tokens))
    dists = base.workload.input_tokens, base.workload.output_tokens
    if dists[0] is None or dists[1] is None:
        raise ConfigError("--scenario", "its workload must give length distributions, "
                                        "not a trace")
    args.input_tokens = args.input_tokens or dists[0].mean()
    args.output_tokens = args.output_tokens or dists[1].mean()
    # Under a budget, GPUs may be bought: shapes pool as in a fleet of any size.
    rater = Rater(base, model, args.input_tokens, args.output_tokens,
                  None if args.budget else inv.gpu_counts())
    progress = sys.stderr if sys.stderr.isatty() else None
    if progress:
        print("rating replica shapes in the simulator ...", file=progress, flush=True)
    measured: dict[str, float] = {}
    if args.rate:
        plan, measured["planned"] = plan_for_demand(inv, rater, args.rate, base, args.attainment,
                                                    args.budget, args.objective)
    else:
        plan = plan_formation(inv, rater, args.budget, None, args.objective)
    tried: list[RoleChoice] = []
    chosen: RoleChoice | None = None
    colocated: RoleChoice | None = None
    roles: tuple[str, ...] | None = None
    colocated_plan = plan
    if args.roles == "auto" and plan.replicas:
        if args.rate or args.budget:
            raise ConfigError("--roles", "auto plans the inventory as it is: leave out "
                              "--rate and --budget")
        if progress:
            print("measuring prefill/decode splits ...", file=progress, flush=True)
        full = whole_inventory(inv, rater)
        colocated = RoleChoice("co-located plan", (), measured_goodput(plan, base,
                                                                       args.attainment),
                               plan.cost_per_hour)
        measured["co-located plan"] = colocated.goodput_rps
        tried = measure(full, base, candidates(full), args.attainment)
        chosen = choose_roles(tried, colocated, args.objective)
        if chosen is not None:
            part, roles = chosen_part(full, chosen)
            used = {h.name: 0 for h in inv.hosts}
            for r in part.replicas:
                used[r.hosts[0]] += r.rated.shape.gpus
            plan = Formation("planned", part.replicas,
                             {h.name: h.count - used[h.name] for h in inv.hosts
                              if h.count > used[h.name]}, plan.skipped, plan.rated)
            measured["planned"] = chosen.goodput_rps
    fleet = fleet_file(plan, inv, model.name, slo)
    if args.fleet_out:
        with open(args.fleet_out, "w", encoding="utf-8") as out:
            yaml.safe_dump(fleet, out, sort_keys=False)
    checks: dict[str, dict[str, float]] = {}
    if args.verify:
        formations = [plan, one_per_gpu(inv, rater), tp_across_types(inv, rater, model)]
        if chosen is not None:
            formations.insert(1, replace(colocated_plan, name="co-located plan"))
        for f in formations:
            if progress:
                print(f"measuring {f.name} ...", file=progress, flush=True)
            g = measured.get(f.name)
            f_roles = roles if f is plan else None
            if g is None:
                g = measured_goodput(f, base, args.attainment, f_roles)
            checks[f.name] = _check(f, g)
            if args.rate:  # and how it serves the demand itself
                checks[f.name]["attainment_at_rate"] = round(
                    attainment_at(f, base, args.rate, f_roles), 4)
        if chosen is not None and is_split(chosen):
            # Against the best co-located choice measured, and the splits an
            # operator would try first.
            full = whole_inventory(inv, rater)
            together = max((c for c in tried if not is_split(c)), key=lambda c: c.ratio)
            checks[f"best co-located ({together.name[len('co-located: '):]})"] = _check(
                chosen_part(full, together)[0], together.goodput_rps)
            for split in measure(full, base, naive_splits(full), args.attainment):
                checks[split.name] = _check(chosen_part(full, split)[0], split.goodput_rps)
    if args.format == "json":
        doc = _json(plan, inv, args, fleet, checks)
        if tried:
            doc["roles"] = {
                "chosen": chosen.name if chosen is not None else "co-located plan",
                "replicas": list(roles) if roles is not None else None,
                "co_located_plan_goodput_rps": round(measured["co-located plan"], 3),
                "measured": {c.name: {"goodput_rps": round(c.goodput_rps, 3),
                                      "cost_per_hour": round(c.cost_per_hour, 2)}
                             for c in tried}}
        if "planned" in measured:
            doc["fleet"]["measured_goodput_rps"] = round(measured["planned"], 3)
        print(json.dumps(doc, indent=1))
    elif args.format == "fleet":
        print(yaml.safe_dump(fleet, sort_keys=False), end="")
    else:
        _table(plan, inv, args, checks, measured.get("planned"), roles, tried, chosen,
               colocated)
    return 0


def _check(f: Formation, goodput: float) -> dict[str, float]:
    """A formation's measured goodput, cost and their ratio, as --verify reports them."""
    return {"goodput_rps": round(goodput, 3), "cost_per_hour": round(f.cost_per_hour, 2),
            "rps_per_dollar_hour": round(goodput / f.cost_per_hour, 4)
            if f.cost_per_hour > 0 else 0.0, "gpus": f.gpus,
            "rated_rps_per_dollar_hour": round(f.rated_ratio, 4)}


def engine_flags(r: Replica, model: str) -> str:
    shape, plan = r.rated.shape, r.rated.plan
    st = shape.stages
    flags = (f"vllm serve {model} --tensor-parallel-size {st[0].tp}")
    env = ""
    if r.devices and len(set(r.hosts)) == 1 and not r.added:  # one host: every stage's GPUs
        env = f"CUDA_VISIBLE_DEVICES={','.join(str(i) for d in r.devices for i in d)} "
    if shape.pipelined:
        layers = getattr(r.rated.perf, "layers", ())
        flags += f" --pipeline-parallel-size {len(st)}"
        env += f"VLLM_PP_LAYER_PARTITION={','.join(str(n) for n in layers)} "
    cap = (f" --long-prefill-token-threshold {plan.long_prefill_token_threshold}"
           if plan.long_prefill_token_threshold else "")
    return (f"{env}{flags} --max-num-seqs {plan.max_num_seqs} --max-num-batched-tokens "
            f"{plan.max_num_batched_tokens} --enable-chunked-prefill{cap}")


def fleet_file(plan: Formation, inv: Inventory, model: str, slo: Slo) -> dict[str, Any]:
    """The ``tailguard serve`` fleet file of a formation (URLs on each first host)."""
    variants: dict[str, GPU] = {}
    catalog_name = {h.gpu.name: h.catalog_gpu for h in inv.hosts}
    ports: dict[str, int] = {}
    nodes = []
    for r in plan.replicas:
        shape = r.rated.shape
        host = r.hosts[0]
        port = ports.get(host, BASE_PORT)
        ports[host] = port + 1
        node: dict[str, Any] = {"id": f"{host}-{port - BASE_PORT}" if not r.added else host,
                                "url": f"http://{host}:{port}"}
        for st in shape.stages:
            if catalog_name.get(st.gpu.name, st.gpu.name) != st.gpu.name:
                variants[st.gpu.name] = st.gpu
        if shape.pipelined:
            node["stages"] = [{"gpu": s.gpu.name, "tp": s.tp} for s in shape.stages]
            node["split"] = list(getattr(r.rated.perf, "layers", ()))
            node["link_gbps"] = shape.link_gbps
        else:
            node["gpu"] = shape.stages[0].gpu.name
            if shape.stages[0].tp > 1:
                node["tp"] = shape.stages[0].tp
        node["models"] = [model]
        node["max_num_seqs"] = r.rated.plan.max_num_seqs
        nodes.append(node)
    doc: dict[str, Any] = {"listen": "0.0.0.0:8080", "nodes": nodes,
                           "pools": {model: {"policy": "tailguard",
                                             "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                                             "limits": {"kind": "gradient"}}}}
    if variants:
        doc["catalog"] = {"gpus": [{k: v for k, v in asdict(g).items() if k != "aliases"}
                                   for g in variants.values()]}
    return doc


def _dropped(plan: Formation) -> list[str]:
    """GPU types with SLO capacity that the formation left out, at their best shape."""
    used = {st.gpu for r in plan.replicas for st in r.rated.shape.stages}
    best_of: dict[GPU, Rated] = {}
    for r in plan.rated:
        gpu = r.shape.stages[0].gpu
        if r.capacity_rps > 0 and gpu not in used and (
                gpu not in best_of or r.ratio > best_of[gpu].ratio):
            best_of[gpu] = r
    best = max((r.ratio for r in plan.rated), default=0.0)
    return [f"{r.shape.name}: {r.ratio:.3f} req/s per $/h at best (the best shape: {best:.3f}); "
            "--objective goodput or --rate uses it"
            for r in sorted(best_of.values(), key=lambda r: -r.ratio)]


def _classes(plan: Formation) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    total = plan.goodput_rps
    for r in plan.replicas:
        c = out.setdefault(r.rated.shape.name, {"replicas": 0, "gpus": 0, "goodput_rps": 0.0,
                                                "cost_per_hour": 0.0})
        c["replicas"] += 1
        c["gpus"] += r.rated.shape.gpus
        c["goodput_rps"] += r.rated.capacity_rps
        c["cost_per_hour"] += r.rated.shape.cost_per_hour
    for c in out.values():
        c["share"] = c["goodput_rps"] / total if total > 0 else 0.0
    return out


def _json(plan: Formation, inv: Inventory, args: argparse.Namespace, fleet: dict[str, Any],
          checks: dict[str, dict[str, float]]) -> dict[str, Any]:
    out_tokens = args.output_tokens
    classes = _classes(plan)
    for c in classes.values():
        c["usd_per_m_output_tokens"] = usd_per_million_tokens(c["cost_per_hour"],
                                                              c["goodput_rps"], out_tokens)
    return {
        "model": args.model, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot,
                                     "attainment": args.attainment},
        "replicas": [{"shape": r.rated.shape.name, "hosts": list(r.hosts), "added": r.added,
                      "gpus": r.rated.shape.gpus, "slo_capacity_rps": r.rated.capacity_rps,
                      "cost_per_hour": r.rated.shape.cost_per_hour,
                      "flags": engine_flags(r, args.model)} for r in plan.replicas],
        "classes": classes,
        "shapes": [{"shape": r.shape.name, "gpus": r.shape.gpus,
                    "slo_capacity_rps": r.capacity_rps, "cost_per_hour": r.shape.cost_per_hour,
                    "rps_per_dollar_hour": r.ratio}
                   for r in sorted(plan.rated, key=lambda r: -r.ratio)],
        "fleet": {"goodput_rps": plan.goodput_rps, "cost_per_hour": plan.cost_per_hour,
                  "usd_per_m_output_tokens": usd_per_million_tokens(
                      plan.cost_per_hour, plan.goodput_rps, out_tokens),
                  "gpus": plan.gpus, "inventory_gpus": sum(h.count for h in inv.hosts)},
        "unused": dict(plan.unused), "notes": list(plan.skipped),
        "fleet_file": fleet, "verify": checks,
    }


def _table(plan: Formation, inv: Inventory, args: argparse.Namespace,
           checks: dict[str, dict[str, float]], measured: float | None,
           roles: tuple[str, ...] | None = None, tried: list[RoleChoice] | None = None,
           chosen: RoleChoice | None = None, colocated: RoleChoice | None = None) -> None:
    out_tokens = args.output_tokens
    print(f"{args.model} on {sum(h.count for h in inv.hosts)} GPUs in {len(inv.hosts)} hosts; "
          f"SLO TTFT {args.slo_ttft:g} s, TPOT {args.slo_tpot:g} s at {args.attainment:.0%}; "
          f"lengths {args.scenario or args.lengths} (means {args.input_tokens:.0f} in, "
          f"{args.output_tokens:.0f} out)")
    pool = ("8 GPUs' worth of the shape (--budget may buy more)" if args.budget else
            "as many of the shape as the inventory holds, up to 8 GPUs' worth")
    print(f"replicas (SLO capacity each: the simulator's, pooled with {pool}):")
    for i, r in enumerate(plan.replicas):
        s = r.rated.shape
        where = "to buy" if r.added else "on " + ",".join(r.hosts)
        role = f"  role {roles[i]}" if roles is not None else ""
        print(f"  {s.name:<24} {where:<14} {r.rated.capacity_rps:7.2f} req/s  "
              f"${s.cost_per_hour:6.2f}/h  {engine_flags(r, args.model)}{role}")
    if tried:
        print("prefill/decode splits of the whole inventory (SLO goodput behind tailguard, "
              "simulator):")
        for choice in sorted([*tried, *([colocated] if colocated else [])],
                             key=lambda c: -c.ratio):
            mark = "  <- chosen" if choice is chosen else ""
            print(f"  {choice.name:<58} {choice.goodput_rps:8.2f} req/s  "
                  f"${choice.cost_per_hour:7.2f}/h  {choice.ratio:.3f} req/s per $/h{mark}")
        if roles is not None:
            print("  note: the gateway serves prefill/decode roles once it speaks vLLM's P/D; "
                  "the fleet file is co-located until then")
    for host, n in sorted(plan.unused.items()):
        print(f"  unused: {n} GPU{'s' if n != 1 else ''} of {host}")
    for note in plan.skipped:
        print(f"  note: {note}")
    for line in _dropped(plan):
        print(f"  dropped: {line}")
    print("per GPU class:")
    for name, c in sorted(_classes(plan).items(), key=lambda kv: -kv[1]["goodput_rps"]):
        usd = usd_per_million_tokens(c["cost_per_hour"], c["goodput_rps"], out_tokens)
        print(f"  {name:<24} {int(c['replicas']):3d} replicas {c['goodput_rps']:8.2f} req/s "
              f"({c['share']:.0%})  ${c['cost_per_hour']:7.2f}/h  ${usd:.2f} per M output tokens")
    usd = usd_per_million_tokens(plan.cost_per_hour, plan.goodput_rps, out_tokens)
    print(f"fleet: {plan.goodput_rps:.2f} req/s on {plan.gpus} GPUs (the capacities' sum; "
          f"--verify measures the fleet), ${plan.cost_per_hour:.2f}/h, "
          f"${usd:.2f} per M output tokens")
    if args.rate:
        got = measured or 0.0
        print(f"  measured SLO goodput {got:.2f} req/s for --rate {args.rate:g} (simulator, "
              "tailguard policy)" + ("" if got >= args.rate else
                                    ": short of it; add GPUs (--budget buys them)"))
    if args.fleet_out:
        print(f"fleet file for tailguard serve: {args.fleet_out}")
    else:
        print("fleet file for tailguard serve: --fleet-out FILE (or --format fleet)")
    if checks:
        print(f"verify (simulator, tailguard policy, SLO goodput at {args.attainment:.0%}):")
        for name, c in checks.items():
            at = (f"; {c['attainment_at_rate']:.1%} within the SLO at {args.rate:g} req/s"
                  if "attainment_at_rate" in c else "")
            print(f"  {name:<36} {c['goodput_rps']:8.2f} req/s  ${c['cost_per_hour']:7.2f}/h  "
                  f"{c['rps_per_dollar_hour']:.3f} req/s per $/h{at}")
        mine = checks["planned"]["rps_per_dollar_hour"]
        naive = max(c["rps_per_dollar_hour"] for n, c in checks.items() if n != "planned")
        if naive > 0:
            each = ", ".join(f"{n} {mine / c['rps_per_dollar_hour']:.2f}x" if
                             c["rps_per_dollar_hour"] > 0 else f"{n}: serves nothing"
                             for n, c in checks.items() if n != "planned")
            print(f"  planned / best naive: {mine / naive:.2f}x goodput per dollar ({each})")
            if mine < naive:  # the ratings misjudged this fleet: say so, keep the plan
                best = max((n for n in checks if n != "planned"),
                           key=lambda n: checks[n]["rps_per_dollar_hour"])
                print(f"  warning: {best} measured more per dollar than the plan; on a small "
                      "fleet, pooling can outweigh dropping GPUs (the same formation measured "
                      "up to 13% apart between runs)")
        else:
            print("  no naive formation serves anything within the SLO")
        top = plan.ceiling
        rated_naive = max(c["rated_rps_per_dollar_hour"] for n, c in checks.items()
                          if n != "planned")
        if top is not None and rated_naive > 0:
            print(f"  ceiling: no formation rates above the best shape, {top.shape.name} at "
                  f"{top.ratio:.3f} req/s per $/h, {top.ratio / rated_naive:.2f}x the best naive "
                  "formation's rating")
