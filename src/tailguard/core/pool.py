"""A pool (the nodes serving one model name, with its policy and SLO) and a
dispatched request's :class:`Ticket`: the balancer's request-side data."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailguard.core.admission import AdmissionConfig, AdmissionQueue, Shed, Waiter
from tailguard.core.fleet import Node
from tailguard.core.hedging import HedgeConfig, Hedger
from tailguard.core.kv_transfer import DEFAULT_LINK, Link, LinkMap, PairLink
from tailguard.core.limits import LimitConfig, Permit
from tailguard.core.migration import STALL_SLOWDOWN_CAP, MigrationConfig
from tailguard.core.policies import DEFAULT_POLICY, Policy, RequestInfo, Slo
from tailguard.core.policies.base import PairPolicy
from tailguard.core.predict import (
    PREFILL_CHUNK_TOKENS,
    decode_step_s,
    prefill_s,
    running_batch,
    saturated_step_s,
)
from tailguard.core.prefix import PrefixIndex
from tailguard.core.retry_budget import RetryBudget, RetryConfig

# Tokens per hashed prompt block when the driver hashes prompts (the gateway);
# a simulated workload brings its own (Mooncake's traces: 512).
PREFIX_BLOCK_TOKENS = 128
NO_AREAS = (0.0, 0.0)
# A ticket's leg (Ticket.leg): the whole request on one node, or one of its two.
WHOLE, PREFILL, DECODE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: the nodes serving a model name, with its policy and SLO."""

    name: str
    policy: str = DEFAULT_POLICY
    policy_options: Any = None  # the policy's options dataclass (None: its defaults)
    slo: Slo = field(default_factory=Slo)
    catalog_model: str | None = None  # the catalog entry for the roofline prior
    limits: LimitConfig | None = None  # per-node concurrency limits (core/limits.py)
    admission: AdmissionConfig | None = None  # the pool's queue (core/admission.py)
    prefix_block_tokens: int = PREFIX_BLOCK_TOKENS  # what one hash of a request's prefix covers
    retries: RetryConfig = field(default_factory=RetryConfig)  # failover before the first byte
    hedging: HedgeConfig = field(default_factory=HedgeConfig)  # off unless enabled
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # streams that move
    # Disaggregated serving: the KV path between two of its nodes unless a pair
    # (kv_pairs) or a node (NodeSpec.kv_link) has its own.
    kv_link: Link = DEFAULT_LINK
    kv_pairs: tuple[PairLink, ...] = ()


class Ticket:
    """A dispatched request's permit on a node, and what is measured about it."""

    __slots__ = (
        "accrual",
        "ahead_tokens",
        "allowance",
        "areas_at_first",
        "backlog",
        "batch_at_dispatch",
        "batch_at_first",
        "blocks",
        "due",
        "hit_blocks",
        "id",
        "kv_from",
        "kv_s",
        "leg",
        "node",
        "pending_prefill",
        "permit",
        "pool",
        "prefill",
        "presumed",
        "prompt_tokens",
        "released",
        "seg_areas",
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
                 ticket_id: int = 0, blocks: Sequence[int] = (), hit_blocks: int = 0,
                 leg: int = 0) -> None:
        self.id = ticket_id  # the balancer's sequence number: names it in recordings
        self.node = node
        self.pool = pool
        self.prompt_tokens = prompt_tokens
        self.blocks = blocks  # the prompt's hashed blocks
        self.hit_blocks = hit_blocks  # how many the router expected the node to hold
        # WHOLE, or one leg of a disaggregated request: its PREFILL on one node, its
        # DECODE on another, with ``prefill`` the other leg's ticket until it is done.
        self.leg = leg
        self.prefill: Ticket | None = None
        self.kv_s = 0.0  # a decode leg's expected KV transfer (set at its hand-off)...
        self.kv_from = ""  # ...from this node
        # The prompt work it adds to the node's backlog: what the node is expected to compute.
        hit = min(hit_blocks * pool.config.prefix_block_tokens, max(0, prompt_tokens - 1))
        self.backlog = 0 if leg == DECODE else prompt_tokens - hit
        self.t_dispatch = now
        self.t_first = -1.0
        self.due = math.inf  # its first token is overdue after (set at dispatch: Node.overdue_s)
        self.allowance = 0.0  # ...and how long after its wait began (Awaited)
        self.ahead_tokens = node.fleet_backlog
        self.batch_at_dispatch = node.fleet_in_flight + 1
        self.batch_at_first = 0
        self.pending_prefill = False  # its prefill sample waits for the cached-token count
        self.presumed = False  # prompt counted as prefilled without a first token
        self.released = False
        self.permit: Permit | None = None  # on the node's limiter, when its pool has limits
        # The decode piece under way (on_stream_progress), from the first token on:
        # since when, from which token, the node's load then.
        self.seg_t = -1.0
        self.seg_tokens = 1
        self.seg_batch = 0
        self.seg_work = 0.0  # the node's prompt work computed by seg_t (Node.work_at)
        self.work_at_first = 0.0  # ... and by the first token
        self.seg_areas = self.areas_at_first = NO_AREAS  # the node's Load.areas_at, likewise
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
        if self.leg == DECODE:  # the prompt's KV arrives, then one step computes its last token
            return self.kv_s + step
        return prefill_s(perf, self.ahead_tokens, self.uncached(cached_tokens)) + step

    def running(self) -> int:
        """Sequences the engine ran at once when this request joined (at most its slots)."""
        node, pool = self.node, self.pool
        return running_batch(node.perf, node.slots, self.batch_at_dispatch,
                             pool.mean_prompt + pool.mean_output)

    def longest_step_s(self) -> float:
        """The longest step its node's engine takes when healthy: a decode step of the
        batch it joined carrying a prompt chunk (a full one, or twice the pool's mean
        prompt where that is less), with its class's learned slowdown up to
        :data:`~tailguard.core.migration.STALL_SLOWDOWN_CAP`. Every stream in such a
        step waits that long, and that is no stall."""
        node, pool = self.node, self.pool
        chunk = min(PREFILL_CHUNK_TOKENS, int(2.0 * pool.mean_prompt) + 1)
        step = saturated_step_s(node.perf, self.running(),
                                pool.mean_prompt + pool.mean_output * 0.5, chunk)
        return step * min(node.class_decode_slowdown, STALL_SLOWDOWN_CAP)

    def uncached(self, cached_tokens: int) -> int:
        """The prompt tokens the engine had to compute itself."""
        return max(0, self.prompt_tokens - cached_tokens)


