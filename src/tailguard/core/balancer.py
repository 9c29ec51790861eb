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
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from random import Random
from typing import Any

from tailguard.core import shared
from tailguard.core.admission import AdmissionConfig, AdmissionQueue, Shed, Waiter
from tailguard.core.events import Event as Event  # re-exported: drivers import it here
from tailguard.core.fleet import (
    OVERDUE_FACTOR,
    OWN_MARGIN,
    OWN_SAMPLES,
    Node,
    NodeSpec,
    NodeState,
    Outcome,
)
from tailguard.core.hardware import DEFAULT_CATALOG, DEFAULT_PERF, Catalog, PerfModel, PerfParams
from tailguard.core.limits import LimitConfig, Limiter, make_limit, planned_limit
from tailguard.core.outliers import OutlierConfig, OutlierDetector
from tailguard.core.pipeline import PipelinePerf
from tailguard.core.placement import ChunkCache, unsuitable
from tailguard.core.policies import DEFAULT_POLICY, Policy, RequestInfo, Slo, make_policy
from tailguard.core.predict import (
    decode_step_s,
    interleaved_tpot,
    prefill_extra_s,
    prefill_s,
    running_batch,
    saturated_step_s,
)
from tailguard.core.prefix import PrefixIndex
from tailguard.core.record import event_to_dict, pool_to_dict, record_init, spec_to_dict
from tailguard.core.shared import merged_speed
from tailguard.errors import ConfigError

# When the pool's model (or a node's GPU) is not in the catalog, the prior has
# the shape of these and the node's measured speed corrects its scale.
FALLBACK_MODEL = "llama-3.1-8b"
FALLBACK_GPU = "L40S"

# Answers shorter than this teach no decode speed. Their time per token spans
# one or a few engine steps, and under a burst of short requests most steps
# also carry other requests' prefill chunks, so a 2-token stream read 2.8x the
# decode roofline on healthy H100s and degraded them. The limiter still sees
# them: their TPOT is what their clients got.
MIN_DECODE_TOKENS = 8

# With no cached-token count from the engine, a TTFT this far below what the
# node's learned speed predicts is taken for a prefix-cache hit (a cached
# prompt on llama.cpp: 18 ms against 578 ms uncached) and teaches nothing.
CACHE_HIT_RATIO = 0.25

# Tokens per hashed prompt block when the driver hashes prompts (the gateway);
# a simulated workload brings its own (Mooncake's traces: 512).
PREFIX_BLOCK_TOKENS = 128


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: the nodes serving a model name, with its policy and SLO."""

    name: str
    policy: str = DEFAULT_POLICY
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    slo: Slo = field(default_factory=Slo)
    catalog_model: str | None = None  # the catalog entry for the roofline prior
    limits: LimitConfig | None = None  # per-node concurrency limits (core/limits.py)
    admission: AdmissionConfig | None = None  # the pool's queue (core/admission.py)
    prefix_block_tokens: int = PREFIX_BLOCK_TOKENS  # what one hash of a request's prefix covers


class Ticket:
    """A dispatched request's permit on a node, and what is measured about it."""

    __slots__ = (
        "accrual",
        "ahead_tokens",
        "backlog",
        "batch_at_dispatch",
        "batch_at_first",
        "blocks",
        "due",
        "hit_blocks",
        "id",
        "node",
        "pending_prefill",
        "permit",
        "pool",
        "presumed",
        "prompt_tokens",
        "released",
        "seg_batch",
        "seg_t",
        "seg_tokens",
        "seg_work",
        "t_dispatch",
        "t_first",
        "work",
        "work_at_first",
    )

    def __init__(self, node: Node, pool: Pool, prompt_tokens: int, now: float,
                 ticket_id: int = 0, blocks: Sequence[int] = (), hit_blocks: int = 0) -> None:
        self.id = ticket_id  # the balancer's sequence number: names it in recordings
        self.node = node
        self.pool = pool
        self.prompt_tokens = prompt_tokens
        self.blocks = blocks  # the prompt's hashed blocks
        self.hit_blocks = hit_blocks  # how many the router expected the node to hold
        # The prompt work it adds to the node's backlog: what the node is expected to compute.
        hit = min(hit_blocks * pool.config.prefix_block_tokens, max(0, prompt_tokens - 1))
        self.backlog = prompt_tokens - hit
        self.t_dispatch = now
        self.t_first = -1.0
        self.due = math.inf  # its first token is overdue after (set at dispatch: Node.overdue_s)
        self.ahead_tokens = node.fleet_backlog
        self.batch_at_dispatch = node.fleet_in_flight + 1
        self.batch_at_first = 0
        self.pending_prefill = False  # its prefill sample waits for the cached-token count
        self.presumed = False  # prompt counted as prefilled without a first token
        self.released = False
        self.permit: Limiter | None = None  # the node's limiter, when its pool has limits
        # The decode piece under way (on_stream_progress), from the first token on:
        # since when, from which token, the node's load then.
        self.seg_t = -1.0
        self.seg_tokens = 1
        self.seg_batch = 0
        self.seg_work = 0.0  # the node's prompt work computed by seg_t (Node.work_at)
        self.work_at_first = 0.0  # ... and by the first token
        self.work = 0.0  # what its prompt adds to the node's steps (predict.prefill_extra_s)
        self.accrual: list[float] | None = None  # its work as the node accrues it (start_work)

    @property
    def node_id(self) -> str:
        return self.node.id

    def expected_ttft(self, cached_tokens: int = 0) -> float:
        """Roofline TTFT for the conditions at dispatch (its prompt, the backlog
        ahead of it, the batch it joined), without the node's learned corrections:
        the router's prediction before its slowdown factor. ``cached_tokens`` of
        the prompt were served from the engine's prefix cache: no prefill work."""
        perf = self.node.perf
        pool = self.pool
        step = decode_step_s(perf, self.running(), pool.mean_prompt + pool.mean_output / 2)
        return prefill_s(perf, self.ahead_tokens, self.uncached(cached_tokens)) + step

    def running(self) -> int:
        """Sequences the engine ran at once when this request joined (at most its slots)."""
        node, pool = self.node, self.pool
        return running_batch(node.perf, node.slots, self.batch_at_dispatch,
                             pool.mean_prompt + pool.mean_output)

    def uncached(self, cached_tokens: int) -> int:
        """The prompt tokens the engine had to compute itself."""
        return max(0, self.prompt_tokens - cached_tokens)


