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
``"completion_tokens": N`` there is exact. Without it the estimate is the
number of content events: all events minus the ``[DONE]`` marker (engines
emit about one event per token; a chat stream's role-only first event makes
it one high, which is noise for the balancer's averages).

Worked example: ``data: {..."role"...}\\n\\ndata: {..."Hi"...}\\n\\ndata: [DONE]\\n\\n``
counts 3 events; without usage the estimate is 3 - 1 = 2.
"""

from __future__ import annotations

import re

_MARK = b"\ndata:"
_CARRY = len(_MARK) - 1
_TAIL = 2048  # enough for a usage chunk and [DONE]
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def usage_completion_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of the last usage object in ``body``, if any."""
    found = _COMPLETION_TOKENS.findall(body)
    return int(found[-1]) if found else None


class SseCounter:
    """Counts the events of one stream; feed it every chunk, in order."""

    __slots__ = ("_carry", "_tail", "events")

    def __init__(self) -> None:
        self.events = 0
        # The stream's start counts as a line start: a virtual newline before it.
        self._carry = b"\n"
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        # Markers that start in the last bytes of the stream so far and end in
        # this chunk (a whole marker cannot fit in either part alone).
        carry = self._carry
        self.events += (carry + chunk[:_CARRY]).count(_MARK) + chunk.count(_MARK)
        self._carry = chunk[-_CARRY:] if len(chunk) >= _CARRY else (carry + chunk)[-_CARRY:]
        self._tail = chunk if len(chunk) >= _TAIL else (self._tail + chunk)[-_TAIL:]

    def output_tokens(self) -> int:
        """Exact from the usage chunk when present, else the content-event count."""
        tail = self._tail
        exact = usage_completion_tokens(tail)
        if exact is not None:
            return exact
        done = 1 if b"[DONE]" in tail else 0
        return max(0, self.events - done)
