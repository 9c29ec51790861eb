"""The balancer facade: permits released exactly once, accounting, learning."""

from __future__ import annotations

import math
import random

import pytest

from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import NodeSpec, Outcome
from tailguard.core.fleet.work import DUTY_TAU_S
from tailguard.core.hardware import DEFAULT_CATALOG

MODEL = "llama-3.1-8b"


def make(n: int = 2, policy: str = "least_request") -> Balancer:
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(n)]
    return Balancer(specs, [PoolConfig(MODEL, policy)], random.Random(0))


def test_accounting_through_a_request_lifecycle() -> None:
    b = make(1)
    node = b.nodes["n0"]
    t = b.pick(MODEL, 700, 0.0)
    assert t is not None
    assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding) == (1, 1, 700, 0)
    b.on_first_token(t, 0.2)
    assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding) == (1, 0, 0, 1)
    b.on_finish(t, 2.0, Outcome.OK, 100)
    assert (node.in_flight, node.decoding) == (0, 0)


def test_non_streamed_prompt_leaves_the_backlog_after_its_predicted_ttft() -> None:
    b = make(1, "tailguard")
    node = b.nodes["n0"]
    quiet = b.pick(MODEL, 2000, 0.0)  # non-streamed: no first token will come
    streamed = b.pick(MODEL, 700, 0.0)
    assert quiet is not None and streamed is not None
    b.expect_no_first_token(quiet, 0.0)
    assert (node.prefilling, node.prefill_backlog) == (2, 2700)  # not yet: prefill takes time
    b.tick(0.001)
    assert (node.prefilling, node.prefill_backlog) == (2, 2700)
    b.tick(5.0)  # long past a 2,000-token prefill on an A100: the prompt is presumed done
    assert (node.prefilling, node.prefill_backlog, node.decoding) == (1, 700, 1)
    assert node.ttft.value == 0.0  # nothing learned from a presumed first token
    b.on_first_token(streamed, 5.1)
    b.on_first_token(quiet, 5.2)  # a late first token after all: counted once
    assert (node.prefilling, node.prefill_backlog, node.decoding) == (0, 0, 2)
    b.on_finish(quiet, 9.0, Outcome.OK, 100)
    b.on_finish(streamed, 9.0, Outcome.OK, 100)
    assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding) == (0, 0, 0, 0)


def test_non_streamed_ticket_finishing_before_its_presumed_prefill() -> None:
    b = make(1)
    node = b.nodes["n0"]
    t = b.pick(MODEL, 4000, 0.0)
    b.expect_no_first_token(t, 0.0)
    b.on_finish(t, 0.01, Outcome.UPSTREAM_5XX, 0)  # failed at once
    assert (node.in_flight, node.prefilling, node.prefill_backlog, node.decoding) == (0, 0, 0, 0)
    b.tick(10.0)  # its heap entry is dropped, nothing counted twice
    assert (node.prefilling, node.prefill_backlog, node.decoding) == (0, 0, 0)


def test_permit_released_exactly_once() -> None:
    b = make(1)
    t = b.pick(MODEL, 10, 0.0)
    b.on_finish(t, 0.1, Outcome.CLIENT_CANCELLED, 0)
    b.on_finish(t, 0.2, Outcome.OK, 5)
    b.on_first_token(t, 0.3)
    node = b.nodes["n0"]
    assert node.in_flight == 0 and node.prefilling == 0 and node.prefill_backlog == 0
    assert b.double_release == 1


def test_unknown_model_and_exclusion() -> None:
    b = make(2)
    assert b.pick("nope", 10, 0.0) is None
    t = b.pick(MODEL, 10, 0.0, exclude=("n0",))
    assert t is not None and t.node_id == "n1"
    assert b.pick(MODEL, 10, 0.0, exclude=("n0", "n1")) is None


def test_capacity_learns_from_completions() -> None:
    b = make(1, "tailguard")
    node = b.nodes["n0"]
    now = 0.0
    for _ in range(30):
        t = b.pick(MODEL, 500, now)
        expected = node.perf.step_time(1, 1 * (500 + 50))
        b.on_first_token(t, now + 0.1)
        # The node decodes three times slower than its roofline prior.
        b.on_finish(t, now + 0.1 + 99 * expected * 3.0, Outcome.OK, 100)
        now += 10.0
    assert 2.5 < node.capacity.decode_slowdown < 3.5


