"""A migrated stream on the wire: the continuation's request, and its events spliced
into the answer the client is already reading.

When the exchange moves a committed stream (:class:`~tailguard.core.exchange.Migrate`),
the gateway knows the answer only as the SSE bytes it relayed. This module
turns them into a continuation request and makes the continuation's events
look like the rest of the original stream:

* :class:`Relayed` keeps the complete events sent to the client (while a
  stream may move, the gateway relays whole events only, so the client never
  holds half an event when another node takes over) and reads them back on a
  move: the text so far, the first event's ``id``, ``created``, ``model`` and
  choice index, and whether the answer is already finished.
* :func:`continuation_body`: for chat completions the original messages plus
  the partial assistant message, continued (``continue_final_message: true``
  with ``add_generation_prompt: false``, which vLLM, SGLang and TGI take; the
  llama.cpp server continues a trailing assistant message by itself); for
  completions the prompt plus the text so far. ``max_tokens`` (or
  ``max_completion_tokens``) is what is left. None where a continuation cannot
  be faithful: several choices, tool calls, reasoning deltas, a tokenised prompt.
* :class:`Rewriter`: each event of the continuation gets the original ``id``,
  ``created``, ``model`` and choice index; its role delta is dropped (the
  client had one); its ``usage`` counts the whole answer (completion tokens of
  both nodes, and the prompt the client sent: the continuation's prompt count
  less the answer tokens it was given).

The continuation re-tokenises the text so far, which may cut it into tokens
other than the ones the first node produced: the seam can differ from what one
node would have written, never in the text already sent.

Only this path parses JSON per event: a stream that never moves is relayed
as bytes (its cost is one ``rfind`` per chunk, to hold back a partial event).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_SEP = b"\n\n"
DONE = b"data: [DONE]\n\n"
# The engines whose chat endpoint continues a final assistant message (facts.md).
CONTINUES_CHAT = frozenset({"vllm", "sglang", "tgi", "llamacpp"})


@dataclass(slots=True)
class SoFar:
    """What the client has received of the answer, read back from the events."""

    text: str
    tokens: int  # events that carried text: one token each as engines stream them
    id: str | None
    created: int | None
    model: str | None
    index: int
    finished: bool  # a finish reason was sent: nothing is left to generate
    faithful: bool  # a continuation can reproduce it (no tool calls, one choice)


def whole_events(pending: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """``pending`` then ``chunk`` split after their last complete event: (the whole
    events, the partial rest). The usual chunk, whole events and nothing pending,
    is returned as it is, copied nowhere."""
    data = pending + chunk if pending else chunk
    end = data.rfind(_SEP) + len(_SEP)
    if end < len(_SEP):  # no event ends in it
        return b"", data
    if end == len(data):
        return data, b""
    return data[:end], data[end:]


def _events(data: bytes) -> Iterator[dict[str, Any]]:
    for event in data.split(_SEP):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


class Relayed:
    """The complete events of a stream that may move, as sent to the client.

    :meth:`cut` splits each chunk at its last event boundary: the part before
    goes to the client (and is kept), the rest waits for the next chunk.
    """

    __slots__ = ("pending", "sent")

    def __init__(self) -> None:
        self.sent: list[bytes] = []  # joined only when the stream moves
        self.pending = b""

    def cut(self, chunk: bytes) -> bytes:
        """What of ``chunk`` to send now: whole events only."""
        out, self.pending = whole_events(self.pending, chunk)
        if out:
            self.sent.append(out)
        return out

    def flush(self) -> bytes:
        """The held-back rest, at the stream's end (a last event without its blank line)."""
        out, self.pending = self.pending, b""
        self.sent.append(out)
        return out

    def so_far(self, chat: bool) -> SoFar:
        text: list[str] = []
        tokens = 0
        first: dict[str, Any] | None = None
        index = 0
        finished = False
        faithful = True
        for obj in _events(b"".join(self.sent)):
            choices = obj.get("choices")
            if not isinstance(choices, list):
                continue
            if first is None:
                first = obj
            if len(choices) > 1:
                faithful = False
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                index = choice.get("index", index) if isinstance(choice.get("index"), int) \
                    else index
                if choice.get("finish_reason"):
                    finished = True
                piece: Any
                if chat:
                    delta = choice.get("delta")
                    if not isinstance(delta, dict):
                        continue
                    if delta.get("tool_calls") or delta.get("reasoning_content") \
                            or delta.get("reasoning"):
                        faithful = False
                    piece = delta.get("content")
                else:
                    piece = choice.get("text")
                if isinstance(piece, str) and piece:
                    text.append(piece)
                    tokens += 1
        return SoFar("".join(text), tokens,
                     first.get("id") if first else None,
                     first.get("created") if first else None,
                     first.get("model") if first else None,
                     index, finished, faithful)


