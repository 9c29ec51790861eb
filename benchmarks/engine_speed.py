"""Speed of the engine model (tailguard.engine) under a discrete-event driver.

Run: ``PYTHONPATH=src python benchmarks/engine_speed.py``

1. One engine (Llama-3.1-8B on H100-SXM), 3,000 requests with ~1000-token
   prompts and ~200-token outputs: first saturated (all at t=0) to find its
   throughput, then Poisson arrivals at 70% of it.
2. A fleet: 64 engines of mixed GPUs for one simulated hour, 200,000 requests
   routed at random (weighted by each engine's saturated throughput), driven
   by one heap of engine wake-up times, as the simulator does.

It prints requests/s and engine steps/s of wall-clock time; nothing is
asserted (``tests/engine/test_engine.py`` holds the correctness checks).
"""

from __future__ import annotations

import heapq
import math
import random
import time

from tailguard.core.hardware import PerfModel, perf_model
from tailguard.engine import Engine, EngineConfig


def workload(n: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate) if rate < math.inf else 0.0
        out.append((t, max(1, int(rng.gauss(1000, 300))), max(1, int(rng.gauss(200, 60)))))
    return out


def run_one(perf: PerfModel, work: list[tuple[float, int, int]]) -> tuple[Engine, float, float, int]:
    eng = Engine(perf, EngineConfig())
    wakeups = 0
    end = 0.0
    t0 = time.perf_counter()
    for rid, (t, p, o) in enumerate(work):
        while eng.next_event_time() <= t:
            eng.advance(eng.next_event_time())
            wakeups += 1
        eng.submit(rid, p, o, t)
    while (nxt := eng.next_event_time()) < math.inf:
        eng.advance(nxt)
        end = nxt
        wakeups += 1
    return eng, time.perf_counter() - t0, end, wakeups


def single_engine() -> None:
    perf = perf_model("H100-SXM", "llama-3.1-8b")
    _, _, end, _ = run_one(perf, workload(3000, math.inf, 1))
    capacity = 3000 / end
    for load in (0.7, 0.1):
        work = workload(3000, load * capacity, 2)
        eng, wall, end, wakeups = run_one(perf, work)
        print(
            f"one engine at {load:.0%} of {capacity:.1f} req/s: {len(work)} requests, "
            f"{eng.steps_total:,} steps, {wakeups:,} wake-ups, {end:.0f} s simulated in "
            f"{wall:.3f} s -> {len(work) / wall:,.0f} req/s, {eng.steps_total / wall:,.0f} steps/s"
        )


def fleet(nodes: int = 64, requests: int = 200_000, horizon: float = 3600.0) -> None:
    gpus = ["H100-SXM", "A100-80GB", "L40S", "L4"]
    perfs = [perf_model(gpus[i % len(gpus)], "llama-3.1-8b") for i in range(nodes)]
    # weight routing by each GPU's rough decode bandwidth so that no node is swamped
    weights = [p.gpu.mem_bw_gbps for p in perfs]
    engines = [Engine(p) for p in perfs]
    rng = random.Random(3)
    rate = requests / horizon
    arrivals = workload(requests, rate, 4)
    heap: list[tuple[float, int]] = []
    version = [math.inf] * nodes

    def touch(i: int) -> None:
        t = engines[i].next_event_time()
        if t != version[i]:
            version[i] = t
            if t < math.inf:
                heapq.heappush(heap, (t, i))

    events = 0
    t0 = time.perf_counter()
    for rid, (t, p, o) in enumerate(arrivals):
        while heap and heap[0][0] <= t:
            te, i = heapq.heappop(heap)
            if te != version[i]:
                continue
            version[i] = math.inf
            events += len(engines[i].advance(te))
            touch(i)
        i = rng.choices(range(nodes), weights)[0]
        engines[i].submit(rid, p, o, t)
        touch(i)
    while heap:
        te, i = heapq.heappop(heap)
        if te != version[i]:
            continue
        version[i] = math.inf
        events += len(engines[i].advance(te))
        touch(i)
    wall = time.perf_counter() - t0
    steps = sum(e.steps_total for e in engines)
    pre = sum(e.num_preemptions for e in engines)
    print(
        f"fleet of {nodes}: {requests:,} requests over {horizon:.0f} s, {steps:,} engine steps, "
        f"{events:,} events, {pre} preemptions in {wall:.2f} s -> {requests / wall:,.0f} req/s, "
        f"{steps / wall:,.0f} steps/s"
    )


if __name__ == "__main__":
    single_engine()
    fleet()
