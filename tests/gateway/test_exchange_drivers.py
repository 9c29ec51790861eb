"""One trace through both drivers: the simulator and the gateway take the same actions.

The same five requests, one after another, meet the same failures in both:
node ``n1`` answers every request with a 5xx and node ``n2`` refuses
connections (in the simulator an ``errors`` fault of rate 1 and a crash; in front of
the gateway a scripted engine answering 500 and a port nobody listens on).
Round robin makes the node each request meets the same. Both drivers build
their exchanges from one tracing subclass, and the sequences of actions the
exchanges returned must be equal, action for action.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, ClassVar

import aiohttp
from gateway_fakes import FakeEngine, fleet_doc, free_port

from tailguard.config.faults import FaultSpec
from tailguard.config.fleet import parse_fleet
from tailguard.core.exchange import (
    Action,
    ArmTimer,
    Cancel,
    Copy,
    Dispatch,
    Exchange,
    Fail,
    Failure,
    Queue,
    Refuse,
)
from tailguard.core.fleet import Outcome
from tailguard.core.hedging import HedgeConfig
from tailguard.core.policies import Slo
from tailguard.core.retry_budget import RetryConfig
from tailguard.gateway.app import PROXY, run_gateway
from tailguard.sim.cluster import run_cluster
from tailguard.sim.scenario import parse_scenario

MODEL = "llama-3.1-8b"
REQUESTS = 5
GAP_S = 0.3


def _name(a: Action) -> tuple[Any, ...]:
    if type(a) is Dispatch:
        return ("dispatch", a.copy.node_id, "hedge" if a.copy.hedge else "copy",
                a.retry_of.value if a.retry_of else None)
    if type(a) is Cancel:
        return ("cancel", a.copy.node_id)
    if type(a) is ArmTimer:
        return ("timer",)
    if type(a) is Queue:
        return ("queue",)
    if type(a) is Refuse:
        return ("refuse", a.shed.reason)
    assert type(a) is Fail
    return ("fail", a.failure.status, a.failure.origin.value, a.committed)


class Traced(Exchange):
    """An exchange that logs every event it gets and the actions it answers."""

    __slots__ = ()
    log: ClassVar[list[tuple[Any, ...]]] = []

    def _note(self, event: str, actions: tuple[Action, ...]) -> tuple[Action, ...]:
        self.log.append((event, *(_name(a) for a in actions)))
        return actions

    def arrive(self, now: float) -> tuple[Action, ...]:
        return self._note("arrive", super().arrive(now))

    def sent(self, copy: Copy, now: float) -> tuple[Action, ...]:
        return self._note("sent", super().sent(copy, now))

    def timer(self, now: float) -> tuple[Action, ...]:
        return self._note("timer", super().timer(now))

    def first_chunk(self, copy: Copy, now: float, *, served: bool = True,
                    defer_prefill: bool = False) -> tuple[Action, ...]:
        return self._note("first_chunk",
                          super().first_chunk(copy, now, served=served,
                                              defer_prefill=defer_prefill))

    def failed(self, copy: Copy, now: float, failure: Failure, output_tokens: int = 0,
               cached_tokens: int | None = None) -> tuple[Action, ...]:
        return self._note(f"failed {failure.origin.value}",
                          super().failed(copy, now, failure, output_tokens, cached_tokens))

    def finished(self, copy: Copy, now: float, outcome: Outcome, output_tokens: int, *,
                 timed: bool = True, cached_tokens: int | None = None) -> tuple[Action, ...]:
        return self._note(f"finished {outcome.value}",
                          super().finished(copy, now, outcome, output_tokens, timed=timed,
                                           cached_tokens=cached_tokens))

    def client_gone(self, now: float, output_tokens: int = 0,
                    cached_tokens: int | None = None) -> tuple[Action, ...]:
        return self._note("client_gone", super().client_gone(now, output_tokens, cached_tokens))


RETRIES = RetryConfig(attempts=3, budget=1.0)
HEDGE = HedgeConfig(enabled=True, after_s=0.3, require_silence=False, budget=1.0)


def simulated(hedging: bool) -> list[tuple[Any, ...]]:
    scn = parse_scenario({
        "name": "trace", "seed": 1, "model": MODEL, "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "fleet": [{"gpu": "A100-80GB", "count": 3}],
        "workload": {"duration_s": 10, "arrival": {"process": "poisson", "rate": 1},
                     "input_tokens": {"dist": "azure-conv"},
                     "output_tokens": {"dist": "azure-conv"}},
    })
    plans = [dataclasses.replace(p, id=f"n{i}") for i, p in enumerate(scn.nodes())]
    if hedging:  # n0 pauses for longer than the hedge delay, with the first request on it
        faults = [FaultSpec("stall", 0.0, duration_s=0.5, node="n0", seconds=2.0)]
    else:
        faults = [FaultSpec("errors", 0.0, node="n1", rate=1.0), FaultSpec("crash", 0.0, node="n2")]
    n = 1 if hedging else REQUESTS
    Traced.log = []
    run_cluster(plans, MODEL, [i * GAP_S for i in range(n)], [50] * n, [4] * n, policy="round_robin", slo=Slo(), seed=1, faults=faults,
                retries=RETRIES, hedging=HEDGE if hedging else None, exchange_type=Traced)
    return Traced.log


async def live(hedging: bool) -> list[tuple[Any, ...]]:
    engines = [await FakeEngine(f"n{i}").start() for i in range(3 if hedging else 2)]
    try:
        if hedging:
            engines[0].behavior.first_delay_s = 2.0
        else:
            engines[1].behavior.mode = "error500"
        urls = [e.url for e in engines] + ([] if hedging else [f"http://127.0.0.1:{free_port()}"])
        doc = fleet_doc(engines, model=MODEL, health={"failures": 1000})
        doc["nodes"] = [{"id": f"n{i}", "url": u, "gpu": "A100", "models": [MODEL]}
                        for i, u in enumerate(urls)]
        pool = doc["pools"][MODEL]
        pool.update(policy="round_robin", retries={"attempts": 3, "budget": 1.0})
        if hedging:
            pool["hedging"] = {"enabled": True, "after_s": 0.3, "require_silence": False,
                               "budget": 1.0}
        async with run_gateway(parse_fleet(doc)) as gw:
            gw.app[PROXY].forwarder.exchange_type = Traced
            Traced.log = []
            async with aiohttp.ClientSession() as s:
                for _ in range(1 if hedging else REQUESTS):
                    body = {"model": MODEL, "stream": True, "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]}
                    async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
            return list(Traced.log)
    finally:
        for e in engines:
            await e.stop()


def test_retries_take_the_same_actions_in_the_simulator_and_the_gateway() -> None:
    sim = simulated(hedging=False)
    gateway = asyncio.run(live(hedging=False))
    assert ("failed upstream_5xx", ("dispatch", "n2", "copy", "upstream_5xx")) in sim
    assert ("failed connect_failure", ("dispatch", "n0", "copy", "connect_failure")) in sim
    assert gateway == sim


def test_a_hedge_takes_the_same_actions_in_the_simulator_and_the_gateway() -> None:
    sim = simulated(hedging=True)
    gateway = asyncio.run(live(hedging=True))
    assert ("first_chunk", ("cancel", "n0")) in sim
    assert gateway == sim
