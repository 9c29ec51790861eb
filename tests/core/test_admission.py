"""The admission queue: order, bounds, shedding, cancellation, late binding."""

from __future__ import annotations

import math
import random

from tailguard.core.admission import (
    AdmissionConfig,
    AdmissionQueue,
    Shed,
    Waiter,
)
from tailguard.core.balancer import Balancer, PoolConfig, Ticket
from tailguard.core.fleet import NodeSpec, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.limits import LimitConfig
from tailguard.core.policies import Slo

MODEL = "llama-3.1-8b"


def w(priority: int, deadline: float, size: int = 0, tag: str = "") -> Waiter:
    return Waiter(MODEL, 100, None, priority, 0.0, deadline, size, payload=tag)


def drain(q: AdmissionQueue) -> list[str]:
    out = []
    while q.peek() is not None:
        out.append(q.pop().payload)
    return out


def test_order_is_priority_then_deadline_then_arrival() -> None:
    q = AdmissionQueue(AdmissionConfig(shed_on_predicted_wait=False))
    for item in (w(1, 5.0, tag="n5"), w(2, 1.0, tag="l1"), w(1, 3.0, tag="n3"),
                 w(0, 9.0, tag="h9"), w(1, 3.0, tag="n3b")):
        assert q.offer(item, 0.0) == (None, [])
    assert drain(q) == ["h9", "n3", "n3b", "n5", "l1"]
    assert q.length == 0 and q.bytes == 0


def test_full_queue_displaces_lower_priority_only() -> None:
    q = AdmissionQueue(AdmissionConfig(queue_max=2, shed_on_predicted_wait=False))
    low, normal = w(2, 1.0, tag="low"), w(1, 1.0, tag="normal")
    q.offer(low, 0.0)
    q.offer(normal, 0.0)
    shed, gone = q.offer(w(2, 0.5, tag="late-low"), 0.0)
    assert shed is not None and shed.reason == "queue_full" and gone == []
    shed, gone = q.offer(w(0, 2.0, tag="high"), 0.0)
    assert shed is None and gone == [low] and low.state == "shed"
    assert drain(q) == ["high", "normal"]


def test_byte_bound() -> None:
    q = AdmissionQueue(AdmissionConfig(queue_max_bytes=1000, shed_on_predicted_wait=False))
    assert q.offer(w(1, 1.0, 600), 0.0)[0] is None
    shed, _ = q.offer(w(1, 1.0, 600), 0.0)
    assert shed is not None and shed.reason == "queue_full"
    assert q.bytes == 600


def test_predicted_wait_sheds_by_deadline() -> None:
    q = AdmissionQueue(AdmissionConfig(rate_tau_s=5.0))
    for i in range(100):  # 20 releases/s over 5 s
        q.on_release(i * 0.05)
    now = 5.0
    rate = q.drain_rate(now)
    assert 10.0 < rate < 20.0  # the decayed count still remembers most of the 5 s
    for _ in range(30):
        q.offer(w(1, now + 100.0), now)
    # normal: 31 ahead-or-self at `rate`/s
    shed, _ = q.offer(w(1, now + 30 / rate), now)
    assert shed is not None and shed.reason == "deadline"
    assert shed.retry_after_s == math.ceil(30 / rate)
    # high: only itself ahead
    assert q.offer(w(0, now + 2 / rate), now)[0] is None


def test_cancel_leaves_at_once_and_expire() -> None:
    q = AdmissionQueue(AdmissionConfig(shed_on_predicted_wait=False))
    a, b, c = w(1, 1.0, 10, "a"), w(1, 2.0, 10, "b"), w(1, 3.0, 10, "c")
    for x in (a, b, c):
        q.offer(x, 0.0)
    assert q.cancel(b) and not q.cancel(b)
    assert (q.length, q.bytes) == (2, 20)
    assert q.expire(1.5) == [a]
    assert drain(q) == ["c"]


def _balancer(queue_max: int = 16) -> Balancer:
    specs = [NodeSpec("a", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))]
    pool = PoolConfig(MODEL, "least_request", slo=Slo(2.0, 0.1),
                      limits=LimitConfig(kind="fixed", initial=1),
                      admission=AdmissionConfig(queue_max=queue_max))
    return Balancer(specs, [pool], random.Random(0))