class Pool:
    """Live state of one pool: its nodes, policy and request statistics."""

    __slots__ = ("_eligible", "budget", "config", "disaggregated", "dispatch_hook", "hedger",
                 "limited", "link_slowness", "links", "mean_output", "mean_prompt", "moved", "moves",
                 "name", "nodes", "pairs", "policy", "prefix", "queue")

    def __init__(self, config: PoolConfig, policy: Policy, pairs: PairPolicy | None = None,
                 link_slowness: dict[tuple[str, str], float] | None = None) -> None:
        self.config = config
        self.name = config.name
        self.policy = policy
        self.pairs = pairs  # how it routes when some nodes only prefill or only decode
        self.nodes: list[Node] = []
        self._eligible: list[Node] | None = None
        self.disaggregated = False
        # Pairs found slow (core/outliers/links.py): one dict, the balancer's, for every pool.
        self.link_slowness = link_slowness if link_slowness is not None else {}
        self.links = LinkMap.of(config.kv_link, {}, config.kv_pairs, self.link_slowness)
        # Running means of prompt and answer lengths (answers are only known at
        # the end, so the policy uses the pool's mean as the expected length).
        self.mean_prompt = 1000.0
        self.mean_output = 200.0
        # A queue implies limits (fixed at the plan unless configured).
        self.limited = config.limits is not None or config.admission is not None
        self.queue = AdmissionQueue(config.admission) if config.admission is not None else None
        self.prefix: PrefixIndex | None = None  # made by the first request with a prefix
        # The pool's retry budget and hedger, which every request of it draws on.
        self.budget: RetryBudget = config.retries.new_budget()
        self.hedger: Hedger | None = Hedger(config.hedging) if config.hedging.enabled else None
        self.moves: RetryBudget = config.migration.new_budget()  # its streams' continuations
        self.moved: dict[str, int] = {}  # ended streams that moved, by "cause/result"
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
        self.disaggregated = any(n.spec.role != "both" for n in self.nodes)
        if self.disaggregated:
            self.links = LinkMap.of(self.config.kv_link,
                                    {n.id: n.spec.kv_link for n in self.nodes},
                                    self.config.kv_pairs, self.link_slowness)


def decision_dict(got: Ticket | Waiter | Shed | None) -> dict[str, Any]:
    """An admission decision as a recording holds it."""
    if isinstance(got, Ticket):
        return {"ticket": got.id, "node": got.node_id, **pair_dict(got)}
    if isinstance(got, Waiter):
        return {"queued": got.wid}
    if isinstance(got, Shed):
        return {"shed": got.reason}
    return {"none": True}


def pair_dict(got: Ticket | None) -> dict[str, Any]:
    """A disaggregated request's prefill leg as a recording holds it (none: empty)."""
    if got is None or got.prefill is None:
        return {}
    return {"prefill": {"ticket": got.prefill.id, "node": got.prefill.node_id}}
