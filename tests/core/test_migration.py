"""Mid-stream migration in the exchange, on literal event sequences.

After every sequence nothing is in flight and no permit was released twice
(the ``settled`` fixture). Round robin over three A100s: the first copy goes
to n0, a continuation to a node not tried.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.exchange import (
    Cancel,
    Copy,
    Dispatch,
    Exchange,
    Fail,
    Failure,
    Migrate,
    Phase,
    Request,
)
from tailguard.core.fleet import Actor, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.migration import MigrationConfig
from tailguard.core.outliers import OutlierConfig

MODEL = "m"
RESET = Failure(Outcome.CONNECT_FAILURE, 502, "reset mid-stream", "upstream_disconnected")


def balancer(n: int = 3, migration: MigrationConfig | None = None) -> Balancer:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(n)]
    pool = PoolConfig(MODEL, "round_robin", migration=migration or MigrationConfig())
    b = Balancer(specs, [pool], random.Random(0), outliers=OutlierConfig())
    b.tick(0.0)
    return b


@pytest.fixture
def settled() -> Iterator[list[Balancer]]:
    used: list[Balancer] = []
    yield used
    for b in used:
        assert b.double_release == 0
        for node in b.nodes.values():
            assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding) == \
                (0, 0, 0, 0), node.id


def streaming(b: Balancer, max_tokens: int | None = 500,
              deadline: float | None = None) -> tuple[Exchange, Copy]:
    """An exchange whose first copy is committed at t=1 (a balancer's first: on n0)."""
    ex = Exchange(b, Request(MODEL, 900, max_tokens, deadline=deadline))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    ex.first_chunk(d.copy, 1.0)
    return ex, d.copy


def migrated(actions: tuple[object, ...]) -> Migrate:
    assert len(actions) == 1 and isinstance(actions[0], Migrate), actions
    return actions[0]


def test_a_stall_moves_the_stream_and_the_continuation_takes_over(
        settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    after = ex.stall_after(old)
    # four times an A100's longest healthy step (a full prompt chunk in a decode
    # step), never under the 0.5 s floor
    assert 0.5 <= after < 2.0
    assert ex.review(old, 3.0, 120, after * 0.9) == ()  # silent, not yet stalled
    m = migrated(ex.review(old, 3.0, 120, after))
    assert (m.after, m.cause) == (120, "stall") and m.copy.node_id != "n0"
    assert ex.phase is Phase.MOVING
    # the continuation asks for the prompt plus the answer so far, and what is left
    assert m.copy.ticket.prompt_tokens == 1020
    assert b.nodes["n0"].in_flight == 1 and b.nodes[m.copy.node_id].in_flight == 1  # racing
    (cancel,) = ex.first_chunk(m.copy, 3.4)
    assert cancel == Cancel(old) and ex.committed is m.copy and ex.phase is Phase.STREAMING
    assert b.nodes["n0"].in_flight == 0
    assert ex.finished(m.copy, 6.0, Outcome.OK, 380) == ()
    assert (ex.ended, ex.moves, ex.move_causes, ex.move_result) == ("ok", 1, ["stall"], "moved")


def test_the_stalled_stream_resuming_first_wins_the_race(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.review(old, 3.0, 40, 5.0))
    assert ex.resumed(old, 3.2) == (Cancel(m.copy),)
    assert ex.phase is Phase.STREAMING and ex.committed is old
    assert ex.first_chunk(m.copy, 3.3) == ()  # a late chunk of the cancelled continuation
    ex.finished(old, 5.0, Outcome.OK, 500)
    assert (ex.ended, ex.move_result) == ("ok", "resumed")


def test_a_stream_leaving_its_node_does_not_go_back_to_it(settled: list[Balancer]) -> None:
    """Moved for its node's state: the old copy's next chunk ends it (the driver
    drops that chunk) and the continuation carries on from where the client is."""
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    b.nodes["n0"].state = NodeState.QUARANTINED
    m = migrated(ex.review(old, 2.0, 10, 0.0))
    assert ex.resumed(old, 2.05) == (Cancel(old),)  # it still streams: cut there
    assert ex.phase is Phase.MOVING and b.nodes["n0"].in_flight == 0
    assert ex.resumed(old, 2.1) == () and ex.failed(old, 2.2, RESET, 12) == ()  # ended
    assert ex.first_chunk(m.copy, 2.4) == ()  # nothing left to cancel
    ex.finished(m.copy, 5.0, Outcome.OK, 490)
    assert (ex.ended, ex.move_result) == ("ok", "moved")
    b.nodes["n0"].state = NodeState.HEALTHY
    # cut, then the continuation fails: nothing to fall back to, another move
    ex, old = streaming(b)
    b.nodes[old.node_id].state = NodeState.QUARANTINED
    m = migrated(ex.review(old, 3.0, 40, 0.0))
    assert ex.resumed(old, 3.2) == (Cancel(old),)
    m2 = migrated(ex.failed(m.copy, 3.5, RESET))
    assert (m2.after, m2.cause) == (40, "failure")
    ex.first_chunk(m2.copy, 3.8)
    ex.finished(m2.copy, 6.0, Outcome.OK, 460)
    assert (ex.ended, ex.moves) == ("ok", 2)
    b.nodes[old.node_id].state = NodeState.HEALTHY
    # stalled, then quarantined while its continuation is on the way: a stall's
    # race is won by the token in hand, whatever the node's state
    ex, old = streaming(b)
    m = migrated(ex.review(old, 3.0, 40, 5.0))
    b.nodes[old.node_id].state = NodeState.QUARANTINED
    assert ex.resumed(old, 3.2) == (Cancel(m.copy),)
    ex.finished(old, 6.0, Outcome.OK, 500)
    b.nodes[old.node_id].state = NodeState.HEALTHY


def test_a_failure_mid_stream_moves_instead_of_failing(settled: list[Balancer]) -> None:
    b = balancer(migration=MigrationConfig(min_per_s=10.0))  # budget for two moves at once
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.failed(old, 2.0, RESET, output_tokens=33))
    assert (m.after, m.cause) == (33, "failure")
    assert b.nodes["n0"].in_flight == 0  # the failed copy's permit ended with its failure
    assert ex.first_chunk(m.copy, 2.3) == ()  # nothing left to cancel
    # the continuation fails too: one more move (the limit is two) to the last node
    m2 = migrated(ex.failed(m.copy, 2.5, RESET, output_tokens=10))
    assert m2.after == 43 and m2.copy.node_id not in ("n0", m.copy.node_id)
    ex.first_chunk(m2.copy, 2.8)
    ex.finished(m2.copy, 4.0, Outcome.OK, 457)
    assert (ex.ended, ex.moves) == ("ok", 2)


def test_migrate_then_the_continuation_fails_with_the_old_copy_gone(
        settled: list[Balancer]) -> None:
    b = balancer(2)
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.failed(old, 2.0, RESET, output_tokens=5))
    # no node left to try (n0 failed, n1 is failing it now): the stream ends in error
    (fail,) = ex.failed(m.copy, 2.2, RESET)
    assert isinstance(fail, Fail) and fail.committed and ex.ended == "failed"
    assert ex.move_result == "failed"