def test_late_binding_through_the_balancer() -> None:
    b = _balancer()
    first = b.admit(MODEL, 100, 0.0)
    assert isinstance(first, Ticket)
    low = b.admit(MODEL, 100, 0.1, priority=2, payload="low")
    high = b.admit(MODEL, 100, 0.2, priority=0, payload="high")
    assert isinstance(low, Waiter) and isinstance(high, Waiter)
    assert b.poll_queue(0.3) == []
    b.on_finish(first, 0.5, Outcome.OK, 10)
    decisions = b.poll_queue(0.5)
    assert len(decisions) == 1 and decisions[0][0] is high
    ticket = decisions[0][1]
    assert isinstance(ticket, Ticket) and ticket.node_id == "a"
    assert b.cancel_queued(low)
    b.on_finish(ticket, 0.9, Outcome.OK, 10)
    assert b.poll_queue(1.0) == [] and b.nodes["a"].in_flight == 0


def test_expired_and_displaced_requests_come_back_as_sheds() -> None:
    b = _balancer(queue_max=1)
    t = b.admit(MODEL, 100, 0.0)
    assert isinstance(t, Ticket)
    low = b.admit(MODEL, 100, 0.0, priority=2)
    normal = b.admit(MODEL, 100, 0.0, ttft_s=0.5)
    assert isinstance(low, Waiter) and isinstance(normal, Waiter)
    decisions = b.poll_queue(0.1)
    assert [(x, type(d)) for x, d in decisions] == [(low, Shed)]
    assert isinstance(decisions[0][1], Shed) and decisions[0][1].reason == "displaced"
    decisions = b.poll_queue(0.6)
    assert len(decisions) == 1 and decisions[0][0] is normal
    assert isinstance(decisions[0][1], Shed) and decisions[0][1].reason == "expired"
    # limits without a queue: shed at once
    b2 = Balancer([NodeSpec("a", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))],
                  [PoolConfig(MODEL, limits=LimitConfig(kind="fixed", initial=1))],
                  random.Random(0))
    assert isinstance(b2.admit(MODEL, 10, 0.0), Ticket)
    shed = b2.admit(MODEL, 10, 0.0)
    assert isinstance(shed, Shed) and shed.reason == "no_capacity"


def test_queued_dispatches_replay_exactly() -> None:
    """Picks made by late binding are recorded like any pick and replay the same."""
    from tailguard.core.replay import replay

    log: list[dict[str, object]] = []
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu(g), DEFAULT_CATALOG.gpu(g).name,
                      models=(MODEL,)) for i, g in enumerate(["H100", "L4", "A100"])]
    b = Balancer(specs, [PoolConfig(MODEL, "tailguard", slo=Slo(1.0, 0.1),
                                    limits=LimitConfig(kind="gradient", initial=3,
                                                       update_every=2),
                                    admission=AdmissionConfig(queue_max=8))],
                 random.Random(5), recorder=log.append)
    rng = random.Random(6)
    running: list[Ticket] = []
    now, queued, shed = 0.0, 0, 0
    for _ in range(300):
        now += rng.expovariate(30.0)
        got = b.admit(MODEL, rng.randint(50, 2000), now, priority=rng.randint(0, 2))
        if isinstance(got, Ticket):
            running.append(got)
        queued += isinstance(got, Waiter)
        shed += isinstance(got, Shed)
        if running and rng.random() < 0.7:
            t = running.pop(0)
            b.on_first_token(t, now)
            b.on_finish(t, now + 0.01, Outcome.OK, rng.randint(2, 300))
        for _w, d in b.poll_queue(now + 0.01):
            if isinstance(d, Ticket):
                running.append(d)
    assert queued > 20 and shed > 0
    result = replay(log)
    assert result.differences == [] and result.decisions > 200


def _one_node(limit: int) -> Balancer:
    specs = [NodeSpec("a", DEFAULT_CATALOG.gpu("H100"), "H100-SXM", models=(MODEL,))]
    pool = PoolConfig(MODEL, "least_request", slo=Slo(5.0, 0.1),
                      limits=LimitConfig(kind="fixed", initial=limit),
                      admission=AdmissionConfig(queue_max=16))
    return Balancer(specs, [pool], random.Random(0))


def test_lower_priorities_leave_a_reserve_only_while_higher_ones_arrive() -> None:
    b = _one_node(10)
    got = [b.admit(MODEL, 10, 0.0) for _ in range(11)]
    assert [isinstance(g, Ticket) for g in got] == [True] * 10 + [False]  # normal alone: all 10
    b = _one_node(10)
    first_high = b.admit(MODEL, 10, 0.0, priority=0)
    assert isinstance(first_high, Ticket)
    got = [b.admit(MODEL, 10, 0.1) for _ in range(10)]
    assert [isinstance(g, Ticket) for g in got] == [True] * 8 + [False] * 2  # 9 of 10 in use
    assert isinstance(b.admit(MODEL, 10, 0.2, priority=0), Ticket)  # the reserve
    assert b.nodes["a"].in_flight == 10


