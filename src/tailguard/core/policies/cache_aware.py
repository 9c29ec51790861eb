"""cache_aware: the prefix-affinity router of SGLang's router and vllm-router.

What it does, as SGLang's router documents it (``sgl-router``, now
``sgl-model-gateway``: the comment on ``CacheAwarePolicy`` and the defaults
in ``bindings/python/src/sglang_router/router_args.py``; vllm-router is a fork
of it with the same policy):

1. Each worker has an approximate radix tree of the prompts the router sent
   it (no engine is asked; the tree is trimmed to ``max_tree_size`` by LRU).
2. The fleet is *imbalanced* when both ``max_load - min_load >
   balance_abs_threshold`` (default 64) and ``max_load > balance_rel_threshold
   * min_load`` (default 1.5), loads being the requests in flight at the
   router: then the least loaded worker gets the request.
3. Otherwise the worker with the longest prefix match wins if its match rate
   (matched / prompt length) exceeds ``cache_threshold`` (default 0.3); below
   it, the worker with the smallest tree (the most free cache, presumably).
4. The prompt is inserted into the chosen worker's tree.

Here the tree is a :class:`~tailguard.core.prefix.PrefixIndex` over the same
hashed blocks the engines cache, so match rates are in blocks, not
characters; like the original it learns nothing from what the engines
report. It is blind to hardware and to the SLO: a session whose cache sits on
a slow or throttled node stays there until that node is 64 requests busier
than the idlest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from random import Random

from tailguard.core.fleet import NodeView
from tailguard.core.policies.base import RequestInfo, Slo
from tailguard.core.prefix import PrefixIndex

_TREE_BLOCKS = 1 << 24  # per worker: like max_tree_size, never reached in a run here


@dataclass(frozen=True, slots=True)
class CacheAwareOptions:
    """``policy_options`` of ``cache_aware``, with SGLang's defaults (module docstring)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


class CacheAware:
    name = "cache_aware"
    Options = CacheAwareOptions

    def __init__(self, slo: Slo | None = None, options: CacheAwareOptions | None = None) -> None:
        opts = options or CacheAwareOptions()
        self.cache_threshold = opts.cache_threshold
        self.balance_abs = opts.balance_abs_threshold
        self.balance_rel = opts.balance_rel_threshold
        self._trees: PrefixIndex | None = None

    def _tree(self, block_tokens: int) -> PrefixIndex:
        if self._trees is None or self._trees.block_tokens != block_tokens:
            self._trees = PrefixIndex(block_tokens, _TREE_BLOCKS)
        return self._trees

    def choose(
        self, nodes: Sequence[NodeView], req: RequestInfo, now: float, rng: Random
    ) -> str | None:
        if not nodes:
            return None
        least = min(nodes, key=lambda n: n.fleet_in_flight)
        most = max(n.fleet_in_flight for n in nodes)
        low = least.fleet_in_flight
        if most - low > self.balance_abs and most > self.balance_rel * low:
            return least.id
        if not req.prefix or req.block_tokens < 1:
            return least.id
        tree = self._tree(req.block_tokens)
        matches = tree.match(req.prefix)
        best: NodeView | None = None
        best_k = 0
        for n in nodes:
            k = matches.get(n.id, 0)
            if k > best_k:
                best, best_k = n, k
        if best is not None and best_k * req.block_tokens > self.cache_threshold * req.prompt_tokens:
            return best.id
        return min(nodes, key=lambda n: tree.blocks_at(n.id)).id

    def on_dispatch(self, node_id: str, req: RequestInfo) -> None:
        """The request went to ``node_id``: its prompt joins that worker's tree."""
        if req.prefix and req.block_tokens >= 1:
            self._tree(req.block_tokens).insert(node_id, req.prefix)
