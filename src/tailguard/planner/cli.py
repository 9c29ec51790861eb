"""The ``tailguard plan`` subcommand."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.errors import ConfigError
from tailguard.planner.inventory_cli import add_arguments, cmd_inventory
from tailguard.planner.plan import plan_groups, sglang_flags, vllm_flags

# The Azure LLM inference trace's conversation means (prompt, answer tokens).
AZURE_CONV_MEANS = (1155.0, 211.0)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="engine batch settings and gateway limits per GPU type",
                       description="For each GPU type and TP degree of the fleet file: KV "
                                   "capacity, the largest batch within the TPOT SLO, the "
                                   "chunked-prefill budget, throughput at the SLO, engine "
                                   "flags and the gateway's initial per-node limits. With "
                                   "--inventory instead: form replicas (TP, PP, across GPU "
                                   "types) from hosts of GPUs for the best SLO goodput per "
                                   "dollar, rated in the simulator; print them with their "
                                   "engine flags, $ per million tokens and the fleet file.")
    p.add_argument("--fleet", help="the fleet file (as for `tailguard serve`): plan its nodes")
    p.add_argument("--model", required=True, help="catalog model (see `tailguard models`)")
    p.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO in seconds")
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT SLO in seconds")
    p.add_argument("--input-tokens", type=float,
                   help="typical prompt length (default: Azure conversation mean, 1155; with "
                        "--inventory, the mean of the lengths rated under)")
    p.add_argument("--output-tokens", type=float,
                   help="typical answer length (default: Azure conversation mean, 211; with "
                        "--inventory, the mean of the lengths rated under)")
    p.add_argument("--tp", help="TP degrees to plan each GPU type at, e.g. 1,2,4 (default: "
                                "the fleet's own), each with the type's node count; shares are then "
                                "over all the listed options")
    p.add_argument("--format", choices=["table", "json", "vllm", "sglang", "fleet"],
                   default="table", help="fleet: the fleet file (with --inventory)")
    add_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from tailguard.config.fleet import load_fleet

    for name in ("slo_tpot", "slo_ttft", "input_tokens", "output_tokens"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ConfigError("--" + name.replace("_", "-"), "must be > 0")
    if (args.fleet is None) == (args.inventory is None):
        raise ConfigError("--fleet", "give either --fleet (plan its nodes) or --inventory "
                                     "(form replicas from GPUs)")
    if args.inventory is not None:
        if args.format in ("vllm", "sglang"):
            raise ConfigError("--format", "with --inventory: table, json or fleet")
        return cmd_inventory(args)
    if args.format == "fleet":
        raise ConfigError("--format", "fleet needs --inventory")
    args.input_tokens = args.input_tokens or AZURE_CONV_MEANS[0]
    args.output_tokens = args.output_tokens or AZURE_CONV_MEANS[1]
    config = load_fleet(args.fleet)
    model = DEFAULT_CATALOG.model(args.model, "--model")
    counts: Counter[tuple[str, int]] = Counter()
    gpus = {}
    unknown = []
    for n in config.nodes:
        if n.gpu_spec is None:
            unknown.append(f"{n.id} ({n.gpu})")
            continue
        counts[(n.gpu_spec.name, n.tp)] += 1
        gpus[n.gpu_spec.name] = n.gpu_spec
    if args.tp:
        try:
            degrees = sorted({int(x) for x in args.tp.split(",") if x.strip()})
        except ValueError:
            raise ConfigError("--tp", f"must be integers like 1,2,4, got {args.tp!r}") from None
        if not degrees or degrees[0] < 1:
            raise ConfigError("--tp", "must be integers >= 1")
        per_gpu: Counter[str] = Counter()
        for (g, _tp), c in counts.items():
            per_gpu[g] += c
        counts = Counter({(g, tp): c for g, c in per_gpu.items() for tp in degrees})
    groups = [(gpus[g], tp, c) for (g, tp), c in sorted(counts.items())]
    plans = plan_groups(groups, model, args.slo_tpot, args.input_tokens, args.output_tokens)
    if args.format == "json":
        print(json.dumps({"model": model.name, "slo": {"ttft_s": args.slo_ttft,
                                                       "tpot_s": args.slo_tpot},
                          "groups": [asdict(p) for p in plans], "unknown_gpus": unknown},
                         indent=1))
        return 0
    for p in plans:
        head = f"{p.gpu} x{p.tp} ({p.nodes} node{'s' if p.nodes != 1 else ''})"
        if not p.fits:
            print(f"{head}: {model.name} does not fit: it needs about "
                  f"{p.memory_needed_gb:.0f} GB per GPU; raise tp or pick a larger GPU")
            continue
        if args.format == "vllm":
            print(f"{head}: vllm serve {model.name} {vllm_flags(p)}")
        elif args.format == "sglang":
            print(f"{head}: python -m sglang.launch_server --model-path {model.name} "
                  f"{sglang_flags(p)}")
        else:
            print(f"{head}: KV {p.kv_capacity_tokens} tokens, batch at SLO {p.max_num_seqs} "
                  f"(step {p.tpot_at_batch_s * 1000:.1f} ms), token budget "
                  f"{p.max_num_batched_tokens}, {p.tokens_per_s:.0f} tok/s = "
                  f"{p.requests_per_s:.2f} req/s per node, {p.share:.1%} of the fleet; "
                  f"gateway initial limit {p.initial_limit}")
    for u in unknown:
        print(f"{u}: GPU not in the catalog, not planned")
    if args.format == "table":
        print("gateway: pools.<model>.limits: {kind: gradient}  (starts from the initial "
              "limits above and adapts to the measured TPOT)")
    return 0