def test_a_long_prompt_backlog_holds_requests_in_the_queue() -> None:
    b = _one_node(100)
    node = b.nodes["a"]
    # ~2.3 s of prefill ahead at the roofline (8B on an H100: ~23 us a token).
    big = b.admit(MODEL, 100_000, 0.0, ttft_s=5.0)
    assert isinstance(big, Ticket) and node.prefill_backlog == 100_000
    held = b.admit(MODEL, 1000, 0.0, ttft_s=1.0)
    assert isinstance(held, Waiter)  # room under the limit, but it would miss 1 s
    b.on_first_token(big, 2.0)  # the backlog is gone: the waiter goes at once
    decisions = b.poll_queue(2.0)
    assert [(w, isinstance(d, Ticket)) for w, d in decisions] == [(held, False)]
    assert isinstance(decisions[0][1], Shed)  # ... unless its deadline has passed
    again = b.admit(MODEL, 1000, 2.1, ttft_s=1.0)
    assert isinstance(again, Ticket)


def test_the_ttft_check_prices_a_prompt_at_chunked_prefill_beside_decodes() -> None:
    # An L4 alone prefills 4000 tokens in 0.81 s (roofline). With 16
    # sequences decoding, a step that keeps the TPOT target (0.9 x 0.1 s)
    # carries at most 439 prompt tokens: ceil(4000 / 439) = 10 steps, 0.9 s.
    def l4() -> Balancer:
        specs = [NodeSpec("a", DEFAULT_CATALOG.gpu("L4"), "L4", models=(MODEL,))]
        pool = PoolConfig(MODEL, "least_request", slo=Slo(1.0, 0.1),
                          limits=LimitConfig(kind="fixed", initial=40),
                          admission=AdmissionConfig())
        return Balancer(specs, [pool], random.Random(0))

    assert isinstance(l4().admit(MODEL, 4000, 0.0, ttft_s=0.85), Ticket)
    b = l4()
    running = [b.admit(MODEL, 100, 0.0) for _ in range(16)]
    for t in running:
        assert isinstance(t, Ticket)
        b.on_first_token(t, 0.5)
    assert b.nodes["a"].prefill_backlog == 0
    assert isinstance(b.admit(MODEL, 4000, 0.6, ttft_s=0.85), Waiter)
    # 7 steps, 0.63 s: in time (high, so it does not queue behind the waiter).
    assert isinstance(b.admit(MODEL, 3000, 0.6, priority=0, ttft_s=0.85), Ticket)


def test_reload_keeps_queued_requests_and_in_flight_permits() -> None:
    b = _balancer()
    running = b.admit(MODEL, 100, 0.0)
    waiting = b.admit(MODEL, 100, 0.0)
    assert isinstance(running, Ticket) and isinstance(waiting, Waiter)
    b.replace_pool(PoolConfig(MODEL, "least_request", slo=Slo(2.0, 0.1),
                              limits=LimitConfig(kind="fixed", initial=2),
                              admission=AdmissionConfig(queue_max=16)))
    limiter = b.nodes["a"].limiter
    assert limiter is not None and limiter.limit == 2 and limiter.inflight == 1
    decisions = b.poll_queue(0.1)
    assert len(decisions) == 1 and decisions[0][0] is waiting
    assert isinstance(decisions[0][1], Ticket)
    third = b.admit(MODEL, 100, 0.2)
    assert isinstance(third, Waiter)
    b.replace_pool(PoolConfig(MODEL, "least_request"))  # limits and queue removed
    assert b.nodes["a"].limiter is None
    shed = b.poll_queue(0.3)
    assert [(w, isinstance(d, Shed)) for w, d in shed] == [(third, True)]
    assert isinstance(b.admit(MODEL, 100, 0.4), Ticket)


def test_cold_queue_does_not_shed_on_an_unwarmed_drain_rate() -> None:
    # Releases at 10/s from t = 1 (the first requests took a second to finish).
    q = AdmissionQueue(AdmissionConfig(rate_tau_s=5.0))
    for i in range(11):
        q.on_release(1.0 + i * 0.1)
    # The decayed count over a 1 s span is corrected for the 4 s it has not
    # seen (it read ~2/s without): the estimate is the rate itself.
    assert 9.0 < q.drain_rate(2.0) < 13.0
    for _ in range(30):
        assert q.offer(w(1, 100.0), 2.0)[0] is None
    # 31 ahead at ~11/s is ~2.8 s past a 1 s deadline, but one second of
    # releases is no basis to refuse a request: it waits and expires instead.
    assert q.offer(w(1, 3.0), 2.0)[0] is None and not q.warmed(2.0)
    assert q.warmed(6.0)
    shed, _ = q.offer(w(1, 7.0), 6.0)
    assert shed is not None and shed.reason == "deadline"
