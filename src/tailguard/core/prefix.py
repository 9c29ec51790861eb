"""Which node holds which prompt blocks: an approximate, bounded index.

The driver hashes each prompt into chained blocks (equal hash, equal prefix up
to and including that block, as vLLM keys its KV blocks). The index remembers,
per node, the blocks recently sent there, as an LRU of at most its estimated
cache size, and answers for a new prompt how many of its leading blocks each
node probably still holds. It never asks the engines: it learns from what
they report (``usage.prompt_tokens_details.cached_tokens``):

* sending a prompt to a node inserts its blocks there (the engine caches
  what it computes), most recently used at the chain's head, as the engine
  frees a request's blocks tail first;
* a node that reports fewer cached tokens than predicted (by more than one
  block: the gateway's text blocks and the engine's token blocks do not
  align, so a match may read one block short) had evicted them:
  its estimated cache shrinks to what the index held there, times
  ``shrink`` (the engine's free KV is smaller than assumed, usually because it
  is busy); a node that reports at least the prediction grows it back by
  ``grow`` per confirmed hit, up to the node's whole KV;
* a node that reports more than predicted holds blocks this gateway did not
  send (another replica did, or a restart forgot them): they are added.

Memory is bounded by ``max_blocks`` per node (and by each node's KV size in
blocks). Sans-IO like the rest of the core.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_MIN_BLOCKS = 16  # the smallest estimated cache a node shrinks to


class PrefixIndex:
    """Approximate map of prompt blocks to the nodes that hold them."""

    __slots__ = ("_cap", "_holders", "_kv", "_lru", "_max", "block_tokens", "grow", "shrink")

    def __init__(self, block_tokens: int, max_blocks: int = 1 << 16, *, shrink: float = 0.8,
                 grow: float = 1.02) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self._max = max_blocks
        self.shrink = shrink
        self.grow = grow
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}  # node -> blocks, LRU first
        self._cap: dict[str, float] = {}  # node -> estimated cache size (blocks)
        self._kv: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_at(self, node: str) -> int:
        lru = self._lru.get(node)
        return len(lru) if lru is not None else 0

    def capacity(self, node: str) -> float:
        return self._cap.get(node, 0.0)

    def set_kv(self, node: str, kv_tokens: int) -> None:
        """The node's KV capacity in tokens: the most its prefix cache can hold."""
        blocks = max(_MIN_BLOCKS, min(self._max, kv_tokens // self.block_tokens))
        self._kv[node] = blocks
        self._cap[node] = min(self._cap.get(node, float(blocks)), float(blocks))
        self._fit(node)

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """For each node holding the first block: how many leading blocks it holds."""
        out: dict[str, int] = {}
        holders = self._holders
        if not blocks:
            return out
        first = holders.get(blocks[0])
        if not first:
            return out
        alive = set(first)
        i = 1
        for h in blocks[1:]:
            have = holders.get(h)
            if not have:
                break
            gone = alive - have
            if gone:
                for node in gone:
                    out[node] = i
                alive -= gone
                if not alive:
                    break
            i += 1
        for node in alive:
            out[node] = i
        return out

    def insert(self, node: str, blocks: Sequence[int]) -> None:
        """The node computes (or reuses) these blocks: it holds them now."""
        if not blocks:
            return
        lru = self._lru.get(node)
        if lru is None:
            lru = self._lru[node] = OrderedDict()
            if node not in self._cap:
                self._cap[node] = float(self._max)
        holders = self._holders
        for h in reversed(blocks):  # the head ends most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                got = holders.get(h)
                if got is None:
                    holders[h] = {node}
                else:
                    got.add(node)
        self._fit(node)

    def observe(self, node: str, blocks: Sequence[int], predicted: int, cached_tokens: int) -> None:
        """The node reported ``cached_tokens`` for a prompt predicted to hit ``predicted`` blocks."""
        found = min(len(blocks), cached_tokens // self.block_tokens)
        cap = self._cap.get(node)
        if cap is None:
            return
        if found < predicted - 1:
            held = len(self._lru.get(node, ()))
            self._cap[node] = max(float(_MIN_BLOCKS), min(cap, held * self.shrink))
        elif predicted > 0:
            self._cap[node] = min(float(self._kv.get(node, self._max)), cap * self.grow)
        if found > predicted:
            self.insert(node, blocks[:found])
        else:
            self._fit(node)

    def forget(self, node: str) -> None:
        """The node lost its cache (restarted, removed)."""
        lru = self._lru.pop(node, None)
        if lru is None:
            return
        holders = self._holders
        for h in lru:
            got = holders.get(h)
            if got is not None:
                got.discard(node)
                if not got:
                    del holders[h]

    def _fit(self, node: str) -> None:
        lru = self._lru.get(node)
        if lru is None:
            return
        cap = int(self._cap.get(node, self._max))
        holders = self._holders
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            got = holders.get(h)
            if got is not None:
                got.discard(node)
                if not got:
                    del holders[h]


__all__ = ["PrefixIndex"]
