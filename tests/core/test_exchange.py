"""The exchange on literal event sequences: retries, the hedge race, the queue, the client.

After every sequence nothing is in flight and no permit was released twice.
The balancer is the real one (round robin over A100s, so the node each step
names is known); the events are what a driver would report.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tailguard.core.admission import AdmissionConfig
from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.exchange import (
    ArmTimer,
    Cancel,
    Copy,
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
from tailguard.core.outliers import OutlierConfig
from tailguard.core.retry_budget import RetryBudget, RetryConfig

MODEL = "m"
CONNECT = Failure(Outcome.CONNECT_FAILURE, 502, "cannot connect", "upstream_connect_failed")
E5XX = Failure(Outcome.UPSTREAM_5XX, 502, "answered 500", "upstream_error", judged=False)
BUSY = Failure(Outcome.UPSTREAM_429, 503, "overloaded", "upstream_busy", "2")


def balancer(n: int = 3, *, limit: int | None = None, queue: bool = False) -> Balancer:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(n)]
    limits = LimitConfig(kind="fixed", initial=limit) if limit is not None else None
    admission = AdmissionConfig(shed_on_predicted_wait=False) if queue else None
    b = Balancer(specs, [PoolConfig(MODEL, "round_robin", limits=limits, admission=admission)],
                 random.Random(0), outliers=OutlierConfig())
    b.tick(0.0)  # the detector keeps a record of each node from its first tick
    return b


def charged(b: Balancer, node_id: str) -> int:
    """Node failures the outlier detector counts against ``node_id``."""
    assert b.outliers is not None
    h = b.outliers.health.get(node_id)
    return h.consecutive_failures if h is not None else 0


def exchange(b: Balancer, *, stream: bool = True, hedger: Hedger | None = None,
             budget: RetryBudget | None = None, attempts: int = 3, priority: int = 1,
             ttft_s: float | None = None) -> Exchange:
    retries = RetryConfig(attempts=attempts)
    return Exchange(b, Request(MODEL, 100, 50, priority, stream, ttft_s), retries,
                    budget or retries.new_budget(), hedger)


def only(actions: tuple[object, ...], kind: type) -> object:
    assert len(actions) == 1 and type(actions[0]) is kind, actions
    return actions[0]


def dispatched(actions: tuple[object, ...]) -> Copy:
    d = only(actions, Dispatch)
    assert isinstance(d, Dispatch)
    return d.copy


@pytest.fixture
def settled() -> Iterator[list[Balancer]]:
    """Balancers a test used: afterwards nothing in flight, no permit released twice."""
    used: list[Balancer] = []
    yield used
    for b in used:
        assert b.double_release == 0
        for node in b.nodes.values():
            assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding) == \
                (0, 0, 0, 0), node.id
            if node.limiter is not None:
                assert node.limiter.inflight == 0, node.id


def test_connect_failure_then_a_retry_elsewhere(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex = exchange(b)
    first = dispatched(ex.arrive(0.0))
    assert ex.sent(first, 0.0) == ()
    second = dispatched(ex.failed(first, 0.01, CONNECT))
    assert second.node_id != first.node_id
    assert ex.first_chunk(second, 0.2) == ()
    assert ex.finished(second, 1.0, Outcome.OK, 50) == ()
    assert ex.ended == "ok" and ex.tried == [first.node_id, second.node_id]
    assert charged(b, first.node_id) == 1  # a connect failure is judged


def test_phases_follow_the_table(settled: list[Balancer]) -> None:
    b = balancer(1, limit=1, queue=True)
    settled.append(b)
    first, second = exchange(b), exchange(b)
    copy = dispatched(first.arrive(0.0))
    assert first.phase is Phase.TRYING
    assert isinstance(only(second.arrive(0.0), Queue), Queue)
    assert second.phase is Phase.QUEUED
    first.first_chunk(copy, 0.1)
    assert first.phase is Phase.STREAMING
    assert first.first_chunk(copy, 0.2) == ()  # stale: changes nothing
    first.finished(copy, 1.0, Outcome.OK, 50)
    assert (first.phase, first.ended) == (Phase.ENDED, "ok")
    [(ex, _)] = pump(b, 1.0)
    assert ex is second and second.phase is Phase.TRYING
    second.client_gone(1.1)
    assert (second.phase, second.ended) == (Phase.ENDED, "client_gone")
    assert second.client_gone(1.2) == () and second.phase is Phase.ENDED


def test_a_429_then_success(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex = exchange(b, stream=False)
    first = dispatched(ex.arrive(0.0))
    d = ex.failed(first, 0.01, BUSY)
    assert type(d[0]) is Dispatch and d[0].retry_of is Outcome.UPSTREAM_429
    second = d[0].copy
    assert ex.finished(second, 0.5, Outcome.OK, 50) == ()  # not streamed: one event
    assert ex.ended == "ok" and ex.committed is second


def test_a_5xx_after_the_retry_budget_is_spent(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    budget = RetryBudget(ratio=0.0, min_per_s=0.0)  # nothing to spend
    ex = exchange(b, budget=budget)
    first = dispatched(ex.arrive(0.0))
    fail = only(ex.failed(first, 0.01, E5XX), Fail)
    assert isinstance(fail, Fail) and not fail.committed
    assert (fail.failure.status, fail.node_id) == (502, first.node_id)
    assert ex.ended == "failed" and ex.verdict == ("unknown", 1)  # one 5xx: nobody charged
    assert charged(b, first.node_id) == 0


def test_two_nodes_failing_a_request_is_the_requests_doing(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex = exchange(b, attempts=2)
    first = dispatched(ex.arrive(0.0))
    second = dispatched(ex.failed(first, 0.01, E5XX))
    fail = only(ex.failed(second, 0.02, E5XX), Fail)
    assert isinstance(fail, Fail) and "the request itself is the likely cause" in \
        fail.failure.message
    assert ex.verdict == ("request", 2)
    assert all(charged(b, n) == 0 for n in b.nodes)


def test_a_5xx_then_success_elsewhere_charges_the_first_node(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex = exchange(b)
    first = dispatched(ex.arrive(0.0))
    second = dispatched(ex.failed(first, 0.01, E5XX))
    assert charged(b, first.node_id) == 0  # not yet: whose fault?
    ex.first_chunk(second, 0.2)
    assert ex.verdict == ("node", 1) and charged(b, first.node_id) == 1
    ex.finished(second, 1.0, Outcome.OK, 50)


def hedged(b: Balancer) -> tuple[Exchange, Copy, Hedger]:
    """An exchange whose first copy is due a hedge at t = 0.5 (fixed delay)."""
    hedger = Hedger(HedgeConfig(enabled=True, after_s=0.5, require_silence=False))
    ex = exchange(b, hedger=hedger, priority=0)
    primary = dispatched(ex.arrive(0.0))
    timer = only(ex.sent(primary, 0.0), ArmTimer)
    assert isinstance(timer, ArmTimer) and timer.at == 0.5
    return ex, primary, hedger


def test_a_hedge_that_wins(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, primary, hedger = hedged(b)
    assert ex.timer(0.4) == ()  # early (a stale timer): nothing
    hedge = dispatched(ex.timer(0.5))
    assert hedge.hedge and hedge.node_id != primary.node_id
    assert hedge.ticket.node.in_flight == 1 and ex.in_flight == 2
    cancel = only(ex.first_chunk(hedge, 0.6), Cancel)
    assert isinstance(cancel, Cancel) and cancel.copy is primary
    assert ex.first_chunk(primary, 0.61) == ()  # the loser's late chunk: ignored
    ex.finished(hedge, 1.0, Outcome.OK, 50)
    assert (ex.hedge_result, hedger.hedges, hedger.wins) == ("won", 1, 1)


def test_a_hedge_that_loses(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, primary, hedger = hedged(b)
    hedge = dispatched(ex.timer(0.5))
    cancel = only(ex.first_chunk(primary, 0.55), Cancel)
    assert isinstance(cancel, Cancel) and cancel.copy is hedge
    ex.finished(primary, 1.0, Outcome.OK, 50)
    assert ex.finished(hedge, 1.1, Outcome.OK, 50) == ()  # cancelled: ignored
    assert (ex.hedge_result, hedger.wins) == ("lost", 0)


def test_both_copies_failing_then_a_retry(settled: list[Balancer]) -> None:
    b = balancer(4)
    settled.append(b)
    ex, primary, _ = hedged(b)
    hedge = dispatched(ex.timer(0.5))
    assert ex.failed(primary, 0.6, CONNECT) == ()  # the hedge races on
    retry = dispatched(ex.failed(hedge, 0.7, CONNECT))
    assert retry.node_id not in (primary.node_id, hedge.node_id)
    assert ex.hedge_result == "failed"
    assert ex.timer(10.0) == ()  # one hedge per exchange
    ex.first_chunk(retry, 0.9)
    ex.finished(retry, 1.5, Outcome.OK, 50)
    assert ex.ended == "ok"


def test_the_client_leaving_mid_race(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, primary, _ = hedged(b)
    hedge = dispatched(ex.timer(0.5))
    gone = ex.client_gone(0.6)
    assert {a.copy for a in gone if isinstance(a, Cancel)} == {primary, hedge}
    assert ex.ended == "client_gone"
    assert ex.failed(primary, 0.7, CONNECT) == () and ex.client_gone(0.8) == ()


def test_the_hedge_carries_the_priority(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    seen: list[int] = []
    pick = b.pick

    def spy(*args: object, **kw: object) -> object:
        seen.append(args[4] if len(args) > 4 else kw.get("priority", 1))  # type: ignore[arg-type]
        return pick(*args, **kw)  # type: ignore[arg-type]

    b.pick = spy  # type: ignore[method-assign]
    ex, primary, _ = hedged(b)
    hedge = dispatched(ex.timer(0.5))
    ex.client_gone(0.6)
    assert seen == [0, 0] and hedge is not primary


def one_slot_and_a_waiter(settled: list[Balancer], ttft_s: float = 30.0
                          ) -> tuple[Balancer, Exchange, Copy, Exchange]:
    """One node with a limit of one, held by ``holder``; ``waiting`` queued behind it."""
    b = balancer(1, limit=1, queue=True)
    settled.append(b)
    holder = exchange(b)
    first = dispatched(holder.arrive(0.0))
    waiting = exchange(b, ttft_s=ttft_s)
    q = only(waiting.arrive(0.0), Queue)
    assert isinstance(q, Queue) and q.waiter.payload is waiting
    return b, holder, first, waiting


def test_queued_then_shed(settled: list[Balancer]) -> None:
    b, holder, first, waiting = one_slot_and_a_waiter(settled, ttft_s=0.5)
    decisions = pump(b, 1.0)  # past its deadline
    assert len(decisions) == 1 and decisions[0][0] is waiting
    refuse = only(decisions[0][1], Refuse)
    assert isinstance(refuse, Refuse) and refuse.shed.reason == "expired"
    assert waiting.ended == "shed"
    holder.first_chunk(first, 1.1)
    holder.finished(first, 2.0, Outcome.OK, 50)


def test_queued_then_placed_when_a_permit_frees(settled: list[Balancer]) -> None:
    b, holder, first, waiting = one_slot_and_a_waiter(settled)
    holder.finished(first, 0.5, Outcome.OK, 1)
    (ex, actions), = pump(b, 0.5)
    assert ex is waiting
    copy = dispatched(actions)
    waiting.finished(copy, 1.0, Outcome.OK, 1)


def test_queued_then_the_client_leaves(settled: list[Balancer]) -> None:
    b, holder, first, waiting = one_slot_and_a_waiter(settled)
    assert waiting.client_gone(0.2) == ()
    assert b.pools[MODEL].queue is not None and b.pools[MODEL].queue.length == 0
    holder.finished(first, 0.5, Outcome.OK, 1)
    assert pump(b, 0.5) == []  # nobody left to place


def test_a_decision_for_an_exchange_that_ended_gives_the_permit_back(
        settled: list[Balancer]) -> None:
    b, holder, first, waiting = one_slot_and_a_waiter(settled)
    holder.finished(first, 0.5, Outcome.OK, 1)
    (ex, actions), = pump(b, 0.5)
    assert ex is waiting
    copy = dispatched(actions)
    waiting.client_gone(0.6)  # before its driver sent it
    assert copy.state == 2 and b.nodes["n0"].in_flight == 0


def test_no_capacity_and_committed_failure(settled: list[Balancer]) -> None:
    b = balancer(2)
    settled.append(b)
    for n in b.nodes:
        b.set_state(n, NodeState.DOWN, Actor.HEALTH)
    ex = exchange(b)
    fail = only(ex.arrive(0.0), Fail)
    assert isinstance(fail, Fail) and fail.failure.status == 503 and fail.node_id is None
    b.set_state("n0", NodeState.HEALTHY, Actor.HEALTH)
    ex = exchange(b)
    copy = dispatched(ex.arrive(1.0))
    ex.first_chunk(copy, 1.1)
    fail = only(ex.failed(copy, 1.5, CONNECT, output_tokens=7), Fail)
    assert isinstance(fail, Fail) and fail.committed  # after the first byte: no retry
    assert ex.ended == "failed"


# -- the endpoint picker's events: a fallback list, and the data plane walking it ----


def test_fallbacks_are_the_retry_order_and_take_no_permit(settled: list[Balancer]) -> None:
    b = balancer(4)
    settled.append(b)
    ex = exchange(b)
    first = dispatched(ex.arrive(0.0))
    listed = ex.fallbacks(0.0)
    assert len(listed) == 2 and first.node_id not in listed  # attempts 3: two more
    assert len(set(listed)) == 2
    assert sum(n.in_flight for n in b.nodes.values()) == 1
    assert ex.fallbacks(0.0) == listed  # the same again: ranking moved no policy state
    twin = balancer(4)  # the same, without the ranking: the next request goes to the same node
    twin_first = dispatched(exchange(twin).arrive(0.0))
    nxt, twin_next = exchange(b), exchange(twin)
    assert dispatched(nxt.arrive(0.0)).node_id == dispatched(twin_next.arrive(0.0)).node_id
    for e, t in ((nxt, 0.1), (twin_next, 0.1)):
        e.client_gone(t)
    twin.on_finish(twin_first.ticket, 0.1, Outcome.CLIENT_CANCELLED, 0)
    for kw in ({"attempts": 1}, {"budget": RetryBudget(0.0, 0.0)}):  # no retry left
        other = exchange(b, **kw)
        copy = dispatched(other.arrive(0.0))
        assert other.fallbacks(0.0) == []
        other.client_gone(0.1)
        assert copy.state == 2
    ex.client_gone(0.1)


def test_redirected_moves_the_permit_and_charges_the_first_node(
        settled: list[Balancer]) -> None:
    b = balancer(3)
    settled.append(b)
    ex = exchange(b)
    first = dispatched(ex.arrive(0.0))
    target = ex.fallbacks(0.0)[1]  # the data plane passed over two: the second fallback
    second = dispatched(ex.redirected(first, target, 0.01, E5XX))
    assert second.node_id == target and b.nodes[first.node_id].in_flight == 0
    assert b.nodes[target].in_flight == 1
    assert ex.first_chunk(second, 0.2) == ()
    assert ex.finished(second, 1.0, Outcome.OK, 50) == ()
    assert ex.verdict == ("node", 1) and charged(b, first.node_id) == 1
    assert ex.redirected(second, first.node_id, 1.1, E5XX) == ()  # over: nothing more


def test_redirected_to_a_full_node_still_takes_its_permit(settled: list[Balancer]) -> None:
    b = balancer(2, limit=1)
    settled.append(b)
    busy = exchange(b)
    other = dispatched(busy.arrive(0.0))  # n? is now at its limit
    ex = exchange(b)
    first = dispatched(ex.arrive(0.0))
    assert first.node_id != other.node_id
    moved = dispatched(ex.redirected(first, other.node_id, 0.01, CONNECT))
    limiter = b.nodes[other.node_id].limiter
    assert limiter is not None and limiter.inflight == 2  # over its limit: it is there
    ex.finished(moved, 0.5, Outcome.OK, 10)
    busy.finished(other, 0.5, Outcome.OK, 10)


def test_failed_final_does_not_retry(settled: list[Balancer]) -> None:
    b = balancer(3)
    settled.append(b)
    ex = exchange(b)
    first = dispatched(ex.arrive(0.0))
    fail = only(ex.failed(first, 0.01, CONNECT, final=True), Fail)
    assert isinstance(fail, Fail) and ex.attempts == 1


def test_the_subset_excludes_nodes_from_every_copy(settled: list[Balancer]) -> None:
    b = balancer(3)
    settled.append(b)
    ex = Exchange(b, Request(MODEL, 100, 50, exclude=("n0", "n1")), RetryConfig(),
                  RetryConfig().new_budget())
    first = dispatched(ex.arrive(0.0))
    assert first.node_id == "n2" and ex.fallbacks(0.0) == []
    assert type(ex.failed(first, 0.01, CONNECT)[0]) is Fail  # no node left inside it


def test_the_core_classifies_how_a_stream_ended(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    served, errored, empty = exchange(b), exchange(b), exchange(b)
    copies = [dispatched(ex.arrive(0.0)) for ex in (served, errored, empty)]
    served.first_chunk(copies[0], 0.5)
    end = served.stream_ended(copies[0], 2.5, tokens=11)
    assert end.failure is None and end.tpot == pytest.approx(0.2) and served.ended == "ok"
    errored.first_chunk(copies[1], 0.5)
    end = errored.stream_ended(copies[1], 1.0, tokens=4, engine_error=True)
    assert end.failure is not None and not end.failure.judged and end.error == "engine_error"
    # committed: no retry; the answer so far continues on another node
    (moved,) = end.actions
    assert type(moved) is Migrate and moved.after == 4 and errored.phase is Phase.MOVING
    errored.client_gone(1.1)
    end = empty.stream_ended(copies[2], 1.0, tokens=0, data=False, final=True)
    assert end.failure is not None and end.failure.status == 502 and empty.ended == "failed"
    # An unjudged failure is charged to nobody without a second opinion.
    assert all(charged(b, c.node_id) == 0 for c in copies)