def test_recorder_sees_every_input() -> None:
    seen: list[dict[str, object]] = []
    specs = [NodeSpec("n0", DEFAULT_CATALOG.gpu("L4"), "L4", models=(MODEL,))]
    b = Balancer(specs, [PoolConfig(MODEL)], random.Random(0), recorder=seen.append)
    t = b.pick(MODEL, 10, 0.0)
    b.on_first_token(t, 0.1)
    b.on_finish(t, 0.5, Outcome.OK, 3)
    ops = [r["op"] for r in seen]
    assert ops[:3] == ["init", "add_pool", "add_node"]  # the fleet as it was built
    assert ops[3:] == ["pick", "first_token", "finish"]
    assert seen[3]["node"] == "n0" and seen[4]["ticket"] == seen[3]["ticket"]


def test_short_answers_and_client_paced_streams_teach_no_decode_speed() -> None:
    """Issue 11 D6: a burst of 2-token streams read 2.8x slow and degraded healthy nodes."""
    b = make(1, "tailguard")
    b.tick(0.0)  # the detector's records exist from the first tick
    node = b.nodes["n0"]
    now = 0.0
    for tokens, timed in ((2, True), (7, True), (100, False)):
        for _ in range(20):
            t = b.pick(MODEL, 500, now)
            expected = node.perf.step_time(1, 1 * (500 + 50))
            b.on_first_token(t, now + 0.1)
            b.on_finish(t, now + 0.1 + (tokens - 1) * expected * 3.0, Outcome.OK, tokens,
                        timed=timed)
            now += 10.0
    assert node.capacity.decode.samples == 0
    assert b.outliers is not None and b.outliers.health["n0"].decode.n == 0
    assert node.tpot.count == 40  # observers still see what clients got
    t = b.pick(MODEL, 500, now)  # the same slowness over a longer, node-paced answer is learnt
    b.on_first_token(t, now + 0.1)
    b.on_finish(t, now + 0.1 + 19 * node.perf.step_time(1, 550) * 3.0, Outcome.OK, 20)
    assert node.capacity.decode.samples == 1


def test_an_unjudged_failure_is_charged_only_when_blamed() -> None:
    b = make(2)
    b.tick(0.0)
    assert b.outliers is not None
    t = b.pick(MODEL, 10, 0.0, exclude=("n1",))
    b.on_finish(t, 0.1, Outcome.UPSTREAM_5XX, 0, judged=False)
    h = b.outliers.health["n0"]
    assert (h.failures, h.consecutive_failures, b.nodes["n0"].in_flight) == (0, 0, 0)
    b.blame("n0", Outcome.UPSTREAM_5XX, 0.2)
    assert (h.failures, h.consecutive_failures) == (1, 1)


def test_a_long_stream_is_judged_piece_by_piece_as_it_runs() -> None:
    """The detector hears of a stream's decode every segment_s (1 s, >= 8 tokens), the
    rest at the finish; the capacity learner still learns the whole answer once."""
    b = make(1, "tailguard")
    b.tick(0.0)
    assert b.outliers is not None
    seen: list[tuple[float, float, float | None]] = []  # (tpot, now, since)
    real = b.outliers.on_decode

    def spy(node: object, tpot: float, expected: float, batch: int = 1,
            now: float | None = None, since: float | None = None, share: float = 1.0) -> None:
        seen.append((tpot, now or 0.0, since))
        real(b.nodes["n0"], tpot, expected, batch, now, since, share)

    b.outliers.on_decode = spy  # type: ignore[method-assign]
    node = b.nodes["n0"]
    t = b.pick(MODEL, 500, 0.0)
    assert t is not None
    b.on_first_token(t, 0.5)
    # 48 tokens a second for 2 s, then 16: told every 0.25 s, as a driver would be
    tokens, now, ask = 1, 0.5, 0.5
    while now < 4.5:
        now += 0.25
        tokens += 12 if now <= 2.5 else 4
        if now >= ask:
            ask = b.on_stream_progress(t, tokens, now)
    pieces = [(round(tpot, 4), n, s) for tpot, n, s in seen]
    assert [p[1] for p in pieces] == [1.5, 2.5, 3.5, 4.5]  # one piece per second
    assert [p[2] for p in pieces] == [0.5, 1.5, 2.5, 3.5]  # each from the last one's end
    assert [p[0] for p in pieces] == [0.0208, 0.0208, 0.0625, 0.0625]
    b.on_finish(t, 4.6, Outcome.OK, tokens + 1)  # one token more: too short to judge
    assert len(seen) == 4
    assert node.capacity.decode.samples == 1
    # a stream told nothing is judged whole at its finish, as before
    t = b.pick(MODEL, 500, 10.0)
    b.on_first_token(t, 10.2)
    b.on_finish(t, 12.2, Outcome.OK, 101)
    assert len(seen) == 5 and seen[-1][2] == 10.2 and round(seen[-1][0], 3) == 0.02


