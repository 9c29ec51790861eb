"""The core's prefix index and prefix-aware routing: hits priced as prefill saved,
learning from reported cached tokens, cache_aware's rules, replay with prefixes."""

from __future__ import annotations

import json
import random
from typing import Any

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import Actor, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.prefix import PrefixIndex
from tailguard.core.replay import replay

MODEL = "llama-3.1-8b"
BT = 128


def _balancer(policy: str, gpus: list[str], log: list[dict[str, Any]] | None = None) -> Balancer:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu(g), DEFAULT_CATALOG.gpu(g).name,
                      models=(MODEL,)) for i, g in enumerate(gpus)]
    return Balancer(specs, [PoolConfig(MODEL, policy, prefix_block_tokens=BT)],
                    random.Random(1), recorder=log.append if log is not None else None)


def _chain(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# -- the index ---------------------------------------------------------------------------


def test_match_counts_each_nodes_leading_blocks() -> None:
    ix = PrefixIndex(BT)
    ix.insert("a", _chain(1, 10))
    ix.insert("b", _chain(1, 4))
    ix.insert("c", (1, 2, 99))
    assert ix.match(_chain(1, 12)) == {"a": 10, "b": 4, "c": 2}
    assert ix.match((999, 1, 2)) == {}  # a match starts at the first block
    assert ix.match(()) == {}


def test_a_node_holds_at_most_its_estimated_cache_and_the_head_outlives_the_tail() -> None:
    ix = PrefixIndex(BT)
    ix.set_kv("a", 20 * BT)
    ix.insert("a", _chain(1, 15))  # a system prompt and one conversation
    ix.insert("a", _chain(100, 10))  # another conversation: 25 > 20, 5 oldest go
    assert ix.blocks_at("a") == 20
    # The first chain's tail went first (inserted tail first, as engines free it).
    assert ix.match(_chain(1, 15)) == {"a": 10}
    assert ix.match(_chain(100, 10)) == {"a": 10}


def test_reports_shrink_grow_and_correct_the_index() -> None:
    ix = PrefixIndex(BT)
    ix.set_kv("a", 1000 * BT)
    ix.insert("a", _chain(1, 100))
    ix.observe("a", _chain(1, 100), predicted=100, cached_tokens=40 * BT)  # it had evicted
    assert ix.capacity("a") == 80.0  # what it held there, times shrink 0.8
    assert ix.blocks_at("a") == 80
    before = ix.capacity("a")
    ix.observe("a", _chain(1, 50), predicted=50, cached_tokens=50 * BT)
    assert ix.capacity("a") > before  # a confirmed hit grows it back
    grown = ix.capacity("a")
    ix.observe("a", _chain(1, 10), predicted=10, cached_tokens=9 * BT + 100)  # block alignment
    assert ix.capacity("a") >= grown  # one block short is not an eviction
    ix.observe("a", _chain(500, 8), predicted=0, cached_tokens=8 * BT)  # sent by someone else
    assert ix.match(_chain(500, 8)) == {"a": 8}
    ix.forget("a")
    assert ix.match(_chain(1, 10)) == {} and len(ix) == 0


# -- routing ---------------------------------------------------------------------------


def test_tailguard_prefers_the_node_holding_the_prefix_and_spills_when_it_is_busy() -> None:
    b = _balancer("tailguard", ["A100", "A100"])
    conv = _chain(1, 60)  # 7,680 tokens of history
    first = b.pick(MODEL, 60 * BT, 0.0, prefix=conv)
    assert first is not None
    home = first.node_id
    b.on_first_token(first, 0.5, defer_prefill=True)
    b.on_finish(first, 2.0, Outcome.OK, 200, cached_tokens=0)
    # The next turn: the whole history is cached at home, an uncached node must prefill it.
    again = b.pick(MODEL, 60 * BT + 100, 10.0, prefix=conv)
    assert again is not None and again.node_id == home
    assert again.hit_blocks == 60
    assert b.nodes[home].prefill_backlog == 100  # only the uncached part is queued
    b.on_first_token(again, 10.1, defer_prefill=True)
    b.on_finish(again, 11.0, Outcome.OK, 100, cached_tokens=60 * BT)
    assert b.nodes[home].prefill_backlog == 0
    # Home queued with long uncached prompts: the hot prefix goes (and is copied) elsewhere.
    for _ in range(20):
        b.take(MODEL, home, 8000, 12.0)
    elsewhere = b.pick(MODEL, 60 * BT + 100, 12.0, prefix=conv)
    assert elsewhere is not None and elsewhere.node_id != home
    assert elsewhere.backlog == 60 * BT + 100  # it prefills the whole prompt there
    assert set(b.pools[MODEL].index().match(conv)) == {"n0", "n1"}


def test_without_a_prefix_nothing_changes() -> None:
    b = _balancer("tailguard", ["H100", "L4"])
    t = b.pick(MODEL, 500, 0.0)
    assert t is not None and t.backlog == 500 and t.hit_blocks == 0
    assert b.pools[MODEL].prefix is None


def test_cache_aware_follows_its_tree_until_the_load_is_unbalanced() -> None:
    b = _balancer("cache_aware", ["L4", "H100", "A100"])
    conv = _chain(1, 10)
    first = b.pick(MODEL, 10 * BT, 0.0, prefix=conv)
    assert first is not None
    home = first.node_id  # every tree empty: the smallest is the first node
    assert home == "n0"
    # A match above cache_threshold (0.3) goes home whatever the hardware.
    assert b.pick(MODEL, 10 * BT, 0.0, prefix=conv).node_id == home  # type: ignore[union-attr]
    # A new prompt goes to the smallest tree.
    other = b.pick(MODEL, 10 * BT, 0.0, prefix=_chain(500, 10))
    assert other is not None and other.node_id != home
    # Imbalanced (max - min > 64 and max > 1.5 x min): the least loaded wins.
    for _ in range(70):
        b.take(MODEL, home, 100, 0.0)
    assert b.nodes[home].in_flight > 64
    t = b.pick(MODEL, 10 * BT, 0.0, prefix=conv)
    assert t is not None and t.node_id != home


def test_a_recording_with_prefixes_replays_identically() -> None:
    for policy in ("tailguard", "cache_aware", "consistent_hash"):
        log: list[dict[str, Any]] = []
        b = _balancer(policy, ["H100", "A100", "L4"], log)
        rng = random.Random(3)
        sessions = [_chain(1000 * s, rng.randint(1, 30)) for s in range(12)]
        open_tickets = []
        now = 0.0
        for _ in range(300):
            now += rng.expovariate(10.0)
            s = rng.randrange(len(sessions))
            conv = sessions[s]
            t = b.pick(MODEL, len(conv) * BT + 50, now, prefix=conv, session=f"s{s}")
            if t is not None:
                open_tickets.append(t)
            if open_tickets and rng.random() < 0.7:
                t = open_tickets.pop(rng.randrange(len(open_tickets)))
                b.on_first_token(t, now + 0.05, defer_prefill=True)
                b.on_finish(t, now + 0.5, Outcome.OK, 64,
                            cached_tokens=rng.randint(0, t.hit_blocks) * BT)
        records = [json.loads(json.dumps(r)) for r in log]
        assert any("prefix" in r for r in records) and any("session" in r for r in records)
        res = replay(records)
        assert res.decisions >= 300
        assert res.differences == [], (policy, res.differences[:3])


def test_consistent_hash_keeps_a_session_on_its_node_and_moves_only_a_lost_nodes() -> None:
    b = _balancer("consistent_hash", ["A100", "A100", "A100", "A100"])
    home = {}
    for s in range(200):
        t = b.pick(MODEL, 100, 0.0, session=f"user-{s}")
        assert t is not None
        home[s] = t.node_id
        assert b.pick(MODEL, 100, 0.0, session=f"user-{s}").node_id == t.node_id  # type: ignore[union-attr]
    assert len(set(home.values())) == 4  # the ring spreads sessions over every node
    b.set_state("n2", NodeState.CORDONED)
    for s in range(200):
        moved = b.pick(MODEL, 100, 0.0, session=f"user-{s}")
        assert moved is not None
        if home[s] != "n2":
            assert moved.node_id == home[s]  # only n2's sessions move
        else:
            assert moved.node_id != "n2"
    # Without a session key: the prompt's first block, else the least loaded node.
    first = b.pick(MODEL, 100, 0.0, prefix=(42, 43))
    assert first is not None
    assert b.pick(MODEL, 100, 0.0, prefix=(42, 99)).node_id == first.node_id  # type: ignore[union-attr]


def test_the_index_follows_the_fleet() -> None:
    b = _balancer("tailguard", ["A100", "A100"])
    conv = _chain(1, 30)
    t = b.pick(MODEL, 30 * BT + 10, 0.0, prefix=conv)
    assert t is not None
    home = t.node_id
    index = b.pools[MODEL].index()
    b.replace_pool(PoolConfig(MODEL, "tailguard", prefix_block_tokens=BT))  # a reload
    assert b.pools[MODEL].prefix is index and index.match(conv) == {home: 30}
    b.set_state(home, NodeState.DOWN, Actor.HEALTH)  # a crashed engine comes back with an empty cache
    assert index.match(conv) == {}
    b.add_node(NodeSpec("n9", DEFAULT_CATALOG.gpu("H100"), "H100", models=(MODEL,)))
    assert 0 < index.capacity("n9") <= DEFAULT_CATALOG.gpu("H100").mem_gb * 1e9
    b.remove_node("n9")
    assert index.blocks_at("n9") == 0