class Pool:
    """Live state of one pool: its nodes, policy and request statistics."""

    __slots__ = ("_eligible", "config", "dispatch_hook", "limited", "mean_output", "mean_prompt",
                 "name", "nodes", "policy", "prefix", "queue")

    def __init__(self, config: PoolConfig, policy: Policy) -> None:
        self.config = config
        self.name = config.name
        self.policy = policy
        self.nodes: list[Node] = []
        self._eligible: list[Node] | None = None
        # Running means of prompt and answer lengths (answers are only known at
        # the end, so the policy uses the pool's mean as the expected length).
        self.mean_prompt = 1000.0
        self.mean_output = 200.0
        # A queue implies limits (fixed at the plan unless configured).
        self.limited = config.limits is not None or config.admission is not None
        self.queue = AdmissionQueue(config.admission) if config.admission is not None else None
        self.prefix: PrefixIndex | None = None  # made by the first request with a prefix
        # A policy that keeps its own record of where requests went (cache_aware).
        self.dispatch_hook: Callable[[str, RequestInfo], None] | None = getattr(
            policy, "on_dispatch", None)

    def index(self) -> PrefixIndex:
        """The pool's prefix index (made on first use, sized by each node's KV)."""
        if self.prefix is None:
            self.prefix = PrefixIndex(self.config.prefix_block_tokens)
            for n in self.nodes:
                self.prefix.set_kv(n.id, n.perf.kv_capacity_tokens)
        return self.prefix

    def eligible(self) -> list[Node]:
        if self._eligible is None:
            self._eligible = [n for n in self.nodes if n.state.routable]
        return self._eligible

    def invalidate(self) -> None:
        self._eligible = None