def test_a_failed_continuation_falls_back_to_the_stalled_stream(
        settled: list[Balancer]) -> None:
    b = balancer(2)
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.review(old, 3.0, 40, 5.0))
    assert ex.failed(m.copy, 3.1, RESET) == ()  # no other node: wait on the stalled one
    assert ex.phase is Phase.STREAMING and ex.committed is old and old.state == 1
    ex.finished(old, 9.0, Outcome.OK, 500)
    assert ex.ended == "ok"


def test_the_old_copy_failing_while_its_continuation_is_on_the_way(
        settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.review(old, 3.0, 40, 5.0))
    assert ex.failed(old, 3.5, RESET, output_tokens=40) == ()  # the continuation goes on
    assert ex.first_chunk(m.copy, 3.6) == ()
    ex.finished(m.copy, 5.0, Outcome.OK, 460)
    assert ex.ended == "ok"


def test_the_client_leaving_during_a_migration(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.review(old, 3.0, 40, 5.0))
    assert ex.client_gone(3.2, 40) == (Cancel(m.copy),)
    assert ex.ended == "client_gone" and ex.in_flight == 0
    assert ex.move_result == "gone" and b.pools[MODEL].moved == {"stall/gone": 1}


def test_the_budget_and_the_per_request_limit_bound_migrations(
        settled: list[Balancer]) -> None:
    # No per-second trickle, 0.5 per request, one saved: two requests fund one move.
    b = balancer(migration=MigrationConfig(budget=0.5, min_per_s=0.0, burst=1))
    settled.append(b)
    ex1, old1 = streaming(b)
    ex2, old2 = streaming(b)
    m = migrated(ex1.failed(old1, 2.0, RESET, output_tokens=9))
    ex1.first_chunk(m.copy, 2.2)
    ex1.finished(m.copy, 3.0, Outcome.OK, 491)
    (fail,) = ex2.failed(old2, 2.0, RESET, output_tokens=9)  # the budget is spent
    assert isinstance(fail, Fail) and fail.committed and ex2.moves == 0
    # per request: max_per_request 1 stops the second move of one request
    b = balancer(migration=MigrationConfig(max_per_request=1))
    settled.append(b)
    ex, old = streaming(b)
    m = migrated(ex.failed(old, 2.0, RESET, output_tokens=9))
    ex.first_chunk(m.copy, 2.2)
    (fail,) = ex.failed(m.copy, 2.5, RESET, output_tokens=3)
    assert isinstance(fail, Fail) and ex.moves == 1


