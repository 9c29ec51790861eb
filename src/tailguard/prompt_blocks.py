"""Hashing a prompt's text into chained blocks, as prefix caches key their KV.

An engine's prefix cache (vLLM's automatic prefix caching, SGLang's radix
tree) reuses the KV of a prompt's leading tokens that an earlier prompt
shared. The gateway has no tokenizer, so it cuts the prompt's *text* into
blocks of ``block_chars`` characters (at about four characters per token,
the same estimate it sizes prompts with) and gives block ``i`` the hash of
block ``i - 1``'s hash and its own text: equal hashes mean an equal prefix up
to that block, vLLM's rule for its token blocks. Only whole blocks count.

A chat request's text is its messages in order, each as its role, a newline,
its text content and a blank line, so a conversation that resends its history
shares the history's blocks, and two tenants with the same system prompt share
theirs. Token-id prompts hash their ids the same way (``block_chars`` ids a
block: a tokenizer-free client is rare enough not to size it more finely).

Hashes are Python's own (randomised per process for ``str``): they only need
to agree within one process: the gateway's index, or one emulated engine.
Cost, measured (2-core machine, busy): about 1 us a 512-character block; a
4,000-character chat request 8.5 us of its 33 us parse, a 48,000-character one
86 us of 170 us.
"""

from __future__ import annotations

from typing import Any

_MASK = (1 << 62) - 1


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chat_text(messages: list[Any]) -> str:
    """The text of a chat request's messages, in the order the engine sees them."""
    parts: list[str] = []
    for m in messages:
        if isinstance(m, dict):
            role = m.get("role")
            parts.append(role if isinstance(role, str) else "")
            parts.append("\n")
            parts.append(_content_text(m.get("content")))
            parts.append("\n\n")
    return "".join(parts)


def text_blocks(text: str, block_chars: int) -> tuple[int, ...]:
    """Chained hashes of ``text``'s whole ``block_chars``-character blocks."""
    out: list[int] = []
    h = 0
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[i : i + block_chars])) & _MASK
        out.append(h)
    return tuple(out)


def prompt_blocks(prompt: Any, block_chars: int) -> tuple[int, ...]:
    """A completions ``prompt`` (str, [str], [int], [[int]]): its first prompt's blocks."""
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return text_blocks(first, block_chars)
        if isinstance(first, int):
            ids = prompt
        elif isinstance(first, list):
            ids = first
        else:
            return ()
        out: list[int] = []
        h = 0
        for i in range(0, len(ids) - block_chars + 1, block_chars):
            h = hash((h, tuple(ids[i : i + block_chars]))) & _MASK
            out.append(h)
        return tuple(out)
    if isinstance(prompt, str):
        return text_blocks(prompt, block_chars)
    return ()


__all__ = ["chat_text", "prompt_blocks", "text_blocks"]
