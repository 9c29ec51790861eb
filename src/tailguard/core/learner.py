"""The learner: what each answer teaches (first token, stream progress, finish),
the outlier detector's samples, and each permit's release to its limiter.

:class:`Learner` turns a ticket's events into the node's estimator samples
(:class:`~tailguard.core.estimate.CapacityEstimate`) and the detector's
(:class:`~tailguard.core.outliers.OutlierDetector`), and releases each permit
exactly once. Room a release makes goes to :class:`~tailguard.core.queueing.Admission`;
recording is the balancer's, around its public calls.
"""

from __future__ import annotations

import math

from tailguard.core.fleet import OVERDUE_FACTOR, Node, Outcome
from tailguard.core.outliers import OutlierDetector
from tailguard.core.outliers.links import LinkWatch
from tailguard.core.pool import DECODE, PREFILL, Ticket
from tailguard.core.predict import (
    decode_step_s,
    interleaved_tpot,
    running_batch,
    saturated_step_s,
)
from tailguard.core.queueing import Admission

# Answers shorter than this teach no decode speed. Their time per token spans
# one or a few engine steps, and under a burst of short requests most steps
# also carry other requests' prefill chunks, so a 2-token stream reads several
# times the decode roofline on a healthy node. The limiter still sees them:
# their TPOT is what their clients got.
MIN_DECODE_TOKENS = 8

# With no cached-token count from the engine, a TTFT this far below what the
# node's learned speed predicts is taken for a prefix-cache hit (a cached
# prompt on llama.cpp: 18 ms against 578 ms uncached) and teaches nothing.
CACHE_HIT_RATIO = 0.25


