"""Text for prompts that share prefixes, from a workload's block hashes.

A simulated workload (``tailguard.traffic.sessions``) or a Mooncake trace says
which ``block_tokens``-token blocks each prompt is made of: equal hashes, equal
content. To replay it against real engines, every hash becomes a fixed text
of ``block_tokens`` words drawn from a generator seeded by the hash, so two
prompts that share their first ``k`` hashes share their first ``k`` blocks of
text and the engines' prefix caches see the same reuse. A word is a space and
three letters: one token of the emulator's four-characters-a-token estimate
and about one or two for a real BPE tokenizer. What a prompt has beyond its
whole blocks (its last, partial block) is filler unique to the request.
"""

from __future__ import annotations

import random
import string

_LETTERS = string.ascii_lowercase


class BlockText:
    """Hash -> the block's text, made once and kept (sessions reuse their blocks)."""

    __slots__ = ("_cache", "_max", "block_tokens")

    def __init__(self, block_tokens: int, max_blocks: int = 50_000) -> None:
        self.block_tokens = block_tokens
        self._cache: dict[int, str] = {}
        self._max = max_blocks

    def block(self, h: int) -> str:
        text = self._cache.get(h)
        if text is None:
            text = _words(random.Random(h), self.block_tokens)
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[h] = text
        return text

    def prompt(self, blocks: tuple[int, ...], tokens: int, salt: int) -> str:
        """``tokens`` words: the whole blocks ``blocks`` covers, then unique filler."""
        bt = self.block_tokens
        whole = min(len(blocks), tokens // bt)
        head = "".join(self.block(h) for h in blocks[:whole])
        rest = tokens - whole * bt
        return head + (_words(random.Random(f"filler:{salt}"), rest) if rest > 0 else "")


def _words(rng: random.Random, n: int) -> str:
    pick = rng.choices
    return "".join(" " + "".join(pick(_LETTERS, k=3)) for _ in range(n))


__all__ = ["BlockText"]