def test_no_move_when_nothing_is_left_or_time_ran_out(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b, max_tokens=40)
    (fail,) = ex.failed(old, 2.0, RESET, output_tokens=40)  # the whole answer was sent
    assert isinstance(fail, Fail)
    ex, old = streaming(b, deadline=5.0)
    assert ex.review(old, 6.0, 20, 3.0) == ()  # past the request's deadline
    ex.finished(old, 6.1, Outcome.OK, 500)
    cut = dataclasses.replace(RESET, cut=True)
    ex, old = streaming(b)
    (fail,) = ex.failed(old, 2.0, cut, output_tokens=3)  # the deadline cut it: no move
    assert isinstance(fail, Fail)


def test_a_node_leaving_service_moves_its_long_streams(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    assert ex.review(old, 2.0, 10, 0.0) == ()  # healthy, not silent
    b.set_state("n0", NodeState.CORDONED, Actor.OPERATOR)
    assert ex.review(old, 2.5, 10, 0.0) == ()  # cordoned: its streams finish there
    b.set_state("n0", NodeState.HEALTHY, Actor.OPERATOR)
    b.nodes["n0"].state = NodeState.QUARANTINED  # as the detector would set it
    m = migrated(ex.review(old, 3.0, 10, 0.0))
    assert m.cause == "quarantined"
    ex.first_chunk(m.copy, 3.2)
    ex.finished(m.copy, 5.0, Outcome.OK, 490)
    b.nodes["n0"].state = NodeState.HEALTHY
    # flowing fast on a quarantined node (a hang that ended): it ends sooner where it
    # is than a continuation would, so it stays
    ex, old = streaming(b, max_tokens=1000)
    b.nodes[old.node_id].state = NodeState.QUARANTINED
    assert ex.review(old, 2.0, 800, 0.0) == ()  # 1.25 ms a token, 200 left
    assert ex.review(old, 30.0, 801, 0.0) != ()  # 36 ms a token: a continuation is sooner
    ex.client_gone(30.1)
    b.nodes[old.node_id].state = NodeState.HEALTHY
    # too little left: the remainder finishes sooner where it is
    ex, old = streaming(b, max_tokens=100)
    b.nodes[old.node_id].state = NodeState.QUARANTINED
    assert ex.review(old, 3.0, 50, 0.0) == ()
    ex.finished(old, 4.0, Outcome.OK, 100)
    b.nodes[old.node_id].state = NodeState.HEALTHY


def test_degraded_nodes_keep_their_streams_unless_asked(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex, old = streaming(b)
    b.nodes["n0"].state = NodeState.DEGRADED  # degraded, still routed (with less weight)
    assert ex.review(old, 2.0, 10, 0.0) == ()  # off by default
    ex.finished(old, 4.0, Outcome.OK, 500)
    b.nodes["n0"].state = NodeState.HEALTHY
    b = balancer(migration=MigrationConfig(on_degraded=True))
    settled.append(b)
    ex, old = streaming(b)
    b.nodes["n0"].state = NodeState.DEGRADED
    m = migrated(ex.review(old, 2.0, 10, 0.0))  # degraded after the stream began: moves
    assert m.cause == "degraded"
    ex.client_gone(2.1)
    b.nodes["n0"].state = NodeState.HEALTHY
    b = balancer(1, MigrationConfig(on_degraded=True))
    settled.append(b)
    b.nodes["n0"].state = NodeState.DEGRADED  # degraded when the stream began: it stays
    ex, old = streaming(b)
    assert ex.review(old, 2.0, 10, 0.0) == ()
    ex.finished(old, 4.0, Outcome.OK, 500)
    b.nodes["n0"].state = NodeState.HEALTHY


def test_migration_off_keeps_the_committed_failure(settled: list[Balancer]) -> None:
    b = balancer(migration=MigrationConfig(enabled=False))
    settled.append(b)
    ex, old = streaming(b)
    assert ex.stall_after(old) == float("inf")
    assert ex.review(old, 9.0, 10, 60.0) == ()
    (fail,) = ex.failed(old, 9.5, RESET, output_tokens=10)
    assert isinstance(fail, Fail) and fail.committed


def test_a_non_streamed_request_never_moves(settled: list[Balancer]) -> None:
    b = balancer()
    settled.append(b)
    ex = Exchange(b, Request(MODEL, 900, 500, stream=False))
    (d,) = ex.arrive(0.0)
    assert isinstance(d, Dispatch)
    assert ex.migration is None
    ex.finished(d.copy, 2.0, Outcome.OK, 500)
