"""Disaggregated prefill and decode in the core: a request's two legs through the
exchange (hand-off, failures, the client leaving), every permit ending once,
what each leg teaches, the pair choices of tailguard and of the peers' rules,
and record/replay of it all."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tailguard.core.balancer import Balancer, PoolConfig, Ticket
from tailguard.core.exchange import (
    Cancel,
    Decode,
    Dispatch,
    Exchange,
    Fail,
    Failure,
    Migrate,
    Phase,
    Request,
)
from tailguard.core.fleet import NodeSpec, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.kv_transfer import Link
from tailguard.core.limits import LimitConfig
from tailguard.core.migration import MigrationConfig
from tailguard.core.outliers import OutlierConfig
from tailguard.core.policies import RequestInfo, Slo
from tailguard.core.policies.pairs import DynamoConditional, DynamoOptions
from tailguard.core.replay import replay

MODEL = "llama-3.1-8b"
CONNECT = Failure(Outcome.CONNECT_FAILURE, 502, "cannot connect", "upstream_connect_failed")


def spec(node_id: str, gpu: str, role: str) -> NodeSpec:
    g = DEFAULT_CATALOG.gpu(gpu)
    return NodeSpec(node_id, g, g.name, models=(MODEL,), role=role)


def pd_balancer(policy: str = "tailguard", *, limits: bool = False,
                recorder: Any = None, link: Link | None = None,
                migration: bool = True) -> Balancer:
    specs = [spec("p0", "H100", "prefill"), spec("p1", "H100", "prefill"),
             spec("d0", "A100", "decode"), spec("d1", "A100", "decode")]
    moves = MigrationConfig(enabled=migration)
    pool = PoolConfig(MODEL, policy, slo=Slo(5.0, 0.1),
                      limits=LimitConfig(kind="fixed", initial=8) if limits else None,
                      migration=moves)
    if link is not None:
        pool = PoolConfig(MODEL, policy, slo=Slo(5.0, 0.1), kv_link=link, migration=moves)
    b = Balancer(specs, [pool], random.Random(0), recorder=recorder,
                 outliers=OutlierConfig())
    b.tick(0.0)
    return b


def settled(b: Balancer) -> None:
    """Nothing in flight anywhere, no permit released twice."""
    for n in b.nodes.values():
        assert (n.in_flight, n.prefilling, n.prefill_backlog, n.decoding, n.awaiting_kv) \
            == (0, 0, 0, 0, 0), n.id
        if n.limiter is not None:
            assert n.limiter.inflight == 0, n.id
    assert b.double_release == 0


def test_a_long_prompt_is_computed_on_a_prefill_node_and_decoded_elsewhere() -> None:
    b = pd_balancer()
    ex = Exchange(b, Request(MODEL, 12_000))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    copy = d.copy
    assert copy.prefill_node in ("p0", "p1") and copy.node_id in ("d0", "d1")
    pre = copy.ticket.prefill
    assert pre is not None
    p, dn = b.nodes[copy.prefill_node], b.nodes[copy.node_id]
    # The prompt is the prefill node's work; the decode node holds a place only.
    assert (p.in_flight, p.prefill_backlog) == (1, 12_000)
    assert (dn.in_flight, dn.prefill_backlog) == (1, 0)
    assert ex.sent(copy, 0.0) == ()  # no hedge for a two-leg request
    assert dn.awaited == [] or all(t is not copy.ticket for t in dn.awaited)
    (dec,) = ex.prefilled(copy, 0.9)
    assert isinstance(dec, Decode) and dec.copy is copy
    assert ex.prefilled(copy, 0.9) == ()  # once
    assert copy.ticket.prefill is None and pre.released
    assert p.in_flight == 0 and p.capacity.prefill.samples == 1
    # The decode node is not held to the hand-off's first token (the link may be
    # why it is late): the pair's link is judged by it instead.
    assert copy.ticket.due == float("inf") and copy.ticket.kv_from == copy.prefill_node
    assert copy.ticket.kv_s > 0.0
    assert ex.first_chunk(copy, 0.95) == ()
    assert b.links is not None and b.links.samples == 1
    assert ex.phase is Phase.STREAMING
    assert dn.capacity.prefill.samples == 0  # its prompt was not computed there
    ex.finished(copy, 12.0, Outcome.OK, 300)
    assert dn.capacity.decode.samples == 1
    assert b.pools[MODEL].mean_output > 200.0  # the prefill leg's one token is no answer
    settled(b)


def test_a_short_prompt_stays_on_its_decode_node() -> None:
    b = pd_balancer()
    t = b.pick(MODEL, 40, 0.0)
    assert t is not None and t.prefill is None and t.node_id in ("d0", "d1")
    assert t.backlog == 40  # computed there: its own work
    b.on_first_token(t, 0.05)
    b.on_finish(t, 1.0, Outcome.OK, 20)
    settled(b)


def test_a_slow_link_keeps_prompts_local() -> None:
    # Over a 0.1 GB/s link an 8k prompt's KV (1 GB) takes 10 s: worse than
    # computing it beside the decodes.
    slow = pd_balancer(link=Link(0.1, 0.01))
    t = slow.pick(MODEL, 8_000, 0.0)
    assert t is not None and t.prefill is None
    fast = pd_balancer()
    t = fast.pick(MODEL, 8_000, 0.0)
    assert t is not None and t.prefill is not None


def test_a_prompt_computed_beside_requests_awaiting_their_kv_goes_to_a_prefill_node() -> None:
    # Its chunks would fill the decode node's steps, and a request whose KV arrives
    # meanwhile waits them out: the same prompt, with the same prefill backlogs,
    # stays on its decode node only where no request there awaits its KV.
    quiet = pd_balancer()
    quiet.take(MODEL, "p0", 24_000, 0.0)
    quiet.take(MODEL, "p1", 24_000, 0.0)
    t = quiet.pick(MODEL, 8_000, 0.0)
    assert t is not None and t.prefill is None
    awaited = pd_balancer()
    for _ in range(4):  # two long prompts on each prefill node, their KV due on d0 and d1
        w = awaited.pick(MODEL, 12_000, 0.0)
        assert w is not None and w.prefill is not None
    assert [awaited.nodes[n].prefill_backlog for n in ("p0", "p1")] == [24_000, 24_000]
    t = awaited.pick(MODEL, 8_000, 0.0)
    assert t is not None and t.prefill is not None


def test_a_failed_prefill_leg_is_charged_to_its_node_and_retried_elsewhere() -> None:
    b = pd_balancer()
    ex = Exchange(b, Request(MODEL, 12_000))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    first = d.copy
    bad = first.prefill_node
    (retry,) = ex.prefill_failed(first, 0.1, CONNECT)
    assert isinstance(retry, Dispatch) and retry.retry_of is Outcome.CONNECT_FAILURE
    assert retry.copy.prefill_node != bad  # the decode node may be the same
    assert b.outliers is not None
    assert b.outliers.health[bad].consecutive_failures == 1
    assert b.outliers.health[first.node_id].consecutive_failures == 0
    ex.prefilled(retry.copy, 1.0)
    ex.first_chunk(retry.copy, 1.1)
    ex.finished(retry.copy, 5.0, Outcome.OK, 100)
    settled(b)


def test_a_client_leaving_during_the_prefill_leg_cancels_both_legs() -> None:
    b = pd_balancer(limits=True)
    ex = Exchange(b, Request(MODEL, 12_000))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    assert b.nodes[d.copy.prefill_node].limiter.inflight == 1  # type: ignore[index, union-attr]
    assert b.nodes[d.copy.node_id].limiter.inflight == 1  # type: ignore[union-attr]
    (c,) = ex.client_gone(0.5)
    assert isinstance(c, Cancel) and c.copy is d.copy
    assert ex.prefilled(d.copy, 0.9) == ()  # a late answer changes nothing
    settled(b)


def test_a_decode_leg_failure_after_the_hand_off_is_the_decode_nodes() -> None:
    b = pd_balancer()
    ex = Exchange(b, Request(MODEL, 12_000))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    ex.prefilled(d.copy, 0.8)
    ex.first_chunk(d.copy, 0.9)
    # the stream moves: a continuation to a decode node other than the one that failed
    (m,) = ex.failed(d.copy, 3.0, CONNECT, output_tokens=40)
    assert isinstance(m, Migrate) and m.after == 40 and m.copy.node_id != d.copy.node_id
    ex.client_gone(3.1)
    # without migration, the committed failure ends the stream, named after the decode node
    b = pd_balancer(migration=False)
    ex = Exchange(b, Request(MODEL, 12_000))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    ex.prefilled(d.copy, 0.8)
    ex.first_chunk(d.copy, 0.9)
    (f,) = ex.failed(d.copy, 3.0, CONNECT, output_tokens=40)
    assert isinstance(f, Fail) and f.committed and f.node_id == d.copy.node_id
    settled(b)


def test_dynamos_rule_computes_short_or_cached_prompts_on_the_decode_node() -> None:
    rule = DynamoConditional()
    assert not rule.remote(RequestInfo(MODEL, 1_000), "d0")
    assert rule.remote(RequestInfo(MODEL, 3_000), "d0")
    assert not rule.remote(RequestInfo(MODEL, 3_000, cached={"d0": 1_500}), "d0")
    assert rule.remote(RequestInfo(MODEL, 9_000, cached={"d1": 8_000}), "d0")
    assert not DynamoConditional(options=DynamoOptions(max_local_prefill_length=4_000)).remote(
        RequestInfo(MODEL, 3_000), "d0")
    b = pd_balancer("dynamo")
    short, long = b.pick(MODEL, 500, 0.0), b.pick(MODEL, 5_000, 0.0)
    assert short is not None and short.prefill is None
    assert long is not None and long.prefill is not None


def test_a_single_node_policy_routes_phase_by_phase() -> None:
    # vllm-router's P/D with round robin: every prompt on the prefill side, each
    # phase taking its own turns.
    b = pd_balancer("round_robin")
    got = [b.pick(MODEL, 100, 0.0) for _ in range(4)]
    assert all(t is not None and t.prefill is not None for t in got)
    assert [t.prefill.node_id for t in got if t and t.prefill] == ["p0", "p1", "p0", "p1"]
    assert [t.node_id for t in got if t] == ["d0", "d1", "d0", "d1"]


def test_a_node_spec_refuses_an_unknown_role() -> None:
    with pytest.raises(ValueError, match="role"):
        spec("x", "H100", "encode")


def drive(seed: int) -> list[dict[str, Any]]:
    log: list[dict[str, Any]] = []
    b = pd_balancer(recorder=log.append)
    rng = random.Random(seed)
    now = 0.0
    live: list[Exchange] = []
    for step in range(300):
        now += rng.expovariate(5.0)
        ex = Exchange(b, Request(MODEL, rng.choice([50, 800, 4_000, 20_000])))
        (d,) = ex.arrive(now)
        if isinstance(d, Dispatch):
            live.append(ex)
        for ex in list(live):
            copy = ex.copies[-1]
            r = rng.random()
            if copy.ticket.prefill is not None:
                if r < 0.4:
                    for a in ex.prefilled(copy, now):
                        assert isinstance(a, Decode)
                elif r < 0.45:
                    ex.prefill_failed(copy, now, CONNECT)
            elif ex.phase is Phase.TRYING and r < 0.5:
                ex.first_chunk(copy, now)
            elif ex.phase is Phase.STREAMING and r < 0.3:
                ex.finished(copy, now, Outcome.OK, rng.randint(10, 400))
            elif r > 0.98:
                ex.client_gone(now)
            if ex.phase is Phase.ENDED:
                live.remove(ex)
        if step % 25 == 0:
            b.tick(now)
    for ex in live:
        ex.client_gone(now + 1.0)
    settled(b)
    return [json.loads(json.dumps(r)) for r in log]


def test_replay_reproduces_pair_choices_and_hand_offs() -> None:
    log = drive(5)
    ops = {r["op"] for r in log}
    assert "hand_off" in ops
    assert any(r["op"] == "pick" and r.get("prefill") for r in log)
    res = replay(log)
    assert res.differences == []
    changed = next(i for i, r in enumerate(log) if r["op"] == "pick" and r.get("prefill"))
    log[changed]["prefill"]["node"] = "elsewhere"
    assert [d["record"] for d in replay(log).differences][:1] == [changed]


def test_tickets_name_their_legs() -> None:
    b = pd_balancer()
    t = b.pick(MODEL, 20_000, 0.0)
    assert isinstance(t, Ticket) and t.prefill is not None
    assert t.leg == 2 and t.prefill.leg == 1 and t.backlog == 0
    b.on_finish(t, 0.5, Outcome.CLIENT_CANCELLED, 0)  # ends the pending prefill leg too
    assert t.prefill is None
    settled(b)


def test_a_link_is_flagged_slow_on_most_of_its_recent_hand_offs_and_recovers() -> None:
    from tailguard.core.outliers.links import LinkWatch

    watch = LinkWatch()
    prices: dict[tuple[str, str], float] = {}
    # Healthy: 20 ms transfers, 30 ms steps, up to two steps of noise.
    for i in range(10):
        watch.on_hand_off("p", "d", 0.020 + 0.030 + 0.03 * (i % 3) / 2, 0.020, 0.030, i)
    assert watch.tick(10.0, prices) == [] and prices == {}
    # Ten times slower: flagged at the fourth slow hand-off, priced at ~10x.
    for i in range(4):
        watch.on_hand_off("p", "d", 0.200 + 0.030, 0.020, 0.030, 11.0 + i)
    (ev,) = watch.tick(15.0, prices)
    assert (ev.node, ev.kind, ev.state) == ("p->d", "link", "slow") and "10.0x" in ev.reason
    assert prices[("p", "d")] == pytest.approx(10.0)
    # Unused, its price eases back (the router tries it again); six clean ones clear it.
    watch.tick(15.0 + 60.0, prices)
    assert 1.0 < prices[("p", "d")] < 10.0 ** 0.3
    for i in range(6):
        watch.on_hand_off("p", "d", 0.055, 0.020, 0.030, 80.0 + i)
    (ev,) = watch.tick(90.0, prices)
    assert ev.state == "recovered" and prices == {}


def test_cache_aware_remembers_each_phase_where_it_went() -> None:
    # vllm-router's cache_aware per phase: a repeated prefix returns to the same
    # prefill node and the same decode node.
    b = pd_balancer("cache_aware")
    prefix = tuple(range(1, 40))
    first = b.pick(MODEL, 5_000, 0.0, prefix=prefix)
    assert first is not None and first.prefill is not None
    again = b.pick(MODEL, 5_000, 0.1, prefix=prefix)
    assert again is not None and again.prefill is not None
    assert (again.node_id, again.prefill.node_id) == (first.node_id, first.prefill.node_id)