def test_stream_progress_is_recorded_and_replays() -> None:
    from tailguard.core.replay import replay

    rec: list[dict[str, object]] = []
    specs = [NodeSpec(f"n{i}", DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for i in range(2)]
    b = Balancer(specs, [PoolConfig(MODEL)], random.Random(0), recorder=rec.append)
    now = 0.0
    for i in range(40):
        t = b.pick(MODEL, 300, now)
        assert t is not None
        b.on_first_token(t, now + 0.1)
        slow = 3.0 if t.node_id == "n1" and i > 10 else 1.0
        for k in range(1, 9):
            b.on_stream_progress(t, 1 + 10 * k, now + 0.1 + k * 0.25 * slow)
        b.on_finish(t, now + 0.1 + 2.2 * slow, Outcome.OK, 90)
        now += 0.5
        b.tick(now)
    assert any(r["op"] == "progress" for r in rec)
    assert replay(rec).differences == []


def test_progress_that_judges_no_piece_changes_nothing() -> None:
    """Only calls that judge a piece are recorded, so the others must leave no trace:
    an 8-token answer told its progress is judged as one told nothing."""
    samples = []
    for tell in (False, True):
        b = make(1, "tailguard")
        b.tick(0.0)
        t = b.pick(MODEL, 300, 0.0)
        assert t is not None and b.outliers is not None
        b.on_first_token(t, 0.1)
        if tell:
            assert b.on_stream_progress(t, 5, 0.5) == 1.1  # too early: ask again at 1.1 s
            assert b.on_stream_progress(t, 7, 1.2) == 1.2  # too few tokens: next chunk
        b.on_finish(t, 1.3, Outcome.OK, 8)
        b.tick(1.5)  # the decode window closes: its samples are judged
        levels = b.outliers.health["n0"].decode.levels
        samples.append(({k: tuple(v) for k, v in levels.items()},
                        b.nodes["n0"].capacity.decode.samples))
    assert samples[0] == samples[1]
    assert len(samples[0][0]) == 1 and samples[0][1] == 1  # one sample each, the same


def test_prompt_work_accrues_while_it_computes() -> None:
    """A prompt's work is spread from its dispatch to its predicted first token, so a
    decode judged in pieces meanwhile is expected to be slowed by it; a first token
    before then credits the rest, a request that ends first drops it."""
    b = make(1)
    node = b.nodes["n0"]
    entry = node.start_work(0.4, 10.0, 12.0, 10.0)  # 0.4 s of work over [10, 12]
    assert node.work_at(10.0) == 0.0
    assert node.work_at(11.0) == pytest.approx(0.2)
    other = node.start_work(0.1, 11.0, 12.0, 11.0)  # over [11, 12]
    assert node.work_at(11.5) == pytest.approx(0.3 + 0.05)
    node.end_work(0.1, other, 11.5)  # early first token: the rest at once
    assert node.work_at(11.5) == pytest.approx(0.3 + 0.1)
    assert node.work_at(13.0) == pytest.approx(0.4 + 0.1)  # accrued whole by 12
    node.end_work(0.4, entry, 13.0)  # a late first token adds nothing more
    assert node.work_at(20.0) == pytest.approx(0.5) and node.work_rate == 0.0
    gone = node.start_work(1.0, 20.0, 21.0, 20.0)
    node.end_work(1.0, gone, 20.25, computed=False)  # cancelled: what it ran stays
    assert node.work_at(30.0) == pytest.approx(0.75)
    # Through the balancer: picked, streamed, finished, the node's total is every prompt's.
    t = b.pick(MODEL, 2000, 40.0)
    assert t is not None and t.work > 0.0
    work = t.work
    b.on_first_token(t, 40.0 + 2.0 * work)  # its prompt computed in its time
    b.on_finish(t, 42.0, Outcome.OK, 100)
    assert t.work == work and node.work_at(42.0) == pytest.approx(0.75 + work)


def test_a_first_token_too_soon_for_its_prompt_keeps_only_what_fits() -> None:
    """A prompt's work, at the node's speed, fits in its TTFT: a first token sooner
    says the engine computed less (a prefix-cache hit the router did not foresee),
    and the node's ledger and recent prompt rate keep only what fits, the rate as
    decayed since the dispatch."""
    b = make(1)
    node = b.nodes["n0"]
    t = b.pick(MODEL, 2000, 0.0)
    assert t is not None and t.work > 0.1
    assert node.duty == pytest.approx(t.work / DUTY_TAU_S)
    b.tick(0.02)
    b.on_first_token(t, 0.05)  # mostly served from the engine's cache
    assert t.work == pytest.approx(0.05)
    assert node.duty == pytest.approx(0.05 * math.exp(-0.02 / DUTY_TAU_S) / DUTY_TAU_S)
    assert node.work_at(0.05) == pytest.approx(0.05)
    b.on_finish(t, 1.0, Outcome.OK, 50)
    assert node.work_at(1.0) == pytest.approx(0.05)


def test_prompts_accrue_first_come_first_served_at_a_rising_share() -> None:
    """A prompt's work accrues once those ahead of it are expected done, over its own
    span, at a rate rising by ``ramp`` (its late chunks attend to more of it): the
    integral is its work whatever the ramp, and a first token credits the rest."""
    b = make(1)
    node = b.nodes["n0"]
    first = node.start_work(1.0, 10.0, 12.0, 10.0, chunks=4, ramp=3.0)  # rate 0.25 -> 0.75
    assert node.work_free_at(10.0) == 12.0
    second = node.start_work(0.5, node.work_free_at(10.0), 13.0, 10.0, chunks=2)
    assert node.chunk_s() == pytest.approx(1.5 / 6)
    assert node.work_at(11.0) == pytest.approx(0.375)  # 0.25 a second rising to 0.5: its lighter half
    assert node.work_at(12.0) == pytest.approx(1.0)  # whole by its end; the second not begun
    assert node.work_at(12.5) == pytest.approx(1.25)
    node.end_work(1.0, first, 12.5)  # accrued whole already: nothing more
    node.end_work(0.5, second, 12.5)  # an early first token: the rest at once
    assert node.work_at(12.5) == pytest.approx(1.5)
    assert node.work_at(20.0) == pytest.approx(1.5) and node.work_rate == 0.0
    assert node.chunk_s() == 0.0 and node.work_free_at(20.0) == 20.0


def test_a_node_slow_to_prefill_is_judged_at_its_peers_prefill_speed() -> None:
    """The prompt chunks in a node's decode pieces are priced at its class's prefill
    speed, or, once its TTFT reads slow for its class, at its peers': at the
    class's, a throttled node's own slower prefill would, through the mean, excuse
    part of its slowness (half of it in a class of two)."""
    b = make(3, "tailguard")
    n0, n1, n2 = (b.nodes[f"n{i}"] for i in range(3))
    for _ in range(40):
        n0.capacity.prefill.update(2.0, 1.0)  # throttled to half speed
        n1.capacity.prefill.update(1.1, 1.0)
        n2.capacity.prefill.update(0.9, 1.0)
    b.tick(1.0)
    logs = [n.capacity.prefill.log_ratio for n in (n0, n1, n2)]
    assert n0.class_prefill_slowdown == pytest.approx(math.exp(sum(logs) / 3))
    assert n0.peers_prefill_slowdown == pytest.approx(math.exp((logs[1] + logs[2]) / 2))
    assert n1.peers_prefill_slowdown == pytest.approx(math.exp((logs[0] + logs[2]) / 2))
    det = b.outliers
    assert det is not None
    assert det.judged_prefill_slowdown(n0) == n0.class_prefill_slowdown
    det.health["n0"].prefill.cusum = det.config.evidence  # its TTFT flagged slow
    assert det.judged_prefill_slowdown(n0) == n0.peers_prefill_slowdown
    assert det.judged_prefill_slowdown(n1) == n1.class_prefill_slowdown
