"""Token accounting of a streamed answer without parsing its JSON chunks.

The gateway forwards a Server-Sent Events stream byte for byte, as it arrives.
To learn how many tokens it carried it only counts events: every event starts
a line with ``data:``, i.e. it is the start of the stream or follows ``\\n``.
Model text cannot fake one, because a newline inside a JSON string is the
two characters ``\\n``. Network chunks may split the marker, so the last five
bytes of each chunk are kept and searched together with the next chunk's
first five.

At the end, the last few chunks are searched for the usage chunk that engines
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
_HEAD = b"data:"
_CARRY = len(_MARK) - 1
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def usage_completion_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of the last usage object in ``body``, if any."""
    found = _COMPLETION_TOKENS.findall(body)
    return int(found[-1]) if found else None


class SseCounter:
    """Counts the events of one stream; feed it every chunk, in order."""

    __slots__ = ("_carry", "_prev", "_prev2", "events", "started")

    def __init__(self) -> None:
        self.events = 0
        self.started = False
        self._carry = b""
        self._prev = b""
        self._prev2 = b""

    def feed(self, chunk: bytes) -> None:
        if not self.started:
            self.started = True
            if chunk.startswith(_HEAD):
                self.events += 1
        elif self._carry:
            # A marker split across the previous chunk and this one.
            self.events += (self._carry + chunk[:_CARRY]).count(_MARK)
        self.events += chunk.count(_MARK)
        self._carry = chunk[-_CARRY:]
        self._prev2 = self._prev
        self._prev = chunk

    def output_tokens(self) -> int:
        """Exact from the usage chunk when present, else the content-event count."""
        tail = self._prev2 + self._prev
        exact = usage_completion_tokens(tail)
        if exact is not None:
            return exact
        done = 1 if b"[DONE]" in tail else 0
        return max(0, self.events - done)
