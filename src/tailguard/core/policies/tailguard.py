"""tailguard: route each request to the node where it would finish earliest, within the SLO.

For every eligible node the policy predicts this request's time to first token
and time per output token *there*, from the node's roofline prior corrected by
what the node has measurably delivered (:class:`~tailguard.core.estimate.CapacityEstimate`)
and from its live load as the gateway counts it:

* batch after admission ``b = in_flight + 1``; the engine runs at most
  ``slots = min(max_num_seqs, KV capacity / tokens per request)`` at once,
  so a node with free slots admits at once while a full one queues;
* ``tpot = step_time(min(b, slots) sequences) * decode_slowdown / (1 - duty)``,
  the slowdown learned for the node's GPU class, and ``duty`` the share of the
  node's time its recent prompts take at the class's prefill speed: prompts
  computed between decode tokens stretch every token
  (:func:`~tailguard.core.predict.interleaved_tpot`), so a node taking a lost
  peer's load predicts the TPOT it will deliver, not its idle step;
* ``ttft = (prompt tokens ahead + this prompt) * prefill cost per token
  * prefill_slowdown + one step``, plus, when the node is full, the time for
  ``b - slots`` requests to drain at ``slots`` per service time;
* finish time ``e2e = ttft + expected_output * tpot``;
* the request's *queueing externality* on the node: the part of ``ttft``
  spent waiting for work ahead of it (``wait``: the prompt backlog's prefill,
  plus the engine queue, plus how long the node has been silent past a due
  first token, :meth:`~tailguard.core.fleet.Node.overdue_s`), and, away from
  the node that holds most of the prompt's prefix, the prefill that holder
  would have skipped (it delays the queue behind it here as a backlog of that
  size would), times ``queue_weight`` (default 1.0).

The node with the earliest predicted finish wins, among the nodes that keep
both SLOs (with ``slo_headroom``, default 0.9; the TPOT check uses the node's
own learned decode speed where it is slower than its class's). The finish time weighs TTFT by
``ttft_weight``; its default (``"slo"``) is ``expected_output * slo_tpot /
slo_ttft``, which makes the cost ``out*tpot + w*ttft`` proportional to
``tpot/slo_tpot + ttft/slo_ttft``: a second of waiting for the first token
counts as much, in SLO terms, as the decode time it is compared with. Without
it the router would happily trade a long first-token wait for a slightly
faster decode, which users notice more and which the TTFT SLO forbids. When no node keeps them, the
one that misses them by the least wins. A degraded node's finish time is
divided by its weight scale. With ``sample: k`` the policy looks at ``k``
random nodes instead of all of them (P2C-style), so several gateway replicas
do not herd on the same node.

Why the queueing term: the finish time is what *this* request pays, and
routing every request by it is selfish routing, whose equilibrium loads the
fast nodes until their queue wait eats their speed advantage (Wardrop; the
"price of anarchy" of Roughgarden and Tardos). A request that joins a FIFO
prefill queue also delays every request that will queue behind it while it
waits; in a steady state as many join behind it as it found ahead (Little's
law with Poisson arrivals seeing time averages), each delayed by a prompt of
about the node's mean size, so the delay it imposes on others is about the
wait it meets itself. Counting it (system-optimal routing prices each request
at its marginal cost) keeps the fast nodes off the steep part of their queue
curve: when a fast node is lost, its load spills to the next class instead of
piling onto its peers' prefill queues, which is where a TTFT tail comes from.
The externality is charged at the node's mean prompt, not this prompt: charged
at this prompt it would send long prompts from busy fast nodes to idle slow
ones, whose own prefill then blocks them (tried; unstable). ``queue_weight: 0``
restores the selfish finish time.

Overload (option ``spill_excess``, off by default): when even the best node
is predicted to miss the SLO by that share or more (0.5 measured best: a
burst of long prompts has queued up everywhere), the finish times no longer
say which request can still make it, and the least miss is the shortest
prefill queue: every request then piles onto the nodes whose queues have just
drained, stretching the decodes running there, and each of them misses too.
The request goes instead to the node with the most room in its engine
(requests in flight against the batch it runs at once), as least-request
balancing spreads an overload. Measured in ``benchmarks/README.md``
("overload.py"); a fleet that keeps its SLO never gets there. The node a
request spilled onto is marked overloaded (``Load.kv_short``), so the
outlier detector leaves out what it times then, as it does when the node is
short of KV cache: the spread load is not the node's slowness. Off by default
because that also hides a throttled node that the spills keep choosing (a
bursty trace's lone H100: caught after 42 s instead of 8 s).

Worked example (llama-3.1-8b, slo tpot 0.1 s): an idle L4 predicts a step of
75 ms, an H100 with 40 requests in flight a step of 12 ms; for a 200-token
answer the H100 finishes in ~2.4 s against ~15 s on the L4, so the H100 wins
until its own batch pushes its step near the L4's, or near the SLO.

Worked example of the queueing term (measured in benchmarks/stragglers.py,
llama-3.2-3b, one of three H100s throttled): an H100 with 21,000 prompt tokens
queued predicts TTFT 0.29 s (0.25 s of it waiting: 21,000 x 9.3 us x class
slowdown 1.3) and 24 ms per token; an A100 predicts 0.08 s and 35 ms. For a
200-token answer the TTFT weight is ``200 * 0.1 / 2 = 10``: selfishly the H100
costs ``10 * 0.29 + 200 * 0.024 = 7.7`` s against the A100's ``0.8 + 7.0 = 7.8``
s, so the H100's queue keeps growing; with the wait it imposes on others
(``+ 10 * 0.25``) it costs 10.2 s and the request goes to the A100.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from random import Random
from typing import ClassVar

from tailguard.core.fleet import NodeView
from tailguard.core.hardware import PerfModel
from tailguard.core.kv_transfer import LinkMap
from tailguard.core.policies.base import RequestInfo, Slo
from tailguard.core.policies.tailguard_options import TailguardOptions
from tailguard.core.predict import (
    decode_step_s,
    interleaved_tpot,
    prefill_s,
    prefill_token_s,
    running_batch,
    saturated_step_s,
)

# Cost added per unit of relative SLO excess: any node that keeps the SLO beats
# every node that does not, and among those that do not the smaller miss wins.
_VIOLATION_COST_S = 1e4
# Standard deviations of the prompt work an answer meets that its TPOT check allows
# for (one: about the 84th percentile of a normal; two moved the live incident's
# misses from TPOT to TTFT, benchmarks/README.md).
_SPREAD_Z = 1.0
# Prompt duty above which the saturated step may cap the predicted TPOT.
_CAP_DUTY = 0.3
# Prefill nodes, ranked alone, that choose_pair tries with every decode node.
_PAIR_PREFILLS = 3


class TailguardPolicy:
    name: ClassVar[str] = "tailguard"
    Options: ClassVar[type[TailguardOptions]] = TailguardOptions

    def __init__(self, slo: Slo | None = None, options: TailguardOptions | None = None) -> None:
        opts = options or TailguardOptions()
        self.slo = slo or Slo()
        self.sample = opts.sample
        self.headroom = opts.slo_headroom
        self.ttft_weight = opts.ttft_weight
        self.queue_weight = opts.queue_weight
        self.spill_excess = math.inf if opts.spill_excess is None else opts.spill_excess
        self.spilled = False  # whether the last choice spilled an overload
        # The last candidate list grouped by shape (_shapes), and its groups.
        self._grouped: Sequence[NodeView] | None = None
        self._groups: list[tuple[PerfModel, int, list[NodeView]]] = []

    def _terms(self, req: RequestInfo) -> tuple[float, float, float, float]:
        """The request's expected answer, the context a step attends to at its
        midpoint, its KV footprint, and the weight of a second of TTFT."""
        out = req.expected_output
        if req.max_tokens is not None and req.max_tokens < out:
            out = float(req.max_tokens)
        out = max(out, 1.0)
        weight = self.ttft_weight
        if weight is None:
            weight = out * self.slo.tpot_s / self.slo.ttft_s
        return out, req.mean_prompt + out * 0.5, req.mean_prompt + out, weight

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        """The candidate of least predicted cost (the class docstring's model).

        The loop over the candidates is every routing decision's hot path, so
        each node's estimate stays inline. The candidates go by engine shape
        (:meth:`_shapes`): what a shape's hardware alone decides is quoted once
        (:class:`_Quote`), and a shape whose idle node, at its class's speed and
        full weight, cannot beat the best cost so far is passed over whole (in a
        mixed fleet the weak classes rarely can; their nodes are not read).
        Shapes go cheapest first; among equal costs the first node examined wins.
        """
        if not nodes:
            return None
        cands = nodes
        if self.sample and len(nodes) > self.sample:
            cands = rng.sample(list(nodes), self.sample)
        prompt = req.prompt_tokens
        out, ctx, footprint, ttft_weight = self._terms(req)
        ttft_limit = self.slo.ttft_s * self.headroom
        tpot_limit = self.slo.tpot_s * self.headroom
        queue_weight = self.queue_weight
        cached = req.cached
        # The most of this prompt any node holds: prefill done elsewhere is work a
        # holder would not have had to do (charged below as an externality).
        top = min(max(cached.values()), prompt - 1) if cached else 0
        spill = self.spill_excess < math.inf
        # Each shape's quote and floor: the cost of its idle node (one running
        # sequence, no wait, no prompt duty, the least prefill any node has left,
        # weight 1) that no node of the shape can go below (weights are at most 1,
        # steps grow with the batch, a class's nodes share its slowdowns).
        runs: list[tuple[float, _Quote, list[NodeView]]] = []
        for perf, slots, members in self._shapes(cands):
            q = _Quote(perf, slots, prompt, ctx, footprint)
            idle = q.steps[1] = decode_step_s(perf, 1, ctx)
            first = members[0]
            tpot = idle * first.class_decode_slowdown
            own = q.prefill if not top else prefill_s(perf, 0, prompt - top)
            runs.append((ttft_weight * (own * first.class_prefill_slowdown + tpot) + out * tpot,
                         q, members))
        if len(runs) > 1 and not spill:  # (a spill weighs the nodes examined, in order)
            runs.sort(key=_floor)
        best_id: str | None = None
        best = float("inf")
        best_excess = 0.0
        spill_id: str | None = None
        spill_room = float("inf")
        for floor, q, members in runs:
            if floor >= best and not spill:
                continue
            perf = q.perf
            cap = q.cap
            steps = q.steps
            ptok = q.token_s
            for n in members:
                if n.remote_ratio == 0.0:  # one gateway: the fleet's counts are its own
                    batch, backlog = n.in_flight + 1, n.prefill_backlog
                else:
                    batch, backlog = n.fleet_in_flight + 1, n.fleet_backlog
                running = batch if batch <= cap else cap
                pslow = n.class_prefill_slowdown
                dslow = n.class_decode_slowdown
                step = steps.get(running)
                if step is None:
                    step = steps[running] = decode_step_s(perf, running, ctx)
                tpot = step * dslow
                if cached:
                    # A prefix the node holds is prefill it need not do.
                    work = prompt - min(cached.get(n.id, 0), prompt - 1)
                    own = q.prefill if work == prompt else prefill_s(perf, 0, work)
                else:
                    work, own = prompt, q.prefill
                # The cost below with no wait, no prompt duty and no SLO miss, none of
                # which can lower it: a node that cannot win even so is passed over.
                if (ttft_weight * (own * pslow + tpot) + out * tpot) / n.weight_scale >= best:
                    continue
                check = tpot
                duty = n.duty
                if duty > 0.0:
                    scale = (1.0 + n.remote_ratio) * pslow
                    duty *= scale
                    # The cap (a step that always carries a chunk) is only looked up
                    # where it can bind: a prompt riding in a step's spare compute
                    # adds little work, so a low duty never stretches past it.
                    tpot = interleaved_tpot(tpot, duty,
                                            saturated_step_s(perf, running, ctx) * dslow
                                            if duty > _CAP_DUTY else math.inf)
                    # How unlucky this answer may be: the prompt work landing in its
                    # decode (out * tpot seconds) is a Poisson sum of prompts, whose
                    # spread over its tokens the SLO check adds.
                    check = tpot + _SPREAD_Z * math.sqrt(n.duty_sq * scale * pslow * tpot / out)
                wait = backlog * ptok * pslow
                if now > n.overdue_at:
                    # A node silent past its oldest prompt's due time (stalled) holds
                    # a new prompt at least that much longer (Node.overdue_s).
                    wait += n.overdue_s(now)
                ttft = wait + own * pslow + tpot
                if batch > running:
                    # Queued in the engine: wait for (batch - running) of the running
                    # requests to finish; they complete at about running per service time.
                    engine_wait = (batch - running) * (ttft + out * tpot) / running
                    ttft += engine_wait
                    wait += engine_wait
                if top:
                    # Placed away from the best holder, the prompt's extra prefill delays
                    # whoever queues behind it here, as a backlog of that size would.
                    wait += (work - (prompt - top)) * ptok * pslow
                cost = (ttft_weight * (ttft + queue_weight * wait) + out * tpot) / n.weight_scale
                excess = 0.0
                if ttft > ttft_limit:
                    excess += ttft / ttft_limit - 1.0
                # The SLO is kept at the node's own measured speed where that is clearly
                # slower than its class's (Node.decode_excess): a card 1.4x slow for its
                # class is below what the detector flags, and priced at the class's
                # speed its answers miss.
                if n.decode_excess != 1.0:
                    check *= n.decode_excess
                if check > tpot_limit:
                    excess += check / tpot_limit - 1.0
                if excess:
                    cost += excess * _VIOLATION_COST_S
                    if spill:  # engine room, for an overload: in flight against its batch
                        room = batch / running if batch > running else batch / cap
                        if room < spill_room:
                            spill_room, spill_id = room, n.id
                if cost < best:
                    best, best_id, best_excess = cost, n.id, excess
        self.spilled = best_excess >= self.spill_excess and spill_id is not None
        return spill_id if self.spilled else best_id

    def _shapes(self, nodes: Sequence[NodeView]
                ) -> list[tuple[PerfModel, int, list[NodeView]]]:
        """``nodes`` by engine shape (their prior, their slots) and GPU class, in the
        order each first appears. Kept while the balancer passes the same list (its
        pool's routable nodes, rebuilt when one changes state)."""
        if nodes is self._grouped:
            return self._groups
        groups: dict[tuple[int, int, str], tuple[PerfModel, int, list[NodeView]]] = {}
        for n in nodes:
            g = groups.get((id(n.perf), n.slots, n.spec.gpu_class))
            if g is None:
                g = groups[(id(n.perf), n.slots, n.spec.gpu_class)] = (n.perf, n.slots, [])
            g[2].append(n)
        self._grouped, self._groups = nodes, list(groups.values())
        return self._groups

    def choose_pair(self, prefill: Sequence[NodeView], decode: Sequence[NodeView],
                    req: RequestInfo, now: float, rng: Random,
                    links: LinkMap) -> tuple[str | None, str] | None:
        """A disaggregated pool: the decode node and where its prompt is computed,
        by the same predicted cost as :meth:`choose`, jointly.

        Computed on its decode node, a prompt costs what it costs there in
        :meth:`choose`, plus what its chunks take from the other requests there
        (the externality that disaggregation removes, weighed as the queueing
        term is): each running decode waits out the prompt's compute, and so
        does each request waiting there for its first token, its KV on the way
        from a prefill node (the engine takes it after the prompt's chunks), a
        second of which weighs as a second of TTFT. Without the second part, in
        a live run of ``benchmarks/pd_live.py``, prompts computed on decode
        nodes held up the first tokens of requests handed over meanwhile by up
        to 0.9 s. Computed on a prefill node ``p``, the first
        token comes after ``p``'s backlog and its prefill, the KV transfer over
        the pair's link (:mod:`~tailguard.core.kv_transfer`) and a step of the
        decode node's own (the engine computes the prompt's last token again);
        the answer then streams at the decode node's TPOT, untouched by this
        prompt (a prefill node that decodes too pays the same externality for
        its own streams). Short or cached prompts stay local where that finishes sooner
        (conditional disaggregation falls out of the cost). The prefill nodes
        are ranked alone first and the best ``_PAIR_PREFILLS`` are tried with
        every decode node, so a choice costs ``O(prefill + decode)``.
        """
        if not decode:
            return None
        prompt = req.prompt_tokens
        out, ctx, footprint, ttft_weight = self._terms(req)
        shapes: dict[int, _Quote] = {}
        ttft_limit = self.slo.ttft_s * self.headroom
        tpot_limit = self.slo.tpot_s * self.headroom
        qw = self.queue_weight
        cached = req.cached

        def quote(n: NodeView) -> _Quote:
            q = shapes.get(id(n.perf))
            if q is None or q.slots != n.slots:
                q = shapes[id(n.perf)] = _Quote(n.perf, n.slots, prompt, ctx, footprint)
            return q

        def prompt_time(n: NodeView, q: _Quote) -> tuple[float, float]:
            """The prompt's wait for the node's backlog, and its own compute there."""
            hit = min(cached.get(n.id, 0), prompt - 1) if cached else 0
            own = q.prefill if hit <= 0 else prefill_s(n.perf, 0, prompt - hit)
            pslow = n.class_prefill_slowdown
            backlog = n.prefill_backlog if n.remote_ratio == 0.0 else n.fleet_backlog
            wait = backlog * q.token_s * pslow
            if now > n.overdue_at:
                wait += n.overdue_s(now)
            return wait, own * pslow

        # A prefill node that also decodes (role both) stretches its own streams too.
        ranked: list[tuple[float, float, float, NodeView]] = []
        for p in prefill:
            wait, own = prompt_time(p, quote(p))
            ranked.append(((ttft_weight * (wait + own + qw * wait) + qw * p.decoding * own)
                           / p.weight_scale, wait, own, p))
        ranked.sort(key=lambda r: r[0])
        top = ranked[:_PAIR_PREFILLS]

        best_pair: tuple[str | None, str] | None = None
        best = math.inf
        for d in decode:
            q = quote(d)
            batch = (d.in_flight if d.remote_ratio == 0.0 else d.fleet_in_flight) + 1
            running = batch if batch <= q.cap else q.cap
            step = q.steps.get(running)
            if step is None:
                step = q.steps[running] = decode_step_s(d.perf, running, ctx)
            dslow = d.class_decode_slowdown
            tpot = check = step * dslow
            duty = d.duty
            if duty > 0.0:
                scale = (1.0 + d.remote_ratio) * d.class_prefill_slowdown
                duty *= scale
                tpot = interleaved_tpot(tpot, duty, saturated_step_s(d.perf, running, ctx) * dslow
                                        if duty > _CAP_DUTY else math.inf)
                check = tpot + _SPREAD_Z * math.sqrt(d.duty_sq * scale
                                                     * d.class_prefill_slowdown * tpot / out)
            if d.decode_excess != 1.0:
                check *= d.decode_excess
            tpot_excess = check / tpot_limit - 1.0 if check > tpot_limit else 0.0
            engine_wait = 0.0
            if batch > running:
                engine_wait = (batch - running) * (out * tpot) / running
            # The prompt computed here. Its chunks fill the node's steps: its decodes
            # stretch by its compute, and the requests waiting here for their first
            # token (KV on its way from a prefill node) wait it out.
            wait, own = prompt_time(d, q)
            ttft = wait + own + tpot + engine_wait
            cost = ttft_weight * (ttft + qw * (wait + engine_wait)) + out * tpot \
                + qw * own * (d.decoding + ttft_weight * d.awaiting_kv)
            # (cost, ttft, prefill node, the weight scale of the pair's weaker node)
            options: list[tuple[float, float, str | None, float]] = [
                (cost, ttft, None, d.weight_scale)]
            # ... or on a prefill node, its KV sent here. Two nodes that both do both
            # phases do not split a request: each computes its own prompts, and
            # choosing between them already spreads the prompts' interference.
            kv_per_token = d.perf.model.kv_bytes_per_token
            both = d.spec.role == "both"
            for _, p_wait, p_own, p in top:
                if p.id == d.id or (both and p.spec.role == "both"):
                    continue
                kv = links.transfer_s(p.id, d.id, kv_per_token, prompt)
                # The decode node's own step (its first token) comes after the KV,
                # on top of the step every TTFT here counts.
                ttft = p_wait + p_own + kv + 2.0 * tpot + engine_wait
                cost = ttft_weight * (ttft + qw * (p_wait + engine_wait)) + out * tpot \
                    + qw * p.decoding * p_own
                options.append((cost, ttft, p.id, min(d.weight_scale, p.weight_scale)))
            for cost, ttft, p_id, weight_scale in options:
                excess = tpot_excess
                if ttft > ttft_limit:
                    excess += ttft / ttft_limit - 1.0
                total = cost / weight_scale + excess * _VIOLATION_COST_S
                if total < best:
                    best, best_pair = total, (p_id, d.id)
        return best_pair


def _floor(run: tuple[float, _Quote, list[NodeView]]) -> float:
    return run[0]


class _Quote:
    """What one engine shape (a PerfModel with a slot count) predicts for one request,
    whatever its load: the running-batch cap, the prompt's own prefill, the per-token
    cost of a backlog, and decode steps by running batch as they are asked for."""

    __slots__ = ("cap", "perf", "prefill", "slots", "steps", "token_s")

    def __init__(self, perf: PerfModel, slots: int, prompt: int, ctx: float,
                 footprint: float) -> None:
        self.perf = perf
        self.slots = slots
        self.cap = running_batch(perf, slots, slots, footprint)
        self.token_s = prefill_token_s(perf)
        self.prefill = prefill_s(perf, 0, prompt)
        self.steps: dict[int, float] = {}
