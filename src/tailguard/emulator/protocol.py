"""The OpenAI wire format of the emulated engines: request parsing and response bytes.

Parsing keeps to what an engine must know: the served model, how many prompt
tokens to charge, how many tokens to generate, and whether to stream.

Prompt tokens are *estimated* from the text, about four characters per token
(the rule of thumb OpenAI gives for English with its BPE tokenizers): a chat
message costs ``ceil(chars/4)`` plus 3 tokens of role framing, like the
per-message overhead of the chat templates; a completions prompt given as
token ids counts exactly. Worked example: ``[{"role": "user", "content":
"Say hello in French"}]`` has 19 characters, so ``ceil(19/4) + 3 = 8`` tokens.

Every generated token is the same text (:data:`TOKEN_TEXT`), so a stream's
per-token SSE event is one ``bytes`` object built once per request
(:class:`ChunkTemplate`); a step that yields ``k`` tokens writes ``chunk * k``.
No JSON is encoded per token: this is what lets one Python process stream
thousands of tokens per second (see ``benchmarks/emulator_throughput.py``).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tailguard.prompt_blocks import chat_text, prompt_blocks, text_blocks

#: Text of every generated token (one token, as ``" the"`` would be for BPE).
TOKEN_TEXT = " tok"
#: Tokens per KV block (vLLM's default block size), and their characters at four a token:
#: the prompt's text is hashed in such blocks for the engine's prefix cache.
BLOCK_TOKENS = 16
BLOCK_CHARS = 4 * BLOCK_TOKENS
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
}


class RequestError(Exception):
    """A request the engine refuses; ``status`` is the HTTP code to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error shape, which the ``openai`` client turns into typed exceptions."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
            503: "ServiceUnavailableError"}.get(status, "Error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    explicit_max: bool  # the client set max_tokens: finish_reason "length" rather than "stop"
    stream: bool
    include_usage: bool
    ignore_eos: bool
    blocks: tuple[int, ...] = ()  # the prompt's hashed KV blocks, for the prefix cache
    # vLLM's disaggregated serving (NixlConnector): the body's kv_transfer_params
    kv_transfer: dict[str, Any] | None = None


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / 4)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # multi-part content: count the text parts
        return sum(len(p.get("text", "")) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text", ""), str))
    return 0


def estimate_chat_tokens(messages: list[Any]) -> int:
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            raise RequestError(400, "each message must be an object", "messages")
        total += math.ceil(_content_chars(m.get("content")) / 4) + 3
    return max(1, total)


def estimate_prompt_tokens(prompt: Any) -> int:
    """Completions ``prompt``: a string, a list of strings, token ids, or lists of ids."""
    if isinstance(prompt, str):
        return max(1, _text_tokens(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        if all(isinstance(x, str) for x in prompt):
            return max(1, sum(_text_tokens(x) for x in prompt))
        if all(isinstance(x, list) for x in prompt):
            return max(1, sum(len(x) for x in prompt))
    raise RequestError(400, "prompt must be a string, a list of strings or token ids", "prompt")


def parse_request(raw: bytes, chat: bool, models: tuple[str, ...],
                  default_max_tokens: int) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model", models[0])
    if not isinstance(model, str):
        raise RequestError(400, "model must be a string", "model")
    if model not in models:
        raise RequestError(404, f"The model `{model}` does not exist.", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list", "messages")
        prompt_tokens = estimate_chat_tokens(messages)
        blocks = text_blocks(chat_text(messages), BLOCK_CHARS)
        max_raw = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        if "prompt" not in body:
            raise RequestError(400, "prompt is required", "prompt")
        prompt_tokens = estimate_prompt_tokens(body["prompt"])
        blocks = prompt_blocks(body["prompt"], BLOCK_CHARS)
        max_raw = body.get("max_tokens")
    explicit = max_raw is not None
    if max_raw is None:
        max_tokens = default_max_tokens
    elif isinstance(max_raw, int) and not isinstance(max_raw, bool) and max_raw >= 1:
        max_tokens = max_raw
    else:
        raise RequestError(400, f"max_tokens must be an integer >= 1, got {max_raw!r}", "max_tokens")
    stream = body.get("stream", False) is True
    opts = body.get("stream_options")
    include_usage = stream and isinstance(opts, dict) and opts.get("include_usage") is True
    ignore_eos = body.get("ignore_eos", False) is True
    if "bootstrap_room" in body or "bootstrap_host" in body:
        raise RequestError(400, "SGLang's disaggregated serving (bootstrap_host, "
                           "bootstrap_room) is not emulated: send vLLM's kv_transfer_params",
                           "bootstrap_room")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise RequestError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    return ParsedRequest(chat, model, prompt_tokens, max_tokens, explicit, stream, include_usage,
                         ignore_eos, blocks, kv)


class ChunkTemplate:
    """The SSE events of one streamed response, encoded once.

    ``token`` is the event of one generated token; ``head`` precedes the
    first one (chat: the assistant role delta, as vLLM sends it); ``tail``
    builds the closing events once the finish reason and usage are known.
    """

    __slots__ = ("_created", "_id", "_model", "_object", "chat", "head", "token")

    def __init__(self, req: ParsedRequest) -> None:
        self.chat = req.chat
        self._id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self._created = int(time.time())
        self._model = req.model
        self._object = "chat.completion.chunk" if req.chat else "text_completion"
        if req.chat:
            self.token = self._event([{"index": 0, "delta": {"content": TOKEN_TEXT},
                                       "logprobs": None, "finish_reason": None}])
            self.head = self._event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
        else:
            self.token = self._event([{"index": 0, "text": TOKEN_TEXT, "logprobs": None,
                                       "finish_reason": None}])
            self.head = b""

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        doc: dict[str, Any] = {"id": self._id, "object": self._object, "created": self._created,
                               "model": self._model, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def tail(self, finish_reason: str, usage: dict[str, Any] | None) -> bytes:
        if self.chat:
            last = self._event([{"index": 0, "delta": {}, "logprobs": None,
                                 "finish_reason": finish_reason}])
        else:
            last = self._event([{"index": 0, "text": "", "logprobs": None,
                                 "finish_reason": finish_reason}])
        if usage is not None:
            last += self._event([], usage)
        return last + DONE

    @staticmethod
    def error_event(message: str, status: int = 500) -> bytes:
        return (b"data: " + json.dumps({"error": {"message": message, "type": "InternalServerError",
                                                   "code": status}}).encode() + b"\n\n")


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's usage object; with prefix caching, ``prompt_tokens_details.cached_tokens``."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def full_response(req: ParsedRequest, tokens: int, finish_reason: str,
                  cached_tokens: int | None = None,
                  kv_transfer_params: dict[str, Any] | None = None) -> bytes:
    """The non-streaming body of a finished request (a prefill leg's with the
    top-level ``kv_transfer_params`` its decode side needs)."""
    text = TOKEN_TEXT * tokens
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
        rid, obj = "chatcmpl-" + uuid.uuid4().hex, "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        rid, obj = "cmpl-" + uuid.uuid4().hex, "text_completion"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()),
                            "model": req.model, "choices": [choice],
                            "usage": usage(req.prompt_tokens, tokens, cached_tokens)}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return json.dumps(body, separators=(",", ":")).encode()


def models_body(models: tuple[str, ...], max_model_len: int) -> bytes:
    created = int(time.time())
    return json.dumps({"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "tailguard-emulator",
         "max_model_len": max_model_len} for m in models]}).encode()
