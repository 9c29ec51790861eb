"""Token accounting of a streamed answer without parsing its JSON chunks.

The gateway forwards a Server-Sent Events stream byte for byte, as it arrives.
To learn how many tokens it carried it only counts events: every event starts
a line with ``data:``, i.e. it is the start of the stream or follows ``\\n``.
Model text cannot fake one, because a newline inside a JSON string is the
two characters ``\\n``. Network chunks may split the marker, so the last five
bytes of the stream so far are kept and searched together with the next
chunk's first five.

At the end, the stream's last 2 KiB are searched for the usage chunk that engines
send with ``stream_options.include_usage`` (or vLLM's continuous usage stats):
``"completion_tokens": N`` there is exact, and so is
``"cached_tokens": N`` (``usage.prompt_tokens_details``: the prompt tokens
the engine served from its prefix cache; vLLM and llama.cpp report it).
llama.cpp's ``timings`` object, which its streams carry even without
``include_usage``, gives the same as ``predicted_n`` and ``cache_n``.
Without usage the estimate is the number of content events: all events minus
the ``[DONE]`` marker, minus a chat stream's role-only first event and the
events without content at its end (a ``"delta": {}`` or ``"text": ""``
that carries only the finish reason), which engines send beside one event per token.

An engine that fails after its stream began sends ``data: {"error": ...}``
as its last event: :meth:`SseCounter.engine_error` finds it in the tail, so
that such a stream is not counted a success.

Worked example: ``data: {..."delta":{"role":"assistant"}...}\\n\\ndata: {..."Hi"...}\\n\\n``
``data: {..."delta":{}..."finish_reason":"stop"}\\n\\ndata: [DONE]\\n\\n`` counts 4 events;
without usage the estimate is 4 - 1 - 1 - 1 = 1.
"""

from __future__ import annotations

import re

_MARK = b"\ndata:"
_CARRY = len(_MARK) - 1
_TAIL = 2048  # enough for a usage chunk and [DONE]
_HEAD = 512  # enough for a first event's delta
# usage.completion_tokens, or llama.cpp's timings.predicted_n (sent without include_usage)
_COMPLETION_TOKENS = re.compile(rb'"(?:completion_tokens|predicted_n)"\s*:\s*(\d+)')
# usage.prompt_tokens_details.cached_tokens, or llama.cpp's timings.cache_n
_CACHED_TOKENS = re.compile(rb'"(?:cached_tokens|cache_n)"\s*:\s*(\d+)')
# usage.prompt_tokens, or llama.cpp's timings.prompt_n (the tokens it computed beside cache_n)
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_LLAMA_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_ROLE_ONLY = re.compile(
    rb'"delta"\s*:\s*\{\s*"role"\s*:\s*"[a-z]+"\s*(,\s*"content"\s*:\s*(null|"")\s*)?\}')
_EMPTY_DELTA = re.compile(rb'"delta"\s*:\s*\{\s*("content"\s*:\s*(null|"")\s*)?\}'
                          rb'|"text"\s*:\s*""')
_ERROR_EVENT = re.compile(rb'(^|\n)data:\s*\{\s*"error"\s*:')


def usage_completion_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of the last usage object in ``body``, if any."""
    found = _COMPLETION_TOKENS.findall(body)
    return int(found[-1]) if found else None


def usage_cached_tokens(body: bytes, prompt_estimate: int | None = None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` in ``body``, if the engine reported it.

    With ``prompt_estimate`` (the gateway's size of the prompt), the count is
    scaled to the gateway's units by the engine's own prompt count: the core
    compares it with the estimate, and a tokenizer that makes 1,300 tokens of
    what the gateway sized at 1,000 would otherwise report more cached than the
    whole prompt. Worked example: 900 cached of 1,300 prompt tokens for an
    estimate of 1,000 is 692.
    """
    found = _CACHED_TOKENS.findall(body)
    if not found:
        return None
    cached = int(found[-1])
    if prompt_estimate is None:
        return cached
    prompt = _PROMPT_TOKENS.findall(body)
    if prompt:
        real = int(prompt[-1])
    else:
        computed = _LLAMA_PROMPT_N.findall(body)  # llama.cpp: computed + cached = the prompt
        real = int(computed[-1]) + cached if computed else 0
    if real <= 0:
        return min(cached, prompt_estimate)
    return min(prompt_estimate, round(cached * prompt_estimate / real))


class SseCounter:
    """Counts the events of one stream; feed it every chunk, in order."""

    __slots__ = ("_carry", "_head", "_tail", "events")

    def __init__(self) -> None:
        self.events = 0
        self._head = b""  # the stream's first bytes
        # The stream's start counts as a line start: a virtual newline before it.
        self._carry = b"\n"
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        # Markers that start in the last bytes of the stream so far and end in
        # this chunk (a whole marker cannot fit in either part alone).
        carry = self._carry
        if len(self._head) < _HEAD:
            self._head = (self._head + chunk)[:_HEAD]
        self.events += (carry + chunk[:_CARRY]).count(_MARK) + chunk.count(_MARK)
        self._carry = chunk[-_CARRY:] if len(chunk) >= _CARRY else (carry + chunk)[-_CARRY:]
        self._tail = chunk if len(chunk) >= _TAIL else (self._tail + chunk)[-_TAIL:]

    def output_tokens(self) -> int:
        """Exact from the usage chunk when present, else the content-event count."""
        tail = self._tail
        exact = usage_completion_tokens(tail)
        if exact is not None:
            return exact
        extra = 1 if b"[DONE]" in tail else 0
        head = self._head
        first_end = head.find(b"\n\n")
        if _ROLE_ONLY.search(head[:first_end] if first_end >= 0 else head):
            extra += 1
        # Trailing events without content (finish reason only): after the last token.
        extra += len(_EMPTY_DELTA.findall(tail[-600:]))
        return max(0, self.events - extra)

    def cached_tokens(self, prompt_estimate: int | None = None) -> int | None:
        """Prompt tokens the engine reported served from its cache (None: not reported),
        in the gateway's units when given its estimate of the prompt (see
        :func:`usage_cached_tokens`)."""
        return usage_cached_tokens(self._tail, prompt_estimate)

    def engine_error(self) -> bool:
        """Whether the stream ended with an engine's own error event."""
        return bool(_ERROR_EVENT.search(self._tail[-1024:]))
