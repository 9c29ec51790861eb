"""The continuation's request and its events spliced into the original stream
(``adapters/splice.py``), on literal SSE bytes as vLLM and llama.cpp send them."""

from __future__ import annotations

import json

from tailguard.adapters.splice import Relayed, Rewriter, continuation_body, moved_comment


def event(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat(content: str | None, role: bool = False, finish: str | None = None,
         cid: str = "chatcmpl-1", created: int = 100, model: str = "m") -> bytes:
    delta: dict[str, object] = {"content": content}
    if role:
        delta["role"] = "assistant"
    return event({"id": cid, "created": created, "model": model, "object": "chat.completion.chunk",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_whole_events_only_reach_the_client() -> None:
    r = Relayed()
    first = chat(None, role=True) + chat("Once")
    assert r.cut(first[:-5]) == chat(None, role=True)  # a partial event waits
    assert r.cut(first[-5:] + chat(" upon")[:10]) == chat("Once")
    assert r.cut(chat(" upon")[10:]) == chat(" upon")
    so_far = r.so_far(chat=True)
    assert (so_far.text, so_far.tokens, so_far.id, so_far.created, so_far.model) == \
        ("Once upon", 2, "chatcmpl-1", 100, "m")
    assert not so_far.finished and so_far.faithful


def test_the_continuation_asks_for_the_rest() -> None:
    r = Relayed()
    r.cut(chat(None, role=True) + chat("Once") + chat(" upon"))
    doc = {"model": "m", "messages": [{"role": "user", "content": "a story"}], "max_tokens": 10,
           "stream": True, "stream_options": {"include_usage": True}}
    body = json.loads(continuation_body(doc, True, r.so_far(True)) or b"null")
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and body["stream_options"] == {"include_usage": True}
    assert "priority" not in body  # unless asked for: an engine without it would refuse it
    urgent = json.loads(continuation_body(doc, True, r.so_far(True), -1) or b"null")
    assert urgent["priority"] == -1  # migration.engine_priority
    comp = {"model": "m", "prompt": ["The sea"], "max_tokens": 5, "stream": True}
    rc = Relayed()
    rc.cut(event({"id": "cmpl-1", "choices": [{"index": 0, "text": " was"}]}))
    body = json.loads(continuation_body(comp, False, rc.so_far(False)) or b"null")
    assert body["prompt"] == "The sea was" and body["max_tokens"] == 4
    # what cannot be continued faithfully
    assert continuation_body({**comp, "prompt": [1, 2, 3]}, False, rc.so_far(False)) is None
    assert continuation_body({**doc, "n": 2}, True, r.so_far(True)) is None
    assert continuation_body({**doc, "max_tokens": 2}, True, r.so_far(True)) is None  # all sent
    tools = Relayed()
    tools.cut(event({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{}]}}]}))
    assert continuation_body(doc, True, tools.so_far(True)) is None


def test_the_continuations_events_become_the_original_streams() -> None:
    r = Relayed()
    r.cut(chat(None, role=True, cid="orig", created=7) + chat("Once") + chat(" upon"))
    rw = Rewriter(r.so_far(True))
    usage = {"id": "cont", "created": 9, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 32, "completion_tokens": 8, "total_tokens": 40}}
    raw = (chat(None, role=True, cid="cont", created=9) + chat(" a", cid="cont", created=9)
           + chat(None, cid="cont", created=9, finish="length") + event(usage)
           + b"data: [DONE]\n\n")
    out = rw.feed(raw[:37]) + rw.feed(raw[37:]) + rw.flush()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert len(objs) == 3  # the role-only delta is dropped
    assert all(o["id"] == "orig" and o["created"] == 7 for o in objs)
    assert objs[0]["choices"][0]["delta"] == {"content": " a"}
    # the whole answer: 2 tokens from the first node, 8 from the continuation; the
    # prompt is the continuation's less the 2 answer tokens it was given
    assert objs[2]["usage"] == {"prompt_tokens": 30, "completion_tokens": 10,
                                "total_tokens": 40}


def test_a_move_can_be_announced_as_a_comment() -> None:
    line = moved_comment("n1", "n2", "stall", 40)
    assert line.startswith(b": ") and line.endswith(b"\n\n") and b"n1 to n2" in line


def test_a_one_byte_chunk_without_a_boundary_waits() -> None:
    r = Relayed()
    assert r.cut(b"d") == b""
    assert r.cut(b"ata: x\n\n") == b"data: x\n\n"
    assert r.cut(b"\n") == b"" and r.flush() == b"\n"
