"""Routing a disaggregated pool phase by phase, as the peer routers do.

vllm-router's P/D mode (``--vllm-pd-disaggregation``, per-phase
``--prefill-policy`` and ``--decode-policy``), SGLang's gateway and llm-d
choose the prefill node and the decode node each from its own pool, each by a
load or prefix policy, and compute every prompt on the prefill side. None of
them looks at the hardware of the pair or at the link between them.
:class:`PerPhase` is that composition over any of tailguard's policies; it is
how a single-node policy (``round_robin``, ``cache_aware``, ``least_request``,
...) routes a pool whose nodes have roles.

Dynamo's rule (``dynamo``, :class:`DynamoConditional`) adds a bypass: the
prompt is computed on the decode node when its uncached part is short, or
mostly cached. Its defaults (facts.md): remote only when the uncached prompt
is at least 2,048 tokens and at least 0.7 of the prompt (the open-source
``DisaggregatedRouter``'s ``max_local_prefill_length`` and cache-hit-ratio
check, ai-dynamo/dynamo ``examples/python_rs/llm/vllm_nixl/router``). Its
decode and prefill choices are by load (its KV router without shared
prefixes reduces to the least-loaded worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.kv_transfer import LinkMap
from tailguard.core.policies.base import Policy, RequestInfo, Slo
from tailguard.core.policies.least_request import LeastRequest


def prefill_side(prefill: Sequence[NodeView], decode_id: str) -> list[NodeView]:
    """Where a per-phase router sends a prompt: the prefill-only nodes, or where
    there are none the others that prefill (never the decode node itself)."""
    only = [n for n in prefill if n.spec.role == "prefill"]
    return only or [n for n in prefill if n.id != decode_id]


class PerPhase:
    """One policy per phase; every prompt is computed on the prefill side where it has a node."""

    name = "per_phase"

    def __init__(self, prefill: Policy, decode: Policy) -> None:
        self.prefill = prefill
        self.decode = decode

    def remote(self, req: RequestInfo, decode_id: str) -> bool:
        """Whether this request's prompt goes to the prefill side."""
        return True

    def on_dispatch_pair(self, prefill_id: str | None, decode_id: str,
                         req: RequestInfo) -> None:
        """Each phase's policy that keeps a record of where requests went
        (``cache_aware``'s trees) learns where its phase of this one went."""
        for policy, node_id in ((self.decode, decode_id), (self.prefill, prefill_id)):
            hook = getattr(policy, "on_dispatch", None)
            if hook is not None and node_id is not None:
                hook(node_id, req)

    def choose_pair(self, prefill: Sequence[NodeView], decode: Sequence[NodeView],
                    req: RequestInfo, now: float, rng: Random,
                    links: LinkMap) -> tuple[str | None, str] | None:
        d = self.decode.choose(decode, req, now, rng)
        if d is None:
            return None
        if not self.remote(req, d):
            return None, d
        side = prefill_side(prefill, d)
        p = self.prefill.choose(side, req, now, rng) if side else None
        return p, d


@dataclass(frozen=True, slots=True)
class DynamoOptions:
    """``policy_options`` of ``dynamo``, with Dynamo's defaults (module docstring)."""

    max_local_prefill_length: int = 2048
    max_remote_prefill_cache_hit_ratio: float = 0.3


class DynamoConditional(PerPhase):
    """Dynamo's conditional disaggregation (module docstring), least-loaded per phase."""

    name = "dynamo"
    Options = DynamoOptions

    def __init__(self, slo: Slo | None = None, options: DynamoOptions | None = None) -> None:
        opts = options or DynamoOptions()
        self.min_remote_tokens = opts.max_local_prefill_length
        self.min_uncached_share = 1.0 - opts.max_remote_prefill_cache_hit_ratio
        super().__init__(LeastRequest(slo), LeastRequest(slo))

    def choose(self, nodes: Sequence[NodeView], req: RequestInfo, now: float,
               rng: Random) -> str | None:
        """A pool without roles: its decode choice alone."""
        return self.decode.choose(nodes, req, now, rng)

    def remote(self, req: RequestInfo, decode_id: str) -> bool:
        prompt = req.prompt_tokens
        uncached = prompt - min(req.cached.get(decode_id, 0), prompt - 1)
        return uncached >= self.min_remote_tokens and uncached >= self.min_uncached_share * prompt