def continuation_body(doc: dict[str, Any], chat: bool, so_far: SoFar,
                      priority: int | None = None) -> bytes | None:
    """The continuation's request: the client's ``doc`` with the answer so far, asking
    for the rest (None where it cannot be faithful; see the module docstring);
    ``priority``: the engine scheduling priority it asks for (``migration.engine_priority``)."""
    if not so_far.faithful or doc.get("n", 1) not in (1, None):
        return None
    body = dict(doc)
    body["stream"] = True
    if priority is not None:
        body["priority"] = priority
    if chat:
        messages = doc.get("messages")
        if not isinstance(messages, list):
            return None
        body["messages"] = [*messages, {"role": "assistant", "content": so_far.text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        body.pop("echo", None)
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None  # token ids or several prompts
        body["prompt"] = prompt + so_far.text
        body.pop("echo", None)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = doc.get(key)
        if isinstance(limit, int):
            left = limit - so_far.tokens
            if left < 1:
                return None
            body[key] = left
            if isinstance(doc.get("min_tokens"), int):
                body["min_tokens"] = max(0, doc["min_tokens"] - so_far.tokens)
    return json.dumps(body).encode()


def moved_comment(old: str, new: str, cause: str, after: int) -> bytes:
    """The SSE comment that marks a move in the stream (``migration.announce``):
    clients skip comment lines, so the stream stays a plain OpenAI stream."""
    return f": tailguard moved this answer from {old} to {new} after {after} tokens " \
           f"({cause})\n\n".encode()


class Rewriter:
    """Rewrites a continuation's SSE bytes into events of the original stream."""

    __slots__ = ("buf", "so_far")

    def __init__(self, so_far: SoFar) -> None:
        self.so_far = so_far
        self.buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """The rewritten complete events in ``chunk`` (a partial one waits)."""
        done, self.buf = whole_events(self.buf, chunk)
        return b"".join(self._event(e) for e in done.split(_SEP) if e.strip())

    def flush(self) -> bytes:
        out = self._event(self.buf) if self.buf.strip() else b""
        self.buf = b""
        return out

    def _event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        out: list[bytes] = []
        for line in lines:
            if not line.startswith(b"data:"):
                out.append(line)
                continue
            payload = line[5:].strip()
            try:
                obj = json.loads(payload) if payload != b"[DONE]" else None
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                out.append(line)
                continue
            if not self._rewrite(obj):
                continue
            out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode())
        if not any(line.startswith(b"data:") for line in out):
            return b""
        return b"\n".join(out) + _SEP

    def _rewrite(self, obj: dict[str, Any]) -> bool:
        """Rewrite one event in place; False to drop it (a role-only delta)."""
        s = self.so_far
        if "error" in obj and "choices" not in obj:
            return True  # the engine's own error event: the driver deals with it
        for key, value in (("id", s.id), ("created", s.created), ("model", s.model)):
            if value is not None:
                obj[key] = value
        keep = True
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                choice["index"] = s.index
                delta = choice.get("delta")
                if isinstance(delta, dict) and "role" in delta:
                    del delta["role"]
                    if not delta.get("content") and not choice.get("finish_reason") \
                            and not choice.get("logprobs") and not obj.get("usage"):
                        keep = False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            done = usage.get("completion_tokens")
            if isinstance(done, int):
                usage["completion_tokens"] = done + s.tokens
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int):
                usage["prompt_tokens"] = max(1, prompt - s.tokens)
            if isinstance(usage.get("prompt_tokens"), int) and \
                    isinstance(usage.get("completion_tokens"), int):
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return keep


__all__ = ["CONTINUES_CHAT", "DONE", "Relayed", "Rewriter", "SoFar", "continuation_body",
           "moved_comment"]
