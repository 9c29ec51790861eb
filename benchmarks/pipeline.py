"""Pipeline-parallel replicas in the simulator (issue 16): layer split and overlap.

Two PP-2 replicas of one H100-SXM and one A100-80GB (stages on different
hosts). For each model and workload, the SLO goodput (the highest Poisson rate
at 99% attainment, TTFT 5 s / TPOT 0.2 s) with the layers split evenly and by
speed (core/pipeline.py), and with activation sends overlapped or not on
three links between the stages. Prints what it measured.

    python benchmarks/pipeline.py [--models qwen2.5-32b,llama-3.1-8b] [--duration 300]
"""

from __future__ import annotations

import argparse
from typing import Any

from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.pipeline import StageSpec, pipeline_perf
from tailguard.sim.run import RunOptions, simulate
from tailguard.sim.scenario import PolicyChoice, parse_scenario

WORKLOADS = {"decode-heavy": (512, 256), "prefill-heavy": (2048, 128)}
LINKS = (25.0, 1.25, 0.125)  # GB/s: HDR InfiniBand, 10 GbE, 1 GbE


def scenario(model: str, duration: float, lengths: tuple[int, int],
             **layout: Any) -> dict[str, Any]:
    return {"name": "pp", "seed": 1, "model": model, "slo": {"ttft_s": 5.0, "tpot_s": 0.2},
            "fleet": [{"stages": [{"gpu": "H100-SXM"}, {"gpu": "A100-80GB"}], "count": 2,
                       **layout}],
            "workload": {"duration_s": duration, "warmup_s": 30,
                         "arrival": {"process": "poisson", "rate": 1.0},
                         "input_tokens": {"dist": "fixed", "value": lengths[0]},
                         "output_tokens": {"dist": "fixed", "value": lengths[1]}}}


def goodput(raw: dict[str, Any]) -> float:
    out = simulate(parse_scenario(raw), [PolicyChoice("tailguard")], RunOptions(find_goodput=True))
    return float(out["results"]["tailguard"]["max_goodput_rps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-32b,llama-3.1-8b")
    ap.add_argument("--duration", type=float, default=300.0)
    args = ap.parse_args()
    h100, a100 = DEFAULT_CATALOG.gpu("H100-SXM"), DEFAULT_CATALOG.gpu("A100-80GB")
    for model in args.models.split(","):
        m = DEFAULT_CATALOG.model(model)
        even = pipeline_perf([StageSpec(h100), StageSpec(a100)], m, split="even")
        speed = pipeline_perf([StageSpec(h100), StageSpec(a100)], m, split="speed")
        print(f"{model}: layers even {even.layers}, speed {speed.layers}; decode step at "
              f"batch 1/32/128 (ctx 1024): even "
              + "/".join(f"{even.step_time(b, b * 1024.0) * 1e3:.1f}" for b in (1, 32, 128))
              + " ms, speed "
              + "/".join(f"{speed.step_time(b, b * 1024.0) * 1e3:.1f}" for b in (1, 32, 128))
              + " ms", flush=True)
        for name, lengths in WORKLOADS.items():
            g_even = goodput(scenario(model, args.duration, lengths, split="even"))
            g_speed = goodput(scenario(model, args.duration, lengths, split="speed"))
            print(f"  {name} {lengths[0]}/{lengths[1]} tokens: goodput even {g_even:.2f} req/s, "
                  f"speed {g_speed:.2f} req/s ({g_speed / g_even:.2f}x)", flush=True)
            for link in LINKS:
                off = goodput(scenario(model, args.duration, lengths, split="speed",
                                       link_gbps=link))
                on = goodput(scenario(model, args.duration, lengths, split="speed",
                                      link_gbps=link, overlap=True))
                print(f"    link {link:g} GB/s: overlap off {off:.2f}, on {on:.2f} req/s "
                      f"({on / off:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
