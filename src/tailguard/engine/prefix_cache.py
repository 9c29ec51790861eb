"""An engine's prefix cache, in the manner of vLLM's automatic prefix caching.

vLLM (V1, ``vllm/v1/core/kv_cache_manager.py`` and ``block_pool.py``) keys every
*full* KV block by a hash chained over the block's tokens and every block before
it, so equal hashes mean an equal prefix. A request's prompt is looked up block
by block from the start; the leading blocks found are not computed again. A
block stays in the cache after its request ends, as a *free* block that still
holds its KV, until the pool needs it for new work: then the least recently
freed block goes first. A request frees its blocks tail first, so the head of
a chain (a system prompt, a conversation's first turns) outlives its tail.

This model keeps those rules at the granularity of the workload's hashed
blocks (``block_tokens`` each, e.g. Mooncake's 512-token ``hash_ids``):

* ``held``: blocks some running request uses, with a reference count;
* ``free``: blocks no request uses, in LRU order, that count against the free
  KV space: the engine evicts from their head whenever they would not fit in
  the blocks its running requests leave free (:meth:`fit`).

Simplification, conservative for the cache: two running requests that share a
prefix each allocate its KV in the engine's accounting (vLLM shares the
blocks), so under KV pressure this engine has a little less room than vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Hashed KV blocks: those in use (reference counted) and the free ones (LRU)."""

    __slots__ = ("_free", "_refs", "free_tokens")

    def __init__(self) -> None:
        self._free: OrderedDict[int, int] = OrderedDict()  # hash -> tokens, LRU first
        self._refs: dict[int, tuple[int, int]] = {}  # hash -> (references, tokens)
        self.free_tokens = 0  # tokens of the free blocks

    def __len__(self) -> int:
        return len(self._free) + len(self._refs)

    def __contains__(self, h: int) -> bool:
        return h in self._refs or h in self._free

    def lookup(self, blocks: Sequence[int], limit: int) -> int:
        """How many leading blocks of ``blocks[:limit]`` the cache holds."""
        k = 0
        refs, free = self._refs, self._free
        for h in blocks[:limit]:
            if h not in refs and h not in free:
                break
            k += 1
        return k

    def acquire(self, blocks: Sequence[int], block_tokens: int) -> None:
        """A running request uses these blocks (already cached, or just computed)."""
        refs, free = self._refs, self._free
        for h in blocks:
            held = refs.get(h)
            if held is not None:
                refs[h] = (held[0] + 1, held[1])
                continue
            size = free.pop(h, None)
            if size is not None:
                self.free_tokens -= size
                refs[h] = (1, size)
            else:
                refs[h] = (1, block_tokens)

    def release(self, blocks: Sequence[int]) -> None:
        """The request no longer uses these blocks; the last user frees them, tail first."""
        refs, free = self._refs, self._free
        for h in reversed(blocks):
            held = refs.get(h)
            if held is None:
                continue
            if held[0] > 1:
                refs[h] = (held[0] - 1, held[1])
                continue
            del refs[h]
            free[h] = held[1]
            self.free_tokens += held[1]

    def add_free(self, blocks: Sequence[int], block_tokens: int) -> None:
        """Blocks computed by a request that has ended (its answer's), freed tail first."""
        refs, free = self._refs, self._free
        for h in reversed(blocks):
            if h in refs:
                continue
            size = free.pop(h, None)
            if size is None:
                size = block_tokens
                self.free_tokens += size
            free[h] = size

    def fit(self, free_kv_tokens: int) -> None:
        """Evict the least recently freed blocks until the free ones fit in ``free_kv_tokens``."""
        free = self._free
        while self.free_tokens > free_kv_tokens and free:
            _, size = free.popitem(last=False)
            self.free_tokens -= size

    def clear(self) -> None:
        self._free.clear()
        self._refs.clear()
        self.free_tokens = 0


__all__ = ["PrefixCache"]
