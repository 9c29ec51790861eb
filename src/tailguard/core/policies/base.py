"""What every routing policy sees and returns.

A policy is a small object with one method, :meth:`Policy.choose`: given the
eligible nodes (read-only views), the request, ``now`` and an injected
``random.Random``, it returns the id of the node to use, or ``None`` when it
declines all of them. It never builds driver objects and never mutates a node;
the balancer does the bookkeeping (dispatch and completion counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from random import Random
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from tailguard.core.fleet import NodeView
from tailguard.core.kv_transfer import LinkMap


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives of a pool: time to first token and time per output token."""

    ttft_s: float = 2.0
    tpot_s: float = 0.10
    attainment: float = 0.99


class RequestInfo(NamedTuple):
    """What the core knows about a request when it routes it (a named tuple: one is
    made for every routing decision, and it is the cheapest immutable record).

    ``expected_output`` and ``mean_prompt`` come from the pool's running
    statistics (the gateway does not know how long an answer will be);
    ``max_tokens`` is the client's cap when it gave one. ``cached`` maps the
    nodes that probably hold a prefix of the prompt in their cache to the prompt
    tokens they would not prefill; ``prefix`` is the prompt's block hashes;
    ``session`` the client's session key (``x-session-id``, or OpenAI's ``user``).
    """

    model: str
    prompt_tokens: int
    max_tokens: int | None = None
    expected_output: float = 200.0
    mean_prompt: float = 1000.0
    priority: int = 1  # 0 high, 1 normal, 2 low
    cached: Mapping[str, int] = MappingProxyType({})
    prefix: Sequence[int] = ()
    block_tokens: int = 0  # tokens per hash of ``prefix``
    session: str | None = None  # the client's session key, for session affinity


class Policy(Protocol):
    name: str

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None: ...


class DispatchAware(Protocol):
    """A policy that keeps state about where requests went (``cache_aware``'s trees)."""

    def on_dispatch(self, node_id: str, req: RequestInfo) -> None: ...


class PolicyFactory(Protocol):
    def __call__(self, slo: Slo, options: Any) -> Policy: ...


class PairPolicy(Protocol):
    """Routing where some nodes only prefill or only decode (disaggregated serving):
    the decode node, and the node that computes the prompt for it (None: the
    decode node itself), or None when it declines every decode node.

    ``prefill`` are the routable nodes that may compute prompts for others,
    ``decode`` those that may stream answers; ``links`` is the KV path of
    every pair (:class:`~tailguard.core.kv_transfer.LinkMap`)."""

    def choose_pair(
        self, prefill: Sequence[NodeView], decode: Sequence[NodeView], req: RequestInfo,
        now: float, rng: Random, links: LinkMap,
    ) -> tuple[str | None, str] | None: ...
