"""The balancer: the one facade both drivers (gateway and simulator) call.

Events in, decisions out::

    ticket = balancer.pick("llama-3.1-8b", prompt_tokens=812, max_tokens=256, now=t)
    ...                                  # the driver sends the request to ticket.node_id
    balancer.on_first_token(ticket, now=t1)
    balancer.on_finish(ticket, now=t2, outcome=Outcome.OK, output_tokens=143)
    events = balancer.tick(now)          # periodic: estimates, detection, state changes

A :class:`Ticket` is the request's permit on its node: it is released exactly
once (``on_finish`` a second time is ignored and counted), whatever the ending
(success, upstream error, timeout, client disconnect). Pools are keyed by the
model name clients send; each has its own policy and SLO.

The facade wires the components and records: :class:`~tailguard.core.pool.Pool`
(a model's nodes, policy and statistics) and its tickets,
:class:`~tailguard.core.learner.Learner` (what a first token, a stream report
or a finish teaches the estimators and the detector, and each permit's
release), :class:`~tailguard.core.queueing.Admission` (the queues: admit,
poll, drain, shed, presumed prefills), :class:`~tailguard.core.shared.Peers`
(the other gateway replicas) and the outlier detector. None of them calls
the recorder: recording wraps the public entry points here, so a call made
inside another (a queue drain picking a node) is recorded once, as part of
the outer one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from random import Random
from typing import Any

from tailguard.core.admission import Shed, Waiter
from tailguard.core.events import Event as Event  # re-exported: drivers import it here
from tailguard.core.fleet import (
    OVERDUE_FACTOR,
    OWN_MARGIN,
    OWN_SAMPLES,
    Actor,
    EngineReport,
    Node,
    NodeSpec,
    NodeState,
    Outcome,
)
from tailguard.core.fleet.lifecycle import Lifecycle
from tailguard.core.hardware import DEFAULT_CATALOG, DEFAULT_PERF, Catalog, PerfModel, PerfParams
from tailguard.core.learner import Learner
from tailguard.core.limit_plan import node_limiter
from tailguard.core.outliers import OutlierConfig, OutlierDetector
from tailguard.core.outliers.links import LinkWatch
from tailguard.core.pipeline import PipelinePerf
from tailguard.core.policies import RequestInfo, make_pair_policy, make_policy
from tailguard.core.policies.tailguard import TailguardPolicy
from tailguard.core.pool import (
    DECODE as DECODE,
    PREFILL as PREFILL,
    PREFIX_BLOCK_TOKENS as PREFIX_BLOCK_TOKENS,
    WHOLE as WHOLE,
    Pool as Pool,
    PoolConfig as PoolConfig,
    Ticket as Ticket,
    decision_dict as decision_dict,
    pair_dict as pair_dict,
)
from tailguard.core.predict import prefill_chunks, running_batch
from tailguard.core.probes import HealthProbes, ProbeRule
from tailguard.core.queueing import Admission, Decision
from tailguard.core.record import event_to_dict, pool_to_dict, record_init, spec_to_dict
from tailguard.core.shared import Peers, merged_speed
from tailguard.core.snapshot import FleetSnapshot, snapshot
from tailguard.errors import ConfigError

# When the pool's model (or a node's GPU) is not in the catalog, the prior has
# the shape of these and the node's measured speed corrects its scale.
FALLBACK_MODEL = "llama-3.1-8b"
FALLBACK_GPU = "L40S"

class Balancer:
    """Routes requests to nodes and keeps the fleet's live accounting."""

    def __init__(
        self,
        nodes: Iterable[NodeSpec],
        pools: Iterable[PoolConfig],
        rng: Random,
        catalog: Catalog = DEFAULT_CATALOG,
        perf_params: PerfParams = DEFAULT_PERF,
        recorder: Callable[[dict[str, Any]], None] | None = None,
        outliers: OutlierConfig | None = None,
        probes: ProbeRule | None = None,
    ) -> None:
        self.rng = rng
        # Straggler/failure detection and the quarantine lifecycle (on by default).
        cfg = outliers or OutlierConfig()
        self.outliers: OutlierDetector | None = OutlierDetector(cfg) if cfg.enabled else None
        self.catalog = catalog
        self.perf_params = perf_params
        self.recorder = recorder
        self.pools: dict[str, Pool] = {}
        self.nodes: dict[str, Node] = {}
        self.link_prices: dict[tuple[str, str], float] = {}  # LinkMap.slowness, shared
        self._ticket_seq = 0
        self.admission = Admission(self.pools, self._pick)
        # Slow KV links between disaggregated pairs: judged where nodes are.
        self.links = LinkWatch() if self.outliers is not None else None
        self.learner = Learner(self.outliers, self.admission, self.links)
        self.peers = Peers(self.nodes, self.pools, self.outliers)
        self.probes = HealthProbes(probes or ProbeRule())
        self._priors: dict[tuple[object, ...], PerfModel] = {}
        if recorder is not None:
            recorder(record_init(rng, perf_params, cfg, self.probes.rule))
        for pc in pools:
            self.add_pool(pc)
        for spec in nodes:
            self.add_node(spec)

    # -- fleet management ------------------------------------------------------

    def add_pool(self, config: PoolConfig) -> Pool:
        policy = make_policy(config.policy, config.slo, config.policy_options,
                             field=f"pools.{config.name}.policy")
        if self.recorder is not None:
            self.recorder({"op": "add_pool", "config": pool_to_dict(config)})
        pool = Pool(config, policy, make_pair_policy(config.policy, policy, config.slo,
                                                     config.policy_options), self.link_prices)
        self.pools[config.name] = pool
        return pool

    def replace_pool(self, config: PoolConfig) -> Pool:
        """Swap a pool's policy and SLO, keeping its nodes and running statistics."""
        old = self.pools.get(config.name)
        if self.recorder is not None:
            self.recorder({"op": "replace_pool", "config": pool_to_dict(config)})
        recorder, self.recorder = self.recorder, None  # one record for the whole swap
        try:
            pool = self.add_pool(config)
        finally:
            self.recorder = recorder
        if old is not None:
            pool.nodes = old.nodes
            pool.mean_prompt = old.mean_prompt
            pool.mean_output = old.mean_output
            if old.prefix is not None and old.prefix.block_tokens == config.prefix_block_tokens:
                pool.prefix = old.prefix  # the engines' caches did not change
            if old.config.hedging == config.hedging:
                pool.hedger = old.hedger  # its learnt TTFT quantiles still hold
            pool.invalidate()
            self.admission.carry(old, pool)
        return pool

    def pool_for(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def _prior(self, spec: NodeSpec) -> PerfModel:
        model = None
        for name in spec.models:
            pool = self.pools.get(name)
            cat_name = pool.config.catalog_model if pool and pool.config.catalog_model else name
            model = self.catalog.find_model(cat_name)
            if model is not None:
                break
        if model is None:
            model = self.catalog.model(FALLBACK_MODEL)
        gpu = spec.gpu or self.catalog.gpu(FALLBACK_GPU)
        # Nodes of one shape share one (immutable) prior: the router prices a shape
        # once per request, not once per node (policies/tailguard.py).
        key = (gpu, model, spec.tp, repr(spec.layout))  # a layout may hold a list
        perf = self._priors.get(key)
        if perf is not None:
            return perf
        if spec.layout is not None:
            perf = PipelinePerf(gpu, model, spec.tp, self.perf_params, layout=spec.layout)
        else:
            perf = PerfModel(gpu, model, spec.tp, self.perf_params)
            if not perf.fits:
                # The engine evidently runs it (quantised, offloaded...): keep the
                # shape of the prior and let measurements set its scale.
                perf = PerfModel(gpu, self.catalog.model("llama-3.2-3b"), spec.tp,
                                 self.perf_params)
        self._priors[key] = perf
        return perf

    def add_node(self, spec: NodeSpec) -> Node:
        if spec.id in self.nodes:
            raise ConfigError(f"nodes.{spec.id}", "duplicate node id")
        if self.recorder is not None:
            self.recorder({"op": "add_node", "spec": spec_to_dict(spec)})
        node = Node(spec, self._prior(spec))
        node.watch_moves(self._state_changed)
        self.nodes[spec.id] = node
        for name in spec.models:
            pool = self.pools.get(name)
            if pool is None:
                pool = self.add_pool(PoolConfig(name))
            pool.nodes.append(node)
            pool.invalidate()
            if pool.prefix is not None:
                pool.prefix.set_kv(node.id, node.perf.kv_capacity_tokens)
        node.use_limiter(node_limiter(node, self.pools))
        return node

    def remove_node(self, node_id: str) -> None:
        if self.recorder is not None:
            self.recorder({"op": "remove_node", "node": node_id})
        node = self.nodes.pop(node_id)
        self.probes.forget(node_id)
        if self.outliers is not None:
            self.outliers.forget(node_id)
        for pool in self.pools.values():
            if node in pool.nodes:
                pool.nodes.remove(node)
                pool.invalidate()
            if pool.prefix is not None:
                pool.prefix.forget(node_id)

    def set_state(self, node_id: str, state: NodeState, actor: Actor = Actor.OPERATOR) -> None:
        """Move a node as an operator (or, ``actor``, the driver's health probes) may
        (``core/fleet/lifecycle.py``); IllegalTransition for a move it may not make."""
        node = self.nodes[node_id]
        if node.state is state:
            return
        if self.recorder is not None:
            rec = {"op": "set_state", "node": node_id, "state": state.value}
            if actor is not Actor.OPERATOR:
                rec["by"] = actor.value
            self.recorder(rec)
        node.move(state, actor)

    def on_probe(self, node_id: str, ok: bool, now: float) -> bool | None:
        """A health probe's result (``core/probes.py``): a node that fails enough in a row
        goes down, a down one that passes enough is back. Returns the probes' verdict
        when it changes (False: out of rotation, True: back), else None."""
        if self.recorder is not None:
            self.recorder({"t": now, "op": "probe", "node": node_id, "ok": ok})
        node = self.nodes.get(node_id)
        if node is None:
            return None
        verdict = self.probes.observe(node_id, ok)
        if verdict is False and node.state.routable:
            node.move(NodeState.DOWN, Actor.HEALTH)
        elif verdict is True and node.state is NodeState.DOWN:
            node.move(NodeState.HEALTHY, Actor.HEALTH)
        return verdict

    def _state_changed(self, node: Lifecycle, was: NodeState) -> None:
        """Every move of a node, whoever made it: its pools re-list their routable nodes."""
        down = node.state is NodeState.DOWN
        for pool in self.pools.values():
            if node in pool.nodes:
                pool.invalidate()
                if down and pool.prefix is not None:
                    pool.prefix.forget(node.id)  # a restarted engine's cache is empty

    # -- the request path ------------------------------------------------------

    def pick(
        self,
        model: str,
        prompt_tokens: int,
        now: float,
        max_tokens: int | None = None,
        priority: int = 1,
        exclude: Sequence[str] = (),
        prefix: Sequence[int] = (),
        session: str | None = None,
    ) -> Ticket | None:
        """Choose a node and take a permit on it; None if no node can take it.

        ``prefix``: the hashes of the prompt's blocks (the pool's
        ``prefix_block_tokens`` each, chained), for prefix-cache affinity;
        ``session``: the client's session key, for session affinity."""
        ticket = self._pick(model, prompt_tokens, now, max_tokens, priority, exclude, prefix,
                            session)
        if self.recorder is not None:
            self._record("pick", now, model, prompt_tokens, max_tokens, priority, exclude,
                         prefix, session,
                         node=ticket.node_id if ticket is not None else None,
                         ticket=ticket.id if ticket is not None else None,
                         **pair_dict(ticket))
        return ticket

    def _record(self, op: str, now: float, model: str, prompt_tokens: int,
                max_tokens: int | None, priority: int, exclude: Sequence[str],
                prefix: Sequence[int], session: str | None, **result: Any) -> None:
        """Hand one routing call (its inputs and ``result``) to the recorder."""
        assert self.recorder is not None
        rec: dict[str, Any] = {"t": now, "op": op, "model": model,
                               "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                               "priority": priority, "exclude": list(exclude), **result}
        if prefix:
            rec["prefix"] = list(prefix)
        if session is not None:
            rec["session"] = session
        self.recorder(rec)

    def _pick(self, model: str, prompt_tokens: int, now: float, max_tokens: int | None,
              priority: int, exclude: Sequence[str], prefix: Sequence[int],
              session: str | None) -> Ticket | None:
        """:meth:`pick` unrecorded: admit and the queue record the picks they make
        as part of their own decisions."""
        self.admission.settle(now)
        pool = self.pools.get(model)
        if pool is None:
            return None
        nodes: Sequence[Node] = pool.eligible()
        if exclude:
            nodes = [n for n in nodes if n.id not in exclude]
        if pool.limited:
            roomy = [n for n in nodes if n.limiter is None or n.limiter.has_room()]
            if len(roomy) < len(nodes):  # (else the pool's own list, which policies key on)
                nodes = roomy
        if not nodes:
            return None
        hits = pool.index().match(prefix) if prefix else {}
        req = RequestInfo(model, prompt_tokens, max_tokens, pool.mean_output, pool.mean_prompt,
                          priority, self._cached(pool, hits), prefix,
                          pool.config.prefix_block_tokens, session)
        if pool.disaggregated:
            return self._pick_pair(pool, nodes, req, now, prefix, hits)
        node_id = None
        if self.outliers is not None and self.outliers.on_probation:
            node_id = self.outliers.canary(nodes, self.rng)  # a canary request
        if node_id is None:
            node_id = pool.policy.choose(nodes, req, now, self.rng)
            if node_id is not None and isinstance(pool.policy, TailguardPolicy) \
                    and pool.policy.spilled:
                self.nodes[node_id].kv_short(now)  # its samples now are the overload's
        if node_id is None:
            return None
        self._ticket_seq += 1
        if pool.dispatch_hook is not None:
            pool.dispatch_hook(node_id, req)
        return self._issue(self.nodes[node_id], pool, prompt_tokens, now, prefix,
                           hits.get(node_id, 0))

    def _pick_pair(self, pool: Pool, nodes: Sequence[Node], req: RequestInfo, now: float,
                   prefix: Sequence[int], hits: Mapping[str, int]) -> Ticket | None:
        """A pool whose nodes have roles: the decode node and where the prompt is
        computed (:class:`~tailguard.core.policies.base.PairPolicy`). A prompt computed
        elsewhere is a second ticket, the decode ticket's ``prefill``."""
        prefill = [n for n in nodes if n.spec.prefills]
        decode = [n for n in nodes if n.spec.decodes]
        if self.outliers is not None and self.outliers.on_probation:
            canary_id = self.outliers.canary(nodes, self.rng)
            if canary_id is not None:  # on probation: it serves its phase of this one
                canary = self.nodes[canary_id]
                if canary.spec.decodes:
                    decode = [canary]
                else:
                    prefill = [canary]
        assert pool.pairs is not None
        pair = pool.pairs.choose_pair(prefill, decode, req, now, self.rng, pool.links)
        if pair is None:
            return None
        prefill_id, decode_id = pair
        record = getattr(pool.pairs, "on_dispatch_pair", None)
        if record is not None:  # per-phase policies that remember where requests went
            record(prefill_id, decode_id, req)
        elif pool.dispatch_hook is not None:
            pool.dispatch_hook(decode_id, req)
        node = self.nodes[decode_id]
        self._ticket_seq += 1
        if prefill_id is None or prefill_id == decode_id:
            return self._issue(node, pool, req.prompt_tokens, now, prefix,
                               hits.get(decode_id, 0))
        ticket = self._issue(node, pool, req.prompt_tokens, now, prefix, 0, DECODE)
        self._ticket_seq += 1
        ticket.prefill = self._issue(self.nodes[prefill_id], pool, req.prompt_tokens, now,
                                     prefix, hits.get(prefill_id, 0), PREFILL)
        return ticket

    def hand_off(self, ticket: Ticket, now: float) -> bool:
        """The prompt of a disaggregated request is computed: its prefill ticket ends
        (it taught the prefill node's speed at its first token) and the decode node
        now waits for the KV and its first token. False if nothing was pending."""
        pre = ticket.prefill
        if pre is None or ticket.released:
            return False
        if self.recorder is not None:
            self.recorder({"t": now, "op": "hand_off", "ticket": ticket.id})
        self.learner.hand_off(ticket, pre, now)
        return True

    @staticmethod
    def _cached(pool: Pool, hits: Mapping[str, int]) -> Mapping[str, int]:
        """Blocks held per node, as prompt tokens the node need not prefill."""
        if not hits:
            return hits
        bt = pool.config.prefix_block_tokens
        return {node: k * bt for node, k in hits.items()}

    def rank(self, model: str, prompt_tokens: int, now: float, max_tokens: int | None = None,
             priority: int = 1, exclude: Sequence[str] = (), n: int = 1,
             prefix: Sequence[int] = (), session: str | None = None) -> list[str]:
        """The nodes :meth:`pick` would choose now, best first, up to ``n``, taking no
        permit: an ordered fallback list (the endpoint picker hands it to the data
        plane, whose retries walk it; :meth:`take` then accounts for the one used)."""
        pool = self.pools.get(model)
        out: list[str] = []
        if pool is not None and n > 0:
            nodes = [x for x in pool.eligible() if x.id not in exclude and not (
                pool.limited and x.limiter is not None and not x.limiter.has_room())]
            hits = pool.index().match(prefix) if prefix else {}
            req = RequestInfo(model, prompt_tokens, max_tokens, pool.mean_output,
                              pool.mean_prompt, priority, self._cached(pool, hits), prefix,
                              pool.config.prefix_block_tokens, session)
            # A copy chooses: a stateful policy (round robin's turn) must not move on
            # for choices that send nothing.
            policy = copy.copy(pool.policy)
            while nodes and len(out) < n:
                node_id = policy.choose(nodes, req, now, self.rng)
                if node_id is None:
                    break
                out.append(node_id)
                nodes = [x for x in nodes if x.id != node_id]
        if self.recorder is not None:
            self._record("rank", now, model, prompt_tokens, max_tokens, priority, exclude,
                         prefix, session, n=n, nodes=out)
        return out

    def take(self, model: str, node_id: str, prompt_tokens: int, now: float,
             prefix: Sequence[int] = ()) -> Ticket | None:
        """A permit on ``node_id`` whatever its load or limit, because the request is
        there already (the data plane fell back to it); None for a node not known."""
        pool = self.pools.get(model)
        node = self.nodes.get(node_id)
        if pool is None or node is None:
            return None
        self._ticket_seq += 1
        if self.recorder is not None:
            rec = {"t": now, "op": "take", "model": model, "node": node_id,
                   "prompt_tokens": prompt_tokens, "ticket": self._ticket_seq}
            if prefix:
                rec["prefix"] = list(prefix)
            self.recorder(rec)
        hit = pool.index().match(prefix).get(node_id, 0) if prefix else 0
        if pool.dispatch_hook is not None:
            pool.dispatch_hook(node_id, RequestInfo(model, prompt_tokens, prefix=prefix,
                               block_tokens=pool.config.prefix_block_tokens))
        return self._issue(node, pool, prompt_tokens, now, prefix, hit)

    def _issue(self, node: Node, pool: Pool, prompt_tokens: int, now: float,
               prefix: Sequence[int] = (), hit_blocks: int = 0, leg: int = WHOLE) -> Ticket:
        ticket = Ticket(node, pool, prompt_tokens, now, self._ticket_seq, prefix, hit_blocks,
                        leg)
        if prefix:
            pool.index().insert(node.id, prefix)
        node.dispatched(ticket.backlog, prompt_tokens)
        if leg == DECODE:
            # Its first token waits for a prompt computed elsewhere: the node is
            # not waiting for it until the hand-off (Learner.hand_off).
            if node.limiter is not None:
                ticket.permit = node.limiter.acquire()
            return ticket
        node.note_kv(now, pool.mean_output, node.perf.kv_capacity_tokens, 1.0 + node.remote_ratio)
        chunks, step, ramp = 0, 0.0, 1.0
        if ticket.backlog > 0:
            running = running_batch(node.perf, node.slots, node.fleet_in_flight,
                                    pool.mean_prompt + pool.mean_output)
            ctx = pool.mean_prompt + pool.mean_output * 0.5
            ticket.work, chunks, step, ramp = prefill_chunks(node.perf, ticket.backlog, running,
                                                             ctx)
            node.add_dispatched_work(ticket.work)
        slowdown = node.class_prefill_slowdown
        expected = ticket.expected_ttft() * slowdown
        ticket.allowance = expected * OVERDUE_FACTOR
        if ticket.batch_at_dispatch <= node.slots:
            ticket.due = now + ticket.allowance
        # else every engine slot is taken: due once one frees (Node.slot_freed)
        if ticket.work > 0.0:
            # The engine computes waiting prompts first come, first served, a chunk
            # a step: this one once those ahead of it are done, over as many
            # steps as it has chunks, a growing share of each.
            begin = node.work_free_at(now)
            ticket.accrual = node.start_work(ticket.work, begin,
                                             begin + ticket.work * slowdown + chunks * step,
                                             now, chunks, ramp)
        node.awaits(ticket)
        if node.limiter is not None:
            ticket.permit = node.limiter.acquire()
        pool.mean_prompt += (prompt_tokens - pool.mean_prompt) * 0.01
        return ticket

    # -- what each request teaches (core/learner.py) -----------------------------

    def on_first_token(self, ticket: Ticket, now: float, *, defer_prefill: bool = False) -> None:
        """The request's first token arrived (see :meth:`Learner.first_token`)."""
        took = self.learner.first_token(ticket, now, defer_prefill=defer_prefill)
        if took and self.recorder is not None:
            rec: dict[str, Any] = {"t": now, "op": "first_token", "ticket": ticket.id}
            if defer_prefill:
                rec["defer"] = True
            self.recorder(rec)

    def on_finish(self, ticket: Ticket, now: float, outcome: Outcome, output_tokens: int, *,
                  judged: bool = True, timed: bool = True,
                  cached_tokens: int | None = None) -> None:
        """The request ended, whatever the ending: its permit is released once
        (see :meth:`Learner.finish`)."""
        if self.recorder is not None:
            rec: dict[str, Any] = {"t": now, "op": "finish", "ticket": ticket.id,
                                   "outcome": outcome.value, "output_tokens": output_tokens}
            if not judged:
                rec["judged"] = False
            if not timed:
                rec["timed"] = False
            if cached_tokens is not None:
                rec["cached_tokens"] = cached_tokens
            self.recorder(rec)
        self.learner.finish(ticket, now, outcome, output_tokens, judged=judged, timed=timed,
                            cached_tokens=cached_tokens)

    def on_stream_progress(self, ticket: Ticket, tokens: int, now: float) -> float:
        """A stream's tokens so far (see :meth:`Learner.stream_progress`); only the
        calls that judge a piece change anything, so only those are recorded."""
        judged_to = ticket.seg_t
        due = self.learner.stream_progress(ticket, tokens, now)
        if ticket.seg_t != judged_to and self.recorder is not None:
            self.recorder({"t": now, "op": "progress", "ticket": ticket.id, "tokens": tokens})
        return due

    def on_stream_silence(self, ticket: Ticket, since: float, now: float) -> None:
        """The ticket's stream sent nothing from ``since`` to ``now`` (see
        :meth:`Learner.stream_silent`); only the gaps told (STALL_S or more) are
        recorded."""
        if self.recorder is not None:
            self.recorder({"t": now, "op": "silence", "ticket": ticket.id, "since": since})
        self.learner.stream_silent(ticket, since, now)

    def blame(self, node_id: str, outcome: Outcome, now: float) -> None:
        """A node failure seen outside any ticket (see :meth:`Learner.blame`)."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        if self.recorder is not None:
            self.recorder({"t": now, "op": "blame", "node": node_id, "outcome": outcome.value})
        self.learner.blame(node, outcome, now)

    def expect_no_first_token(self, ticket: Ticket, now: float) -> None:
        """A non-streamed request: its prompt is presumed prefilled when due
        (see :meth:`Admission.expect_no_first_token`)."""
        took = self.admission.expect_no_first_token(ticket, now)
        if took and self.recorder is not None:
            self.recorder({"t": now, "op": "no_first_token", "ticket": ticket.id})

    @property
    def double_release(self) -> int:
        """Finishes told for a ticket already released (each ignored)."""
        return self.learner.double_release

    @property
    def on_queue_decision(self) -> Callable[[], None] | None:
        """Called (no arguments) when queue decisions await :meth:`poll_queue`: lets an
        event-loop driver wake its queued requests without polling."""
        return self.admission.on_decision

    @on_queue_decision.setter
    def on_queue_decision(self, callback: Callable[[], None] | None) -> None:
        self.admission.on_decision = callback

    # -- concurrency limits and the admission queue (core/limits.py, admission.py) --

    def admit(
        self,
        model: str,
        prompt_tokens: int,
        now: float,
        max_tokens: int | None = None,
        priority: int = 1,
        exclude: Sequence[str] = (),
        ttft_s: float | None = None,
        size_bytes: int = 0,
        payload: Any = None,
        prefix: Sequence[int] = (),
        session: str | None = None,
    ) -> Ticket | Waiter | Shed | None:
        """A Ticket (dispatched now), a Waiter (queued), a Shed (answer 429 now)
        or None (no routable node): see :meth:`Admission.admit`."""
        got = self.admission.admit(model, prompt_tokens, now, max_tokens, priority, exclude,
                                   ttft_s, size_bytes, payload, prefix, session)
        if self.recorder is not None:
            self._record("admit", now, model, prompt_tokens, max_tokens, priority, exclude,
                         prefix, session, ttft_s=ttft_s, size_bytes=size_bytes,
                         result=decision_dict(got))
        return got

    def poll_queue(self, now: float) -> list[Decision]:
        """Queue decisions since the last call (see :meth:`Admission.poll`)."""
        out = self.admission.poll(now)
        if self.recorder is not None:
            self.recorder({"t": now, "op": "poll_queue", "decisions": [
                {"waiter": w.wid, **decision_dict(d)} for w, d in out]})
        return out

    def cancel_queued(self, waiter: Waiter) -> bool:
        """The client left while queued: False if no longer queued."""
        if self.recorder is not None:
            self.recorder({"op": "cancel_queued", "waiter": waiter.wid})
        return self.admission.cancel(waiter)

    def on_engine_metrics(
        self, node_id: str, now: float, running: int, waiting: int, kv_usage: float,
        preemptions: int = -1,
    ) -> None:
        if self.recorder is not None:
            self.recorder({"t": now, "op": "engine_metrics", "node": node_id, "running": running,
                           "waiting": waiting, "kv_usage": kv_usage,
                           "preemptions": preemptions})
        node = self.nodes.get(node_id)
        if node is None:
            return
        node.report_engine(EngineReport(running, waiting, kv_usage, now, preemptions))

    def on_peers(self, now: float, reports: Mapping[str, Mapping[str, Any]],
                 leader: bool) -> list[Event]:
        """The other gateway replicas' latest reports (``core/shared.py``); ``leader``: this
        replica decides node states. Returns the state changes taken from the leader."""
        if self.recorder is not None:
            self.recorder({"t": now, "op": "peers", "reports": reports, "leader": leader})
        events = self.peers.merge(now, reports, leader)
        if events and self.recorder is not None:
            self.recorder({"t": now, "op": "events", "events": [event_to_dict(e) for e in events]})
        return events

    def states(self) -> dict[str, NodeState]:
        """Each node's state now (a copy): the cheap read for a watcher that polls."""
        return {nid: n.state for nid, n in self.nodes.items()}

    def snapshot(self, now: float) -> FleetSnapshot:
        """A frozen read model of the fleet for observers (``core/snapshot.py``)."""
        return snapshot(self.nodes, self.pools, self.outliers, self.probes, self.double_release,
                        now)

    def report(self, now: float, leader: bool) -> dict[str, Any]:
        """What this replica tells the others (``core/shared.py``); changes nothing."""
        return self.peers.report(now, leader)

    def tick(self, now: float) -> list[Event]:
        """Periodic work; returns the events it produced (state changes)."""
        if self.recorder is None:
            return self._tick(now)
        self.recorder({"t": now, "op": "tick"})
        events = self._tick(now)
        if events:
            self.recorder({"t": now, "op": "events", "events": [event_to_dict(e) for e in events]})
        return events

    def _tick(self, now: float) -> list[Event]:
        self.admission.settle(now)
        for node in self.nodes.values():
            node.decay_duty(now)
        self._refresh_class_slowdowns()
        if self.outliers is None:
            return []
        events = self.outliers.tick(now, self.nodes, self.pools.values(), self.rng)
        if self.links is not None and self.links.samples:
            events += self.links.tick(now, self.link_prices)
        return events

    def _refresh_class_slowdowns(self) -> None:
        # The class's speed is its healthy nodes' (all of them if none is): a
        # straggler the outlier detector caught is priced by its own weight
        # scale, and must not make its peers look slower than they are.
        sums: dict[str, list[float]] = {}
        for node in self.nodes.values():
            acc = sums.setdefault(node.spec.gpu_class, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            d, p = node.capacity.decode.log_ratio, node.capacity.prefill.log_ratio
            if node.remote_speed is not None:  # other replicas' estimates too (core/shared.py)
                d, p = merged_speed(node.capacity, node.remote_speed)
            acc[0] += d
            acc[1] += p
            acc[2] += 1.0
            if node.state is NodeState.HEALTHY:
                acc[3] += d
                acc[4] += p
                acc[5] += 1.0
        for node in self.nodes.values():
            d, p, n, hd, hp, hn = sums[node.spec.gpu_class]
            if hn:
                d, p, n = hd, hp, hn
            # Its own excess is against the others of its class (in a class of two,
            # the mean with itself would halve a slow card's excess in log terms);
            # so are the prefill speeds its decode is judged at.
            counted = bool(hn) and node.state is NodeState.HEALTHY and n > 1.0
            mine_d, mine_p = node.capacity.decode.log_ratio, node.capacity.prefill.log_ratio
            if node.remote_speed is not None:
                mine_d, mine_p = merged_speed(node.capacity, node.remote_speed)
            excess = 1.0
            if node.capacity.decode.samples >= OWN_SAMPLES:
                others, k = (d - mine_d, n - 1.0) if counted else (d, n)
                if k > 0.0:
                    mine_over = math.exp(mine_d - others / k)
                    if mine_over > OWN_MARGIN:
                        excess = mine_over
            peers_p = (p - mine_p) / (n - 1.0) if counted else p / n
            node.set_class_speed(math.exp(d / n), math.exp(p / n), excess, math.exp(peers_p))