class Learner:
    """What answers teach the nodes' estimators and the outlier detector."""

    __slots__ = ("_memo", "admission", "double_release", "links", "outliers")

    def __init__(self, outliers: OutlierDetector | None, admission: Admission,
                 links: LinkWatch | None = None) -> None:
        self.outliers = outliers
        self.links = links  # hand-off samples of disaggregated requests, per pair
        self.admission = admission
        self.double_release = 0  # finishes for an already released ticket
        # node id -> decode_expected's last answer for a piece: (its inputs, its answer)
        self._memo: dict[str, tuple[tuple[object, ...], tuple[int, float, float]]] = {}

    def first_token(self, ticket: Ticket, now: float, *, defer_prefill: bool = False) -> bool:
        """The request's first token arrived; False if it changes nothing (the
        ticket has one, or ended).

        ``defer_prefill``: the driver learns at the finish how much of the prompt
        the engine served from its prefix cache (``on_finish(cached_tokens=)``), so
        the prefill sample waits for it: a cached prompt's TTFT must neither teach
        a fast prefill nor make an uncached one look slow. The simulator, whose
        engine model has no prefix cache, learns at once.
        """
        if ticket.t_first >= 0.0 or ticket.released:
            return False
        node = ticket.node
        ticket.t_first = ticket.seg_t = now
        node.progressed(now)
        ticket.batch_at_first = ticket.seg_batch = node.fleet_in_flight
        if not ticket.presumed:
            node.prompt_done(ticket.backlog, ticket.prompt_tokens, now)
            # Its prompt's work fits in its TTFT: a first token sooner says the
            # engine computed less (a prefix-cache hit the router could not
            # foresee: the rates and the detector's ledger would otherwise count
            # as work what the cache served). At the node's speed where that is
            # faster than the roofline; not tightened where it is slower, since
            # a learned slowdown carries queueing too, and taken whole it cut
            # real work on overloaded nodes (benchmarks/README.md).
            slowdown = min(node.class_prefill_slowdown, node.capacity.prefill_slowdown, 1.0)
            most = (now - ticket.t_dispatch) / slowdown
            if ticket.work > most:
                node.recount_work(ticket.work, most, ticket.t_dispatch)
                ticket.work = most
            node.end_work(ticket.work, ticket.accrual, now)  # computed: counted where it ran
        ticket.seg_work = ticket.work_at_first = node.work_at(now)
        ticket.seg_areas = ticket.areas_at_first = node.areas_at(now)
        node.ttft.update(now - ticket.t_dispatch, now)
        pool = ticket.pool
        if ticket.leg == DECODE and self.links is not None and ticket.kv_from \
                and ticket.batch_at_dispatch <= node.slots \
                and not node.kv_short_since(ticket.t_dispatch):
            # The pair's link, judged where the decode node could admit the request
            # at once (else its wait is the node's queue), at the node's own speed.
            slowdown = max(node.class_decode_slowdown, node.capacity.decode_slowdown)
            self.links.on_hand_off(ticket.kv_from, node.id, now - ticket.t_dispatch,
                                   ticket.kv_s,
                                   (ticket.expected_ttft() - ticket.kv_s) * slowdown, now)
        if defer_prefill:
            ticket.pending_prefill = True
            if self.outliers is not None:
                self.outliers.on_progress(node, now)
        else:
            self.learn_prefill(ticket, 0)
        self.admission.room_made(pool, now)  # a shorter backlog may admit a waiter
        return True

    def learn_prefill(self, ticket: Ticket, cached_tokens: int | None) -> None:
        """Learn the node's prefill speed from the ticket's TTFT.

        ``cached_tokens`` None: the engine did not say. A sample then more than
        ``1 / CACHE_HIT_RATIO`` times faster than the node's learned speed is
        taken for a prefix-cache hit and teaches nothing (caching can only make
        a prefill faster, so the slow side of the evidence stays trustworthy).
        """
        ticket.pending_prefill = False
        if ticket.leg == DECODE:  # its prompt was computed elsewhere: that leg taught it
            return
        node = ticket.node
        ttft = ticket.t_first - ticket.t_dispatch
        # The same prediction the router made, without the node's learned
        # corrections, for the conditions the request met at dispatch.
        expected = ticket.expected_ttft(cached_tokens or 0)
        if (cached_tokens is None and expected > 0.0
                and ttft < CACHE_HIT_RATIO * expected * node.capacity.prefill_slowdown):
            node.presumed_cache_hit()
            return
        node.capacity.prefill.update(ttft, expected)
        if self.outliers is not None:
            batch = ticket.batch_at_dispatch
            tokens = int(ticket.ahead_tokens) + ticket.uncached(cached_tokens or 0)
            self.outliers.on_prefill(node, ttft, expected, ticket.t_first, tokens, batch,
                                     queued=ticket.running() < batch)

    def finish(self, ticket: Ticket, now: float, outcome: Outcome, output_tokens: int,
               *, judged: bool = True, timed: bool = True,
               cached_tokens: int | None = None) -> None:
        """Release the ticket's permit (exactly once) and learn from the request.

        ``judged=False``: a node failure whose cause is not known yet (a 5xx
        that the request itself may have caused); the detector hears of it
        only through a later :meth:`blame`. ``timed=False``: the answer's pace
        was the client's, not the node's (it read slowly), so no speed is
        learned from it. ``cached_tokens``: the prompt tokens the engine reported
        served from its prefix cache (for a first token that deferred its sample).
        """
        if ticket.released:
            self.double_release += 1
            return
        ticket.released = True
        node = ticket.node
        pre = ticket.prefill
        if pre is not None:  # ended before its prompt was handed over: so does that leg
            ticket.prefill = None
            if not pre.released:
                self.finish(pre, now, Outcome.CLIENT_CANCELLED, 0)
        if ticket.pending_prefill:
            if cached_tokens is None and outcome is not Outcome.OK:
                # Cut off before its engine said what it cached (a stream that failed,
                # was left, or was moved to another node): nothing to learn or presume.
                ticket.pending_prefill = False
            else:
                self.learn_prefill(ticket, cached_tokens)
        prefilling = ticket.t_first < 0.0 and not ticket.presumed
        node.released(ticket.backlog, prefilling, ticket.prompt_tokens, now)
        if ticket.due != math.inf or ticket.t_first >= 0.0:
            node.slot_freed(now)  # it held an engine slot: the next waiting prompt has it
        if prefilling:
            if outcome is Outcome.OK:  # a short non-streamed answer: computed all the same
                node.end_work(ticket.work, ticket.accrual, now)
            else:  # its prompt will not be computed: no longer work the node has to do
                node.withdraw_work(ticket.work)
                node.end_work(ticket.work, ticket.accrual, now, computed=False)
                node.left_unanswered(ticket.due if outcome is Outcome.CLIENT_CANCELLED
                                     else math.inf, now, ticket.allowance)
        if self.outliers is not None and (judged or not outcome.is_node_failure):
            self.outliers.on_outcome(node, outcome, now)
        if ticket.permit is not None:
            self.release_permit(ticket, now, outcome, output_tokens if timed else 0)
        if outcome is not Outcome.OK:
            return
        node.progressed(now)
        pool = ticket.pool
        if ticket.blocks and cached_tokens is not None and pool.prefix is not None:
            pool.prefix.observe(node.id, ticket.blocks, ticket.hit_blocks, cached_tokens)
        if ticket.leg == PREFILL:  # a prompt for another node: no answer of its own
            return
        pool.mean_output += (output_tokens - pool.mean_output) * 0.01
        if not timed:
            return
        node.latency.update(now - ticket.t_dispatch, now)
        if ticket.t_first >= 0.0 and output_tokens >= 2:
            tpot = (now - ticket.t_first) / (output_tokens - 1)
            node.tpot.update(tpot, now)  # what clients got (observers read it)
            if output_tokens < MIN_DECODE_TOKENS:
                return
            _, expected_step, _ = self.decode_expected(ticket, ticket.batch_at_first,
                                                        ticket.t_first, ticket.work_at_first,
                                                        None, now)
            node.capacity.decode.update(tpot, expected_step)
            if self.outliers is None:
                return
            self.note_kv(ticket, now)
            if ticket.seg_tokens == 1:  # no piece judged while it ran: the whole answer
                batch, expected_step, share = self.decode_expected(
                    ticket, ticket.batch_at_first, ticket.t_first, ticket.work_at_first,
                    ticket.areas_at_first, now)
                self.outliers.on_decode(node, tpot, expected_step, batch, now, ticket.t_first,
                                        share)
                return
            # The pieces judged as the stream ran; the rest, if long enough, now.
            rest = output_tokens - ticket.seg_tokens
            if rest >= MIN_DECODE_TOKENS:
                batch, expected_step, share = self.decode_expected(
                    ticket, ticket.seg_batch, ticket.seg_t, ticket.seg_work, ticket.seg_areas, now)
                self.outliers.on_decode(node, (now - ticket.seg_t) / rest, expected_step,
                                        batch, now, ticket.seg_t, share)

    def hand_off(self, ticket: Ticket, pre: Ticket, now: float) -> None:
        """``pre``, the prefill leg of the decode ticket ``ticket``, has computed the
        prompt (its answer is its first token); the decode node now waits for the
        KV and then for its own first token, due within its allowance of the
        transfer and one step (:meth:`Ticket.expected_ttft`)."""
        ticket.prefill = None
        if pre.t_first < 0.0:
            self.first_token(pre, now)
        self.finish(pre, now, Outcome.OK, 1)
        node = ticket.node
        pool = ticket.pool
        ticket.t_dispatch = now
        ticket.batch_at_dispatch = node.fleet_in_flight
        ticket.kv_from = pre.node.id
        ticket.kv_s = pool.links.nominal_s(pre.node.id, node.id,
                                           node.perf.model.kv_bytes_per_token,
                                           ticket.prompt_tokens)
        # Its deadline checks' allowance. The node is not held to it (Node.awaits):
        # a late first token here is the link's as often as the node's, and the
        # link's evidence is judged per pair (LinkWatch, at the first token).
        ticket.allowance = ticket.expected_ttft() * node.class_prefill_slowdown * OVERDUE_FACTOR

    def decode_expected(self, ticket: Ticket, batch_then: int, since: float,
                        work_then: float, areas_then: tuple[float, float] | None,
                        now: float) -> tuple[int, float, float]:
        """The running batch since ``batch_then`` (the mean of then and now), the
        roofline's time per token for it, stretched by the prompt work the node
        computed since ``since`` (when its total was ``work_then``), at the
        class's learned prefill speed (:func:`interleaved_tpot`), and the share of
        that time the decode step alone takes.

        Given ``areas_then`` (the node's ``Load.areas_at`` at ``since``), the
        step is the one for the prompts the node's decodes held since then,
        and a step carrying a chunk costs what the chunks of the prompts under
        way cost: what the detector judges the node by, since the router gives
        the longest prompts to the strongest nodes, whose steps then attend to
        more context. Without, the pool's mean prompt and a first chunk: the
        router's own prediction (``policies/tailguard.py``), which the node's
        learned decode speed corrects.
        """
        node, pool = ticket.node, ticket.pool
        pslow = node.class_prefill_slowdown
        key: tuple[object, ...] = ()
        if areas_then is not None:
            if self.outliers is not None:
                pslow = self.outliers.judged_prefill_slowdown(node)
            # The pieces of one node's streams judged at one tick share all of it
            # (the simulator tells each stream each second): computed once for them.
            key = (pool.name, batch_then, since, work_then, areas_then, now,
                   node.fleet_in_flight, pool.mean_prompt, pool.mean_output, pslow,
                   node.remote_ratio)
            memo = self._memo.get(node.id)
            if memo is not None and memo[0] == key:
                return memo[1]
        prompt = pool.mean_prompt
        if areas_then is not None:
            ctx_area, dec_area = node.areas_at(now)
            decodes = dec_area - areas_then[1]
            if decodes > 0.0:  # the answers' own tokens at the pool's mean, as below
                prompt = (ctx_area - areas_then[0]) / decodes
        batch = running_batch(node.perf, node.slots,
                              max(1, (batch_then + node.fleet_in_flight + 1) // 2),
                              prompt + pool.mean_output)
        ctx = prompt + pool.mean_output * 0.5  # half-way through the answers, on average
        alone = step = decode_step_s(node.perf, batch, ctx)
        span = now - since
        work = node.work_at(now) - work_then
        if span > 0.0 and work > 0.0:
            duty = work * (1.0 + node.remote_ratio) * pslow / span
            cap = saturated_step_s(node.perf, batch, ctx)
            if areas_then is not None:  # every step carrying a chunk of the prompts under way
                cap = max(cap, step + node.chunk_s() * pslow)
            step = interleaved_tpot(step, duty, cap)
        answer = (batch, step, alone / step)
        if key:
            self._memo[node.id] = (key, answer)
        return answer

    def stream_progress(self, ticket: Ticket, tokens: int, now: float) -> float:
        """``tokens`` output tokens of the ticket's stream have arrived by ``now``.

        The detector judges a long answer's decode piece by piece, each piece at
        least ``segment_s`` and ``MIN_DECODE_TOKENS`` long (an answer of 500
        tokens on a slowed node takes tens of seconds to end). Returns the time
        of the next call worth making (the driver compares its clock, no count).
        """
        det = self.outliers
        if det is None or ticket.released or ticket.t_first < 0.0 \
                or det.config.segment_s <= 0.0:
            return math.inf
        # Nothing changes until a piece is judged: only those calls are recorded.
        start = ticket.seg_t
        seg_s = det.config.segment_s
        if now - start < seg_s:
            return start + seg_s
        n = tokens - ticket.seg_tokens
        if n < MIN_DECODE_TOKENS:
            return now  # a slow piece: the next chunk may complete it
        self.note_kv(ticket, now)
        batch, expected, share = self.decode_expected(ticket, ticket.seg_batch, start,
                                                       ticket.seg_work, ticket.seg_areas, now)
        det.on_decode(ticket.node, (now - start) / n, expected, batch, now, start, share)
        ticket.seg_t = now
        ticket.seg_tokens = tokens
        ticket.seg_batch = ticket.node.fleet_in_flight
        ticket.seg_work = ticket.node.work_at(now)
        ticket.seg_areas = ticket.node.areas_at(now)
        return now + seg_s

    @staticmethod
    def stream_silent(ticket: Ticket, since: float, now: float) -> None:
        """The ticket's stream sent nothing from ``since`` to ``now``: its node's
        stall, where no healthy step of its engine explains the gap
        (:meth:`Node.stream_silent`), so the decode timed across it is left out of
        the detector's evidence (:meth:`Node.spans_stall`)."""
        if ticket.released or ticket.t_first < 0.0:
            return
        node = ticket.node
        node.stream_silent(since, now, OVERDUE_FACTOR * OVERDUE_FACTOR * ticket.longest_step_s())

    @staticmethod
    def note_kv(ticket: Ticket, now: float) -> None:
        """Whether the ticket's node is short of KV cache now (``Load.note_kv``)."""
        node = ticket.node
        node.note_kv(now, ticket.pool.mean_output, node.perf.kv_capacity_tokens,
                     1.0 + node.remote_ratio)

    def blame(self, node: Node, outcome: Outcome, now: float) -> None:
        """Charge ``node`` with a failure released unjudged, now that it is the node's.

        The driver learnt it from a second node: the same request succeeded
        there, so the first node's 5xx was the node's own.
        """
        if self.outliers is not None:
            self.outliers.on_outcome(node, outcome, now)

    def release_permit(self, ticket: Ticket, now: float, outcome: Outcome,
                       output_tokens: int) -> None:
        permit = ticket.permit
        assert permit is not None
        limiter = permit.limiter  # open: finish releases a ticket once
        assert limiter is not None
        node = ticket.node
        if outcome is Outcome.OK:
            tpot = 0.0
            if ticket.t_first >= 0.0 and output_tokens >= 2:
                tpot = (now - ticket.t_first) / (output_tokens - 1)
            ttft = ticket.t_first - ticket.t_dispatch if ticket.t_first >= 0.0 else 0.0
            # The engine's own queue with a nearly full KV cache: the batch is
            # past what its memory holds, whatever the latencies say yet.
            engine = node.engine
            congested = (engine.waiting > 0 and engine.kv_usage >= limiter.kv_full
                         and now - engine.at < 2.0)
            permit.succeeded(now, tpot, ttft, congested)
            if ticket.pool.queue is not None:
                ticket.pool.queue.on_release(now, ttft)
        elif outcome in (Outcome.TIMEOUT, Outcome.UPSTREAM_429):
            permit.dropped(now)
        else:
            permit.ignored()
        queue = ticket.pool.queue
        if queue is not None:
            if outcome is not Outcome.OK:
                queue.on_release(now)
            self.admission.room_made(ticket.pool, now)
