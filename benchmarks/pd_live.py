"""Live P/D on emulated engines: tailguard's gateway against vllm-router's P/D mode.

One heterogeneous P/D fleet of emulated engines (prefill: 1 H100 and 2 L40S;
decode: 3 A100; Llama-3.1-8B timings), fresh for every run, and one open-loop
long-prompt workload (lognormal prompts, mean about 6k tokens; 64-token
answers, ignore_eos) from ``tailguard bench``'s load generator, sent to:

* ``tailguard serve`` with the nodes' roles in its fleet file (the ``tailguard``
  policy: pairs by predicted finish);
* ``vllm-router --vllm-pd-disaggregation`` (a dev dependency) with
  ``round_robin`` and with ``cache_aware``, pointed at the same engines.

It prints each run's SLO attainment, TTFT and TPOT p99, errors, and the
engines' KV transfer counts. Nothing is asserted.

    python benchmarks/pd_live.py [--rate 3] [--duration 60] [--speed 1] [--targets ...]
    python benchmarks/pd_live.py --overhead 500    # the gateway's TTFT cost over both legs
    python benchmarks/pd_live.py --bound --rate 5  # a clairvoyant router's TTFT (no engines)
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tailguard.bench.loadgen import BenchConfig, LoadGenerator
from tailguard.bench.summary import summarize
from tailguard.config.fleet import parse_fleet
from tailguard.core.policies import Slo
from tailguard.emulator import EmulatedNode, Emulator, run_emulator
from tailguard.gateway.app import run_gateway
from tailguard.traffic.lengths import parse_length_dist

MODEL = "llama-3.1-8b"
FLEET = [("p-h100", "H100-SXM", "prefill"), ("p-l40s-0", "L40S", "prefill"),
         ("p-l40s-1", "L40S", "prefill"), ("d-a100-0", "A100-80GB", "decode"),
         ("d-a100-1", "A100-80GB", "decode"), ("d-a100-2", "A100-80GB", "decode")]
INPUT = {"dist": "lognormal", "mu": 8.5, "sigma": 0.6, "min": 256, "max": 24000}
OUTPUT = {"dist": "fixed", "value": 64}
SLO = Slo(3.0, 0.1)
TARGETS = ("tailguard", "vllm-router:round_robin", "vllm-router:cache_aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def load(url: str, rate: float, duration: float, speed: float) -> dict[str, Any]:
    slo = Slo(SLO.ttft_s / speed, SLO.tpot_s / speed)
    gen = LoadGenerator(BenchConfig(
        url, model=MODEL, rate=rate * speed, duration_s=duration,
        input_tokens=parse_length_dist(INPUT, "input_tokens", "input_tokens"),
        output_tokens=parse_length_dist(OUTPUT, "output_tokens", "output_tokens"),
        slo=slo, ignore_eos=True, drain_s=60.0, seed=1))
    await gen.run()
    return summarize(gen.records, gen.cfg, gen.elapsed_s)


async def router_up(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("vllm-router did not come up")


def transfers(emu: Emulator) -> str:
    s = emu.servers.values()
    return (f"KV sent {sum(x.kv_sent for x in s)}, received {sum(x.kv_received for x in s)}, "
            f"recomputed {sum(x.kv_missing for x in s)}")


async def one(target: str, rate: float, duration: float, speed: float) -> str:
    nodes = [EmulatedNode(nid, gpu, (MODEL,)) for nid, gpu, _ in FLEET]
    async with run_emulator(nodes, speed=speed) as emu:
        if target == "tailguard":
            cfg = parse_fleet({
                "listen": "127.0.0.1:0",
                "nodes": [{"id": nid, "url": emu.urls[nid], "gpu": gpu, "models": [MODEL],
                           "role": role} for nid, gpu, role in FLEET],
                "pools": {MODEL: {"policy": "tailguard",
                                  "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}}}})
            async with run_gateway(cfg) as gw:
                r = await load(gw.url, rate, duration, speed)
        else:
            binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
            if binary is None:
                return f"{target}: vllm-router is not installed"
            port = free_port()
            cmd = [binary, "--host", "127.0.0.1", "--port", str(port),
                   "--vllm-pd-disaggregation", "--policy", target.split(":")[1],
                   "--log-level", "error"]
            for nid, _, role in FLEET:
                cmd += ["--prefill", emu.urls[nid], "none"] if role == "prefill" \
                    else ["--decode", emu.urls[nid]]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                url = f"http://127.0.0.1:{port}"
                await router_up(url)
                r = await load(url, rate, duration, speed)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        return (f"{target:26s} attainment {r['slo_attainment']:.4f}  TTFT p99 "
                f"{r['ttft_s']['p99'] * speed:6.2f} s  TPOT p99 {r['tpot_s']['p99'] * speed:.4f} s"
                f"  errors {r['errors']}  requests {r['requests']}  ({transfers(emu)})")


async def overhead(n: int) -> str:
    """Zero-delay engines: TTFT p50 of the two legs sent straight to the engines
    (the prefill leg, then the decode leg with its kv_transfer_params, as a router
    does) against the same request through tailguard's gateway."""
    import time

    nodes = [EmulatedNode("pre", "H100-SXM", (MODEL,)), EmulatedNode("dec", "A100-80GB", (MODEL,))]
    def request(i: int) -> dict[str, Any]:  # no prefix shared: none is cached anywhere
        return {"model": MODEL, "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": f"{i} " + "tell me " * 2000}]}

    remote_decode = {"do_remote_decode": True, "do_remote_prefill": False,
                     "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                     "remote_port": None}

    async def first_byte(s: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> None:
        async with s.post(url + "/v1/chat/completions", json=doc) as r:
            await r.content.readany()
            await r.read()

    async with run_emulator(nodes, speed=float("inf")) as emu:
        cfg = parse_fleet({"listen": "127.0.0.1:0", "nodes": [
            {"id": "pre", "url": emu.urls["pre"], "gpu": "H100-SXM", "models": [MODEL],
             "role": "prefill"},
            {"id": "dec", "url": emu.urls["dec"], "gpu": "A100-80GB", "models": [MODEL],
             "role": "decode"}], "pools": {MODEL: {"policy": "tailguard"}}})
        direct: list[float] = []
        via: list[float] = []
        async with run_gateway(cfg) as gw, aiohttp.ClientSession() as s:
            for i in range(n):
                body = request(2 * i)
                leg = dict(body, stream=False, max_tokens=1, min_tokens=1,
                           kv_transfer_params=remote_decode)
                t = time.perf_counter()
                async with s.post(emu.urls["pre"] + "/v1/chat/completions", json=leg) as r:
                    params = (await r.json())["kv_transfer_params"]
                await first_byte(s, emu.urls["dec"], dict(body, kv_transfer_params=params))
                direct.append(time.perf_counter() - t)
                t = time.perf_counter()
                await first_byte(s, gw.url, request(2 * i + 1))
                via.append(time.perf_counter() - t)
        remote = emu.servers["dec"].kv_received - n  # the gateway's that went both legs
    direct.sort()
    via.sort()
    d, v = direct[n // 2] * 1e3, via[n // 2] * 1e3
    return (f"zero-delay engines, {n} requests each: the two legs straight to the engines "
            f"{d:.2f} ms p50, through tailguard {v:.2f} ms p50: the gateway adds {v - d:.2f} ms "
            f"({remote} of its {n} requests went through both legs)")


def bound(rate: float) -> str:
    """The TTFT p99 floor of a clairvoyant router on this workload and fleet
    (:func:`pd.prefill_floor`): on the prefill nodes, and with the decode nodes
    computing prompts too."""
    from pd import prefill_floor  # this folder's: run as a script

    out = []
    for label, roles in (("prefill nodes", ("prefill",)),
                         ("prefill and decode nodes", ("prefill", "decode"))):
        gpus = [gpu for _, gpu, role in FLEET if role in roles]
        floors = [prefill_floor(rate, INPUT, gpus, seed) for seed in (1, 2, 3)]
        out.append(f"on the {label} {' / '.join(f'{f:.3f}' for f in floors)} s")
    return (f"{rate} req/s: TTFT p99 of a clairvoyant earliest-finish router (seeds 1-3) "
            + "; ".join(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=3.0, help="req/s at the engines' own speed")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--speed", type=float, default=1.0,
                    help="emulated engines this many times faster (rates and SLOs follow)")
    ap.add_argument("--overhead", type=int, default=0, metavar="N",
                    help="instead: the gateway's own TTFT cost over the two legs, N requests")
    ap.add_argument("--bound", action="store_true",
                    help="instead: the TTFT a clairvoyant earliest-finish router would give")
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"which routers to run, in order (default {','.join(TARGETS)})")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            ap.error(f"--targets: unknown {t!r} (one of {', '.join(TARGETS)})")
    if args.bound:
        print(bound(args.rate))
        return
    if args.overhead:
        print(asyncio.run(overhead(args.overhead)))
        return
    print(f"P/D fleet: {', '.join(f'{n} ({r})' for n, _, r in FLEET)}; "
          f"{args.rate} req/s for {args.duration:g} s; SLO TTFT {SLO.ttft_s} s, "
          f"TPOT {SLO.tpot_s} s (in engine time)")
    for target in targets:
        print(asyncio.run(one(target, args.rate, args.duration / args.speed, args.speed)),
              flush=True)


if __name__ == "__main__":
    main()
