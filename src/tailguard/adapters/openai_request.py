"""Checking an OpenAI request just enough to route it, and sizing its prompt.

The gateway forwards the client's bytes unchanged (unknown fields pass
through); it parses the JSON once to learn the ``model`` (the pool), whether
the answer is streamed, the client's ``max_tokens`` cap, and the prompt's
size, and rejects what no engine would accept with a 400 naming the field.

The prompt size is an *estimate*, about four characters per token (OpenAI's
rule of thumb for English BPE), plus 3 tokens of chat-template framing per
message; token-id prompts count exactly. The balancer only uses it to weigh
prefill work, so a 20% error moves nothing that matters, while running a
tokenizer per request would cost more than the whole proxy path.
Worked example: one message ``"Say hello in French"`` (19 characters) is
``ceil(19/4) + 3 = 8`` tokens.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from tailguard.core.balancer import PREFIX_BLOCK_TOKENS
from tailguard.prompt_blocks import chat_text, prompt_blocks, text_blocks

#: Characters per hashed prompt block: the core's block of tokens at four characters a token.
BLOCK_CHARS = 4 * PREFIX_BLOCK_TOKENS
#: A client's session key for session affinity (else the body's OpenAI ``user`` field).
SESSION_HEADER = "x-session-id"


def session_key(header: str | None, req: RoutedRequest) -> str | None:
    """The session a request belongs to: its header, else the body's ``user``."""
    return header if header else req.session

CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"

#: endpoint name -> upstream path
PATHS = {
    CHAT: "/v1/chat/completions",
    COMPLETIONS: "/v1/completions",
    EMBEDDINGS: "/v1/embeddings",
}


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """What the gateway needs to know about a request to route and account it."""

    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int | None
    prefix: tuple[int, ...] = ()  # the prompt's hashed blocks (tailguard.prompt_blocks)
    session: str | None = None  # the body's ``user`` (OpenAI's end-user id)


class InvalidRequest(Exception):
    """A request to refuse with 400; ``code`` names the problem, ``param`` the field."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def _text_tokens(text: str) -> int:
    return (len(text) + 3) // 4


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):  # multi-part content: [{"type": "text", "text": ...}, ...]
        total = 0
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    total += _text_tokens(text)
        return total
    return 0


def _prompt_tokens(prompt: Any) -> int:
    """Tokens of a completions ``prompt`` / embeddings ``input`` (str, [str], [int], [[int]])."""
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list):
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += _text_tokens(item)
            elif isinstance(item, int):
                total += 1
            elif isinstance(item, list):
                total += len(item)
        return total
    return 0


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return all(isinstance(x, str) for x in prompt)
        if isinstance(first, int) and not isinstance(first, bool):
            return all(isinstance(x, int) and not isinstance(x, bool) for x in prompt)
        if isinstance(first, list):
            return all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in prompt)
    return False


def _max_tokens(data: dict[str, Any]) -> int | None:
    value = None
    for key in ("max_completion_tokens", "max_tokens"):
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidRequest(f"'{key}' must be a positive integer, got {v!r}",
                                 "invalid_value", key)
        value = v if value is None else min(value, v)
    return value


def _user(data: dict[str, Any]) -> str | None:
    user = data.get("user")
    return user if isinstance(user, str) and user else None


def parse_request(endpoint: str, body: bytes) -> RoutedRequest:
    """Check ``body`` for ``endpoint`` and size it; raises :class:`InvalidRequest`."""
    try:
        data = json.loads(body.decode("utf-8-sig"))  # JSON on the wire is UTF-8 (RFC 8259)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", "invalid_json") from exc
    except RecursionError as exc:  # "[[[[..." thousands deep: the decoder's stack ran out
        raise InvalidRequest("the request body nests too deeply", "invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object", "invalid_json")
    model = data.get("model")
    if model is None:
        raise InvalidRequest("you must provide a 'model' parameter", "missing_field", "model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(f"'model' must be a non-empty string, got {model!r}",
                             "invalid_value", "model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be true or false, got {stream!r}",
                             "invalid_value", "stream")
    if endpoint == CHAT:
        messages = data.get("messages")
        if messages is None:
            raise InvalidRequest("you must provide a 'messages' parameter", "missing_field",
                                 "messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty list", "invalid_value",
                                 "messages")
        tokens = 0
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise InvalidRequest(f"'messages[{i}]' must be an object with a 'role'",
                                     "invalid_value", f"messages[{i}]")
            tokens += _content_tokens(msg.get("content")) + 3
        return RoutedRequest(model, stream, max(tokens, 1), _max_tokens(data),
                             text_blocks(chat_text(messages), BLOCK_CHARS), _user(data))
    if endpoint == COMPLETIONS:
        prompt = data.get("prompt")
        if prompt is None:
            raise InvalidRequest("you must provide a 'prompt' parameter", "missing_field",
                                 "prompt")
        if not _valid_prompt(prompt):
            raise InvalidRequest("'prompt' must be a string, a list of strings or token ids",
                                 "invalid_value", "prompt")
        return RoutedRequest(model, stream, max(_prompt_tokens(prompt), 1), _max_tokens(data),
                             prompt_blocks(prompt, BLOCK_CHARS), _user(data))
    # embeddings: no answer tokens, never streamed
    inp = data.get("input")
    if inp is None:
        raise InvalidRequest("you must provide an 'input' parameter", "missing_field", "input")
    if not _valid_prompt(inp):
        raise InvalidRequest("'input' must be a string, a list of strings or token ids",
                             "invalid_value", "input")
    return RoutedRequest(model, False, max(_prompt_tokens(inp), 1), 1)


PRIORITY_HEADER = "x-tailguard-priority"


def priority_of(raw: str | None) -> int:
    """An ``x-tailguard-priority`` value: 0 (``high``), 2 (``low``), else 1."""
    if raw is None:
        return 1
    return {"0": 0, "high": 0, "2": 2, "low": 2}.get(raw.strip().lower(), 1)


def bearer_ok(header: str, keys: tuple[str, ...]) -> bool:
    """An ``Authorization`` value ``Bearer <key>`` with one of ``keys`` (constant time)."""
    if not header.startswith("Bearer "):
        return False
    given = header[7:].strip().encode()
    ok = False
    for k in keys:  # no early exit: the time taken does not reveal which key matched
        ok |= hmac.compare_digest(given, k.encode())
    return ok
