"""Properties of the exchange under any order of events a driver could report.

Hypothesis plays a driver: several exchanges at once on a small fleet (with
or without limits and a queue, with or without hedging), and at each step one
event drawn from those that could happen now (a copy's first chunk, its
failure of any origin, its finish, a timer, the client leaving, the queue's
pump, a node going down; on a fleet whose nodes have prefill/decode roles, a
prefill leg's answer or failure too). Whatever the order:

* every exchange ends exactly once, and its ending matches what it answered;
* no action dispatches to a node the balancer would not route to (down,
  tried already by the same exchange, or at its concurrency limit);
* at the end nothing is in flight and no permit was released twice.
"""

from __future__ import annotations

import dataclasses
import os
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from tailguard.core.admission import AdmissionConfig
from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.exchange import (
    COMMITTED,
    SENT,
    Action,
    ArmTimer,
    Cancel,
    Copy,
    Decode,
    Dispatch,
    Exchange,
    Fail,
    Failure,
    Migrate,
    Phase,
    Queue,
    Refuse,
    Request,
    pump,
)
from tailguard.core.fleet import Actor, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.hedging import HedgeConfig, Hedger
from tailguard.core.limits import LimitConfig
from tailguard.core.retry_budget import RetryConfig

MODEL = "m"
FAILURES = [
    Failure(Outcome.CONNECT_FAILURE, 502, "connect", "upstream_connect_failed"),
    Failure(Outcome.TIMEOUT, 504, "timeout", "upstream_timeout"),
    Failure(Outcome.UPSTREAM_5XX, 502, "500", "upstream_error", judged=False),
    Failure(Outcome.UPSTREAM_429, 503, "429", "upstream_busy", "1"),
]


class Driver:
    """Applies actions the way a driver would, checking each against the balancer."""

    def __init__(self, b: Balancer) -> None:
        self.b = b
        self.live: list[Copy] = []  # copies sent, not cancelled, not reported ended
        self.owner: dict[int, Exchange] = {}  # id(copy) -> its exchange
        self.timers: list[tuple[float, Exchange]] = []
        self.answers: dict[int, list[str]] = {}  # id(exchange) -> terminal answers seen
        self.prefilling: set[int] = set()  # id(copy) of copies in their prefill leg

    def apply(self, ex: Exchange, actions: tuple[Action, ...], now: float) -> None:
        for a in actions:
            if type(a) is Dispatch:
                copy = a.copy
                node = copy.ticket.node
                assert node.state.routable, f"dispatched to {node.id} in state {node.state}"
                # A node is not tried twice for what it failed (its prefill leg's node,
                # for a copy that failed there).
                failed = [c.prefill_node if c.at_prefill else c.node_id
                          for c in ex.copies if c is not copy]
                if copy.prefill_node is None:
                    assert copy.node_id not in failed, f"{copy.node_id} tried twice"
                else:
                    pre = self.b.nodes[copy.prefill_node]
                    assert pre.state.routable and pre.spec.prefills
                    assert copy.prefill_node not in failed and node.spec.decodes
                    self.prefilling.add(id(copy))
                if node.limiter is not None:
                    assert node.limiter.inflight <= node.limiter.limit
                self.live.append(copy)
                self.owner[id(copy)] = ex
                self.apply(ex, ex.sent(copy, now), now)
            elif type(a) is Migrate:  # a continuation: never to a node tried before
                copy = a.copy
                assert copy.ticket.node.state.routable and copy.after == a.after
                assert copy.node_id not in [c.prefill_node if c.at_prefill else c.node_id
                                            for c in ex.copies if c is not copy]
                assert ex.phase is Phase.MOVING
                if copy.prefill_node is not None:
                    self.prefilling.add(id(copy))
                self.live.append(copy)
                self.owner[id(copy)] = ex
            elif type(a) is Decode:
                assert id(a.copy) in self.prefilling and a.copy.ticket.prefill is None
                self.prefilling.discard(id(a.copy))
            elif type(a) is Cancel:
                assert self.owner[id(a.copy)] is ex and a.copy.state != SENT
                self.prefilling.discard(id(a.copy))
                if a.copy in self.live:
                    self.live.remove(a.copy)
            elif type(a) is ArmTimer:
                self.timers.append((a.at, ex))
            elif type(a) is Queue:
                assert a.waiter.payload is ex
            else:
                assert type(a) in (Refuse, Fail)
                self.answers.setdefault(id(ex), []).append(type(a).__name__)


@st.composite
def setups(draw: st.DrawFn) -> tuple[Balancer, bool, int]:
    n = draw(st.integers(1, 4))
    limited = draw(st.booleans())
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(n)]
    limits = LimitConfig(kind="fixed", initial=draw(st.integers(1, 3))) if limited else None
    admission = AdmissionConfig(shed_on_predicted_wait=False,
                                queue_max=draw(st.integers(1, 4))) if limited else None
    if draw(st.booleans()):  # disaggregated: some nodes prefill or decode only
        roles = [draw(st.sampled_from(["both", "prefill", "decode"])) for _ in specs]
        if all(r == "prefill" for r in roles):
            roles[0] = "decode"
        specs = [dataclasses.replace(sp, role=r) for sp, r in zip(specs, roles, strict=True)]
    policy = draw(st.sampled_from(["round_robin", "tailguard", "least_request", "dynamo"]))
    b = Balancer(specs, [PoolConfig(MODEL, policy, limits=limits, admission=admission)],
                 random.Random(draw(st.integers(0, 9))))
    b.tick(0.0)
    return b, draw(st.booleans()), draw(st.integers(1, 3))