def decision_dict(got: Ticket | Waiter | Shed | None) -> dict[str, Any]:
    """An admission decision as a recording holds it."""
    if isinstance(got, Ticket):
        return {"ticket": got.id, "node": got.node_id}
    if isinstance(got, Waiter):
        return {"queued": got.wid}
    if isinstance(got, Shed):
        return {"shed": got.reason}
    return {"none": True}


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
        self.double_release = 0  # on_finish for an already released ticket
        self._ticket_seq = 0
        self._waiter_seq = 0
        # > 0 while admit/poll_queue decide: their inner picks are part of the
        # decision they record, not records of their own.
        self._quiet = 0
        # Non-streamed tickets by the time their prompt is presumed prefilled.
        self._presumed: list[tuple[float, int, Ticket]] = []
        self._queue_decisions: list[tuple[Waiter, Ticket | Shed]] = []
        # (node, sequences decoding, context / 64) -> the TPOT target's prefill chunk
        self._chunk_cache: ChunkCache = {}
        self._ledger = shared.PeerLedger()  # the other replicas' last counters
        # Called (no arguments) when queue decisions await poll_queue: lets an
        # event-loop driver wake its queued requests without polling.
        self.on_queue_decision: Callable[[], None] | None = None
        if recorder is not None:
            recorder(record_init(rng, perf_params, cfg))
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
        pool = Pool(config, policy)
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
            pool.invalidate()
            self._carry_admission(old, pool)
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
        if spec.layout is not None:
            return PipelinePerf(gpu, model, spec.tp, self.perf_params, layout=spec.layout)
        perf = PerfModel(gpu, model, spec.tp, self.perf_params)
        if not perf.fits:
            # The engine evidently runs it (quantised, offloaded...): keep the
            # shape of the prior and let measurements set its scale.
            perf = PerfModel(gpu, self.catalog.model("llama-3.2-3b"), spec.tp, self.perf_params)
        return perf

    def add_node(self, spec: NodeSpec) -> Node:
        if spec.id in self.nodes:
            raise ConfigError(f"nodes.{spec.id}", "duplicate node id")
        if self.recorder is not None:
            self.recorder({"op": "add_node", "spec": spec_to_dict(spec)})
        node = Node(spec, self._prior(spec))
        self.nodes[spec.id] = node
        for name in spec.models:
            pool = self.pools.get(name)
            if pool is None:
                pool = self.add_pool(PoolConfig(name))
            pool.nodes.append(node)
            pool.invalidate()
            if pool.prefix is not None:
                pool.prefix.set_kv(node.id, node.perf.kv_capacity_tokens)
        self._attach_limiter(node)
        return node

    def remove_node(self, node_id: str) -> None:
        if self.recorder is not None:
            self.recorder({"op": "remove_node", "node": node_id})
        node = self.nodes.pop(node_id)
        if self.outliers is not None:
            self.outliers.forget(node_id)
        for pool in self.pools.values():
            if node in pool.nodes:
                pool.nodes.remove(node)
                pool.invalidate()
            if pool.prefix is not None:
                pool.prefix.forget(node_id)

    def set_state(self, node_id: str, state: NodeState) -> None:
        node = self.nodes[node_id]
        if node.state is state:
            return
        if self.recorder is not None:
            self.recorder({"op": "set_state", "node": node_id, "state": state.value})
        node.state = state
        for pool in self.pools.values():
            if node in pool.nodes:
                pool.invalidate()
                if state is NodeState.DOWN and pool.prefix is not None:
                    pool.prefix.forget(node_id)  # a restarted engine's cache is empty

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
        self._settle_presumed(now)
        pool = self.pools.get(model)
        if pool is None:
            return None
        nodes: Sequence[Node] = pool.eligible()
        if exclude:
            nodes = [n for n in nodes if n.id not in exclude]
        if pool.limited:
            nodes = [n for n in nodes if n.limiter is None or n.limiter.has_room()]
        if not nodes:
            return None
        hits = pool.index().match(prefix) if prefix else {}
        req = RequestInfo(model, prompt_tokens, max_tokens, pool.mean_output, pool.mean_prompt,
                          priority, self._cached(pool, hits), prefix,
                          pool.config.prefix_block_tokens, session)
        node_id = None
        if self.outliers is not None and self.outliers.on_probation:
            node_id = self.outliers.canary(nodes, self.rng)  # a canary request
        if node_id is None:
            node_id = pool.policy.choose(nodes, req, now, self.rng)
        if node_id is not None:
            self._ticket_seq += 1
        if self.recorder is not None and not self._quiet:
            rec = {"t": now, "op": "pick", "model": model, "prompt_tokens": prompt_tokens,
                   "max_tokens": max_tokens, "priority": priority, "exclude": list(exclude),
                   "node": node_id, "ticket": self._ticket_seq if node_id is not None else None}
            if prefix:
                rec["prefix"] = list(prefix)
            if session is not None:
                rec["session"] = session
            self.recorder(rec)
        if node_id is None:
            return None
        if pool.dispatch_hook is not None:
            pool.dispatch_hook(node_id, req)
        return self._issue(self.nodes[node_id], pool, prompt_tokens, now, prefix,
                           hits.get(node_id, 0))

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
            rec = {"t": now, "op": "rank", "model": model, "prompt_tokens": prompt_tokens,
                   "max_tokens": max_tokens, "priority": priority, "exclude": list(exclude),
                   "n": n, "nodes": out}
            if prefix:
                rec["prefix"] = list(prefix)
            if session is not None:
                rec["session"] = session
            self.recorder(rec)
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
               prefix: Sequence[int] = (), hit_blocks: int = 0) -> Ticket:
        ticket = Ticket(node, pool, prompt_tokens, now, self._ticket_seq, prefix, hit_blocks)
        if prefix:
            pool.index().insert(node.id, prefix)
        node.in_flight += 1
        node.prefilling += 1
        node.prefill_backlog += ticket.backlog
        node.prefill_tokens_total += prompt_tokens
        if ticket.backlog > 0:
            running = running_batch(node.perf, node.slots, node.fleet_in_flight,
                                    pool.mean_prompt + pool.mean_output)
            ticket.work = prefill_extra_s(node.perf, ticket.backlog, running,
                                          pool.mean_prompt + pool.mean_output * 0.5)
            node.add_dispatched_work(ticket.work)
        expected = ticket.expected_ttft() * node.class_prefill_slowdown
        ticket.due = now + expected * OVERDUE_FACTOR
        if ticket.work > 0.0:
            ticket.accrual = node.start_work(ticket.work, expected, now)
        node.awaits(ticket)
        node.dispatched_total += 1
        if node.limiter is not None:
            node.limiter.acquire()
            ticket.permit = node.limiter
        pool.mean_prompt += (prompt_tokens - pool.mean_prompt) * 0.01
        return ticket

    def on_first_token(self, ticket: Ticket, now: float, *, defer_prefill: bool = False) -> None:
        """The request's first token arrived.

        ``defer_prefill``: the driver learns at the finish how much of the prompt
        the engine served from its prefix cache (``on_finish(cached_tokens=)``), so
        the prefill sample waits for it: a cached prompt's TTFT must neither teach
        a fast prefill nor make an uncached one look slow. The simulator, whose
        engine model has no prefix cache, learns at once.
        """
        if ticket.t_first >= 0.0 or ticket.released:
            return
        if self.recorder is not None:
            rec: dict[str, Any] = {"t": now, "op": "first_token", "ticket": ticket.id}
            if defer_prefill:
                rec["defer"] = True
            self.recorder(rec)
        node = ticket.node
        ticket.t_first = ticket.seg_t = now
        node.progressed(now)
        ticket.batch_at_first = ticket.seg_batch = node.fleet_in_flight
        if not ticket.presumed:
            node.prefilling -= 1
            node.prefill_backlog -= ticket.backlog
            node.decoding += 1
            node.end_work(ticket.work, ticket.accrual, now)  # computed: counted where it ran
        ticket.seg_work = ticket.work_at_first = node.work_at(now)
        node.ttft.update(now - ticket.t_dispatch, now)
        pool = ticket.pool
        if defer_prefill:
            ticket.pending_prefill = True
            if self.outliers is not None:
                self.outliers.on_progress(node, now)
        else:
            self._learn_prefill(ticket, 0)
        queue = pool.queue
        if queue is not None and queue.length:  # a shorter backlog may admit a waiter
            self._drain(pool, now, self._queue_decisions, scan=False)
            if self._queue_decisions and self.on_queue_decision is not None:
                self.on_queue_decision()

    def _learn_prefill(self, ticket: Ticket, cached_tokens: int | None) -> None:
        """Learn the node's prefill speed from the ticket's TTFT.

        ``cached_tokens`` None: the engine did not say. A sample then more than
        ``1 / CACHE_HIT_RATIO`` times faster than the node's learned speed is
        taken for a prefix-cache hit and teaches nothing (caching can only make
        a prefill faster, so the slow side of the evidence stays trustworthy).
        """
        ticket.pending_prefill = False
        node = ticket.node
        ttft = ticket.t_first - ticket.t_dispatch
        # The same prediction the router made, without the node's learned
        # corrections, for the conditions the request met at dispatch.
        expected = ticket.expected_ttft(cached_tokens or 0)
        if (cached_tokens is None and expected > 0.0
                and ttft < CACHE_HIT_RATIO * expected * node.capacity.prefill_slowdown):
            node.presumed_cache_hits += 1
            return
        node.capacity.prefill.update(ttft, expected)
        if self.outliers is not None:
            batch = ticket.batch_at_dispatch
            tokens = int(ticket.ahead_tokens) + ticket.uncached(cached_tokens or 0)
            self.outliers.on_prefill(node, ttft, expected, ticket.t_first, tokens, batch,
                                     queued=ticket.running() < batch)

    def on_finish(self, ticket: Ticket, now: float, outcome: Outcome, output_tokens: int,
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
        ticket.released = True
        node = ticket.node
        if ticket.pending_prefill:
            self._learn_prefill(ticket, cached_tokens)
        node.in_flight -= 1
        if ticket.t_first < 0.0 and not ticket.presumed:
            node.prefilling -= 1
            node.prefill_backlog -= ticket.backlog
            if outcome is Outcome.OK:  # a short non-streamed answer: computed all the same
                node.end_work(ticket.work, ticket.accrual, now)
            else:  # its prompt will not be computed: no longer work the node has to do
                node.withdraw_work(ticket.work)
                node.end_work(ticket.work, ticket.accrual, now, computed=False)
                node.left_unanswered(ticket.due if outcome is Outcome.CLIENT_CANCELLED
                                     else math.inf, now)
        else:
            node.decoding -= 1
        if self.outliers is not None and (judged or not outcome.is_node_failure):
            self.outliers.on_outcome(node, outcome, now)
        if ticket.permit is not None:
            self._release_permit(ticket, now, outcome, output_tokens if timed else 0)
        if outcome is not Outcome.OK:
            return
        node.progressed(now)
        pool = ticket.pool
        if ticket.blocks and cached_tokens is not None and pool.prefix is not None:
            pool.prefix.observe(node.id, ticket.blocks, ticket.hit_blocks, cached_tokens)
        pool.mean_output += (output_tokens - pool.mean_output) * 0.01
        if not timed:
            return
        node.latency.update(now - ticket.t_dispatch, now)
        if ticket.t_first >= 0.0 and output_tokens >= 2:
            tpot = (now - ticket.t_first) / (output_tokens - 1)
            node.tpot.update(tpot, now)  # what clients got (observers read it)
            if output_tokens < MIN_DECODE_TOKENS:
                return
            batch, expected_step = self._decode_expected(ticket, ticket.batch_at_first,
                                                         ticket.t_first, ticket.work_at_first, now)
            node.capacity.decode.update(tpot, expected_step)
            if self.outliers is None:
                return
            if ticket.seg_tokens == 1:  # no piece judged while it ran: the whole answer
                self.outliers.on_decode(node, tpot, expected_step, batch, now, ticket.t_first)
                return
            # The pieces judged as the stream ran; the rest, if long enough, now.
            rest = output_tokens - ticket.seg_tokens
            if rest >= MIN_DECODE_TOKENS:
                batch, expected_step = self._decode_expected(ticket, ticket.seg_batch,
                                                             ticket.seg_t, ticket.seg_work, now)
                self.outliers.on_decode(node, (now - ticket.seg_t) / rest, expected_step,
                                        batch, now, ticket.seg_t)

    def _decode_expected(self, ticket: Ticket, batch_then: int, since: float,
                         work_then: float, now: float) -> tuple[int, float]:
        """The running batch since ``batch_then`` (the mean of then and now) and the
        roofline's time per token for it, stretched by the prompt work the node
        computed since ``since`` (when its total was ``work_then``), at the class's
        learned prefill speed (:func:`interleaved_tpot`)."""
        node, pool = ticket.node, ticket.pool
        # The streams of one node told at one tick share all of it (the simulator
        # tells each one each second): computed once for them.
        key = (pool.name, batch_then, since, work_then, now, node.fleet_in_flight,
               pool.mean_prompt, pool.mean_output, node.class_prefill_slowdown,
               node.remote_ratio)
        memo = node.decode_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        batch = running_batch(node.perf, node.slots,
                              max(1, (batch_then + node.fleet_in_flight + 1) // 2),
                              pool.mean_prompt + pool.mean_output)
        ctx = pool.mean_prompt + pool.mean_output * 0.5
        step = decode_step_s(node.perf, batch, ctx)
        span = now - since
        work = node.work_at(now) - work_then
        if span > 0.0 and work > 0.0:
            duty = work * (1.0 + node.remote_ratio) * node.class_prefill_slowdown / span
            step = interleaved_tpot(step, duty, saturated_step_s(node.perf, batch, ctx))
        node.decode_memo = (key, (batch, step))
        return batch, step

    def on_stream_progress(self, ticket: Ticket, tokens: int, now: float) -> float:
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
        if self.recorder is not None:
            self.recorder({"t": now, "op": "progress", "ticket": ticket.id, "tokens": tokens})
        batch, expected = self._decode_expected(ticket, ticket.seg_batch, start,
                                                ticket.seg_work, now)
        det.on_decode(ticket.node, (now - start) / n, expected, batch, now, start)
        ticket.seg_t = now
        ticket.seg_tokens = tokens
        ticket.seg_batch = ticket.node.fleet_in_flight
        ticket.seg_work = ticket.node.work_at(now)
        return now + seg_s

    def blame(self, node_id: str, outcome: Outcome, now: float) -> None:
        """Charge ``node_id`` with a failure released unjudged, now that it is the node's.

        The driver learnt it from a second node: the same request succeeded
        there, so the first node's 5xx was the node's own.
        """
        node = self.nodes.get(node_id)
        if node is None:
            return
        if self.recorder is not None:
            self.recorder({"t": now, "op": "blame", "node": node_id, "outcome": outcome.value})
        if self.outliers is not None:
            self.outliers.on_outcome(node, outcome, now)

    def expect_no_first_token(self, ticket: Ticket, now: float) -> None:
        """The driver will not see ``ticket``'s first token (a non-streamed answer).

        Its prompt is then counted as prefilled once the node's predicted time
        to first token has passed (:meth:`Ticket.expected_ttft` times the
        node's learned prefill slowdown), instead of when the whole answer is done: the node's prompt
        backlog predicts the next requests' TTFT and admission, and a
        non-streamed answer would otherwise hold its prompt there for the
        whole generation. Nothing is learned from the presumed time.
        """
        if ticket.released or ticket.t_first >= 0.0 or ticket.presumed:
            return
        if self.recorder is not None:
            self.recorder({"t": now, "op": "no_first_token", "ticket": ticket.id})
        # The learner's ratio is observed over expected TTFT: its inverse use.
        ttft = ticket.expected_ttft() * ticket.node.capacity.prefill_slowdown
        heapq.heappush(self._presumed, (ticket.t_dispatch + ttft, ticket.id, ticket))
        self._settle_presumed(now)

    def _settle_presumed(self, now: float) -> None:
        """Count the prompts of non-streamed tickets whose presumed first token is due."""
        heap = self._presumed
        if not heap or heap[0][0] > now:  # the common case: nothing due
            return
        moved: set[str] = set()
        while heap and heap[0][0] <= now:
            ticket = heapq.heappop(heap)[2]
            if ticket.released or ticket.t_first >= 0.0:
                continue
            ticket.presumed = True
            node = ticket.node
            node.left_unanswered(math.inf, now)  # no longer awaited
            node.prefilling -= 1
            node.prefill_backlog -= ticket.backlog
            node.decoding += 1
            node.end_work(ticket.work, ticket.accrual, now)  # computed: counted where it ran
            moved.add(ticket.pool.name)
        for name in sorted(moved):  # a shorter backlog may admit a waiter
            pool = self.pools.get(name)
            if pool is not None and pool.queue is not None and pool.queue.length:
                self._drain(pool, now, self._queue_decisions, scan=False)
        if moved and self._queue_decisions and self.on_queue_decision is not None:
            self.on_queue_decision()

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
        """Admit a request: a Ticket (dispatched now), a Waiter (queued), a Shed
        (answer 429 now) or None (no routable node: as :meth:`pick`).

        Without limits on the pool this is exactly :meth:`pick`. A queued
        request's decision comes later from :meth:`poll_queue`, which the
        driver calls after every ``on_finish`` and periodically; ``payload``
        is the driver's own handle for it. ``ttft_s`` overrides the pool's
        TTFT SLO for the deadline (header ``x-slo-ttft-ms``).
        """
        self._quiet += 1  # the picks inside are part of this decision's record
        try:
            got = self._admit(model, prompt_tokens, now, max_tokens, priority, exclude, ttft_s,
                              size_bytes, payload, prefix, session)
        finally:
            self._quiet -= 1
        if self.recorder is not None:
            rec = {"t": now, "op": "admit", "model": model, "prompt_tokens": prompt_tokens,
                   "max_tokens": max_tokens, "priority": priority, "exclude": list(exclude),
                   "ttft_s": ttft_s, "size_bytes": size_bytes, "result": decision_dict(got)}
            if prefix:
                rec["prefix"] = list(prefix)
            if session is not None:
                rec["session"] = session
            self.recorder(rec)
        return got

    def _admit(self, model: str, prompt_tokens: int, now: float, max_tokens: int | None,
               priority: int, exclude: Sequence[str], ttft_s: float | None, size_bytes: int,
               payload: Any, prefix: Sequence[int],
               session: str | None) -> Ticket | Waiter | Shed | None:
        self._settle_presumed(now)
        pool = self.pools.get(model)
        if pool is None or not pool.limited:
            return self.pick(model, prompt_tokens, now, max_tokens, priority, exclude, prefix,
                             session)
        queue = pool.queue
        if queue is not None:
            queue.on_arrival(min(max(priority, 0), 2), now)
        deadline = now + (ttft_s if ttft_s is not None else pool.config.slo.ttft_s)
        # Try at once unless a request of the same or higher priority waits:
        # lower priorities queued behind their share leave the reserve free.
        if queue is None or sum(queue.by_priority[: min(max(priority, 0), 2) + 1]) == 0:
            avoid = exclude if queue is None else unsuitable(
                pool, prompt_tokens, priority, deadline - now, exclude, now, self._chunk_cache)
            ticket = self.pick(model, prompt_tokens, now, max_tokens, priority, avoid, prefix,
                               session)
            if ticket is not None:
                return ticket
        if not any(n.id not in exclude for n in pool.eligible()):
            return None
        if queue is None:
            return Shed("no_capacity", 1.0)
        self._waiter_seq += 1
        waiter = Waiter(model, prompt_tokens, max_tokens, priority, now, deadline, size_bytes,
                        exclude, payload, self._waiter_seq, prefix, session)
        shed, displaced = queue.offer(waiter, now)
        for w in displaced:
            self._queue_decisions.append((w, Shed("displaced", queue.retry_after(now))))
        if displaced and self.on_queue_decision is not None:
            self.on_queue_decision()
        return shed if shed is not None else waiter

    def poll_queue(self, now: float) -> list[tuple[Waiter, Ticket | Shed]]:
        """Late binding: dispatch queued requests onto freed permits, shed expired ones.

        Returns every decision taken since the last call (also displacements
        made by :meth:`admit`), in order. Never raises for an empty queue.
        """
        self._settle_presumed(now)
        out = self._queue_decisions
        self._queue_decisions = []
        for pool in self.pools.values():
            if pool.queue is not None and pool.queue.length:
                self._drain(pool, now, out, scan=True)
        if self.recorder is not None:
            self.recorder({"t": now, "op": "poll_queue", "decisions": [
                {"waiter": w.wid, **decision_dict(d)} for w, d in out]})
        return out

    def cancel_queued(self, waiter: Waiter) -> bool:
        """The client left while queued: drop it now. False if no longer queued."""
        if self.recorder is not None:
            self.recorder({"op": "cancel_queued", "waiter": waiter.wid})
        pool = self.pools.get(waiter.model)
        return pool is not None and pool.queue is not None and pool.queue.cancel(waiter)

    def _drain(self, pool: Pool, now: float, out: list[tuple[Waiter, Ticket | Shed]],
               scan: bool) -> None:
        queue = pool.queue
        assert queue is not None
        if scan:
            for late in queue.expire(now):
                out.append((late, Shed("expired", queue.retry_after(now))))
        while (w := queue.peek()) is not None:
            if queue.config.expire and queue.latest_start(w) <= now:
                queue.pop()
                w.state = "shed"
                queue.shed_total["expired"] = queue.shed_total.get("expired", 0) + 1
                out.append((w, Shed("expired", queue.retry_after(now))))
                continue
            avoid = unsuitable(pool, w.prompt_tokens, w.priority, w.deadline - now, w.exclude,
                               now, self._chunk_cache)
            self._quiet += 1  # recorded with the decision, by poll_queue
            try:
                ticket = self.pick(w.model, w.prompt_tokens, now, w.max_tokens, w.priority, avoid,
                                   w.prefix, w.session)
            finally:
                self._quiet -= 1
            if ticket is None:
                return
            queue.pop()
            w.state = "dispatched"
            out.append((w, ticket))

    def _release_permit(self, ticket: Ticket, now: float, outcome: Outcome,
                        output_tokens: int) -> None:
        permit = ticket.permit
        assert permit is not None
        node = ticket.node
        if outcome is Outcome.OK:
            tpot = 0.0
            if ticket.t_first >= 0.0 and output_tokens >= 2:
                tpot = (now - ticket.t_first) / (output_tokens - 1)
            ttft = ticket.t_first - ticket.t_dispatch if ticket.t_first >= 0.0 else 0.0
            # The engine's own queue with a nearly full KV cache: the batch is
            # past what its memory holds, whatever the latencies say yet.
            congested = (node.engine_waiting > 0 and node.engine_kv_usage >= permit.kv_full
                         and now - node.engine_metrics_at < 2.0)
            permit.release(now, "success", tpot, ttft, congested)
            if ticket.pool.queue is not None:
                ticket.pool.queue.on_release(now, ttft)
        elif outcome in (Outcome.TIMEOUT, Outcome.UPSTREAM_429):
            permit.release(now, "dropped")
        else:
            permit.release(now, "ignored")
        queue = ticket.pool.queue
        if queue is not None:
            if outcome is not Outcome.OK:
                queue.on_release(now)
            if queue.length:
                self._drain(ticket.pool, now, self._queue_decisions, scan=False)
                if self._queue_decisions and self.on_queue_decision is not None:
                    self.on_queue_decision()

    def _attach_limiter(self, node: Node) -> None:
        for name in node.spec.models:
            pool = self.pools.get(name)
            if pool is None or not pool.limited:
                continue
            cfg = pool.config.limits or LimitConfig(kind="fixed")
            slo = pool.config.slo
            prompt = cfg.input_tokens if cfg.input_tokens is not None else pool.mean_prompt
            output = cfg.output_tokens if cfg.output_tokens is not None else pool.mean_output
            cap = min(node.slots, max(1, int(node.perf.kv_capacity_tokens / (prompt + output))))
            initial = planned_limit(node.perf, cfg.target * slo.tpot_s, prompt, output, cap)
            floor = decode_step_s(node.perf, 1, prompt + output * 0.5)
            # A cold node slow-starts (core/limits.py) from the typical prompts
            # it can prefill within the TTFT target, or half the plan when that
            # is more (one doubling, one request lifetime, to reach the plan);
            # a reloaded one is warm already.
            cold = None
            if node.limiter is None:
                wave = int(cfg.target * slo.ttft_s / prefill_s(node.perf, 0, prompt))
                cold = max(1, wave, initial // 2)
            limiter = Limiter(make_limit(cfg, initial, cap, slo.tpot_s, slo.ttft_s, floor, cold),
                              cfg.kv_full)
            if node.limiter is not None:  # a reload: permits in flight stay counted
                limiter.inflight = node.limiter.inflight
            node.limiter = limiter
            return
        node.limiter = None

    def _carry_admission(self, old: Pool, pool: Pool) -> None:
        """A reloaded pool keeps its queued requests (or sheds them without a queue)."""
        for node in pool.nodes:
            if pool.limited or node.limiter is not None:
                self._attach_limiter(node)
        if old.queue is None:
            return
        for waiter in old.queue.queued():
            old.queue.cancel(waiter)
            shed = Shed("no_capacity", 1.0)
            if pool.queue is not None:
                found, displaced = pool.queue.offer(waiter, waiter.arrival)
                for d in displaced:
                    self._queue_decisions.append((d, Shed("displaced", 1.0)))
                if found is None:
                    continue
                shed = found
            waiter.state = "shed"
            self._queue_decisions.append((waiter, shed))

    def on_engine_metrics(
        self, node_id: str, now: float, running: int, waiting: int, kv_usage: float
    ) -> None:
        if self.recorder is not None:
            self.recorder({"t": now, "op": "engine_metrics", "node": node_id, "running": running,
                           "waiting": waiting, "kv_usage": kv_usage})
        node = self.nodes.get(node_id)
        if node is None:
            return
        node.engine_running = running
        node.engine_waiting = waiting
        node.engine_kv_usage = kv_usage
        node.engine_metrics_at = now

    def on_peers(self, now: float, reports: Mapping[str, Mapping[str, Any]],
                 leader: bool) -> list[Event]:
        """The other gateway replicas' latest reports (``core/shared.py``); ``leader``: this
        replica decides node states. Returns the state changes taken from the leader."""
        if self.recorder is not None:
            self.recorder({"t": now, "op": "peers", "reports": reports, "leader": leader})
        events = shared.merge(self, now, reports, leader, self._ledger)
        if events and self.recorder is not None:
            self.recorder({"t": now, "op": "events", "events": [event_to_dict(e) for e in events]})
        return events

    def report(self, now: float, leader: bool) -> dict[str, Any]:
        """What this replica tells the others (``core/shared.py``); changes nothing."""
        return shared.report(self, now, leader)

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
        self._settle_presumed(now)
        for node in self.nodes.values():
            node.decay_duty(now)
        self._refresh_class_slowdowns()
        if self.outliers is None:
            return []
        return self.outliers.tick(now, self.nodes, self.pools.values(), self.rng)

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
            node.class_decode_slowdown = math.exp(d / n)
            node.class_prefill_slowdown = math.exp(p / n)
            # Against the others of its class (in a class of two, the mean with
            # itself would halve a slow card's excess in log terms).
            own = node.capacity.decode
            node.decode_excess = 1.0
            if own.samples >= OWN_SAMPLES:
                mine = own.log_ratio
                if node.remote_speed is not None:
                    mine = merged_speed(node.capacity, node.remote_speed)[0]
                others, k = d, n
                if hn and node.state is NodeState.HEALTHY:
                    others, k = d - mine, n - 1.0
                if k > 0.0:
                    excess = math.exp(mine - others / k)
                    if excess > OWN_MARGIN:
                        node.decode_excess = excess