# TAILGUARD_PROPERTY_EXAMPLES runs more (a change to the exchange deserves thousands).
EXAMPLES = int(os.environ.get("TAILGUARD_PROPERTY_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups(), st.data())
def test_every_exchange_ends_once_and_routes_only_where_the_balancer_would(
        setup: tuple[Balancer, bool, int], data: st.DataObject) -> None:
    b, hedging, attempts = setup
    hedger = Hedger(HedgeConfig(enabled=True, after_s=0.2, require_silence=False,
                                budget=1.0)) if hedging else None
    retries = RetryConfig(attempts=attempts)
    budget = retries.new_budget()
    drv = Driver(b)
    exchanges: list[Exchange] = []
    now = 0.0
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        now += data.draw(st.sampled_from([0.0, 0.01, 0.1, 0.3]), label="dt")
        open_ = [ex for ex in exchanges if ex.ended is None]
        choices = ["arrive", "pump", "down", "up"]
        decoding = [c for c in drv.live if id(c) not in drv.prefilling]
        if drv.live:
            choices.append("fail")
        if decoding:
            choices += ["first", "finish", "finish"]
        if drv.prefilling:
            choices += ["prefilled", "prefilled"]
        if drv.timers:
            choices.append("timer")
        if open_:
            choices.append("gone")
        streams = [c for c in drv.live if c.state == COMMITTED]
        if streams:
            choices += ["stall", "resume"]
        what = data.draw(st.sampled_from(choices), label="event")
        if what == "arrive":
            stream = data.draw(st.booleans(), label="stream")
            within = data.draw(st.sampled_from([None, 0.0, 0.05, 0.5, 5.0]), label="deadline")
            ex = Exchange(b, Request(MODEL, data.draw(st.integers(1, 4000), label="prompt"),
                                     64, data.draw(st.integers(0, 2), label="priority"),
                                     stream, data.draw(st.sampled_from([None, 0.2, 5.0]),
                                                       label="ttft"),
                                     deadline=None if within is None else now + within),
                          retries, budget, hedger)
            exchanges.append(ex)
            drv.apply(ex, ex.arrive(now), now)
        elif what == "pump":
            for ex, actions in pump(b, now):
                drv.apply(ex, actions, now)
        elif what in ("down", "up"):
            node_id = data.draw(st.sampled_from(sorted(b.nodes)), label="node")
            node = b.nodes[node_id]
            if what == "down" and node.state.routable:
                b.set_state(node_id, NodeState.DOWN, Actor.HEALTH)
            elif what == "up" and node.state is NodeState.DOWN:
                b.set_state(node_id, NodeState.HEALTHY, Actor.HEALTH)
        elif what == "timer":
            at, ex = drv.timers.pop(data.draw(st.integers(0, len(drv.timers) - 1)))
            drv.apply(ex, ex.timer(max(now, at)), now)
        elif what == "gone":
            ex = data.draw(st.sampled_from(open_), label="leaving")
            drv.apply(ex, ex.client_gone(now, data.draw(st.integers(0, 5))), now)
        elif what in ("stall", "resume"):
            copy = data.draw(st.sampled_from(streams), label="stream")
            ex = drv.owner[id(copy)]
            if what == "stall":
                drv.apply(ex, ex.review(copy, now, data.draw(st.integers(0, 80)),
                                        data.draw(st.sampled_from([0.0, 0.5, 30.0]))), now)
            else:
                drv.apply(ex, ex.resumed(copy, now), now)
        elif what == "prefilled":
            copy = data.draw(st.sampled_from([c for c in drv.live
                                              if id(c) in drv.prefilling]), label="copy")
            ex = drv.owner[id(copy)]
            drv.apply(ex, ex.prefilled(copy, now), now)
        else:
            copy = data.draw(st.sampled_from(drv.live if what == "fail" else decoding),
                             label="copy")
            ex = drv.owner[id(copy)]
            drv.prefilling.discard(id(copy))
            if what == "first":
                drv.apply(ex, ex.first_chunk(copy, now), now)
            elif what == "fail":
                drv.live.remove(copy)
                failure = data.draw(st.sampled_from(FAILURES), label="failure")
                drv.apply(ex, ex.failed(copy, now, failure), now)
            else:
                drv.live.remove(copy)
                outcome = data.draw(st.sampled_from([Outcome.OK, Outcome.CLIENT_ERROR]))
                drv.apply(ex, ex.finished(copy, now, outcome, 10), now)
        for ex, actions in pump(b, now):  # a driver pumps after every event
            drv.apply(ex, actions, now)
    # The end: every client that is still waiting leaves.
    for ex in exchanges:
        if ex.ended is None:
            drv.apply(ex, ex.client_gone(now + 1.0), now + 1.0)
            for other, actions in pump(b, now + 1.0):  # as after every event
                drv.apply(other, actions, now + 1.0)
    for ex in exchanges:
        answers = drv.answers.get(id(ex), [])
        assert ex.ended is not None
        if ex.ended in ("failed", "shed"):
            assert answers == ["Fail" if ex.ended == "failed" else "Refuse"], (ex.ended, answers)
        else:
            assert answers == [], (ex.ended, answers)
        assert ex.in_flight == 0
    assert b.double_release == 0
    for node in b.nodes.values():
        assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding,
                node.awaiting_kv) == (0, 0, 0, 0, 0), node.id
        if node.limiter is not None:
            assert node.limiter.inflight == 0
    queue = b.pools[MODEL].queue
    assert queue is None or queue.length == 0
