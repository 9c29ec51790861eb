"""Request lists and trace files: what the simulator replays.

:class:`Requests` is a workload once drawn (parallel lists sorted by arrival).
:func:`read_trace` reads tailguard's JSONL traces, Mooncake's FAST'25 traces
(with prompt block hashes) and a gateway's ``--record`` file;
:func:`write_trace` writes tailguard's format back exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailguard.errors import ConfigError
from tailguard.traffic.lengths import TOKEN_CAP


@dataclass(frozen=True, slots=True)
class Requests:
    """Parallel lists, one entry per request, sorted by arrival time.

    With shared prefixes, ``blocks[i]`` holds the hashes of request ``i``'s full
    ``block_tokens``-token blocks (prompt, then answer where known) and
    ``session[i]`` its session (a key for session affinity).
    """

    arrival_s: list[float]
    input_tokens: list[int]
    output_tokens: list[int]
    blocks: list[tuple[int, ...]] | None = None
    block_tokens: int = 0
    session: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_tokens) != n or len(self.output_tokens) != n:
            raise ValueError(
                f"parallel lists differ in length: {n}, "
                f"{len(self.input_tokens)}, {len(self.output_tokens)}"
            )
        for extra in (self.blocks, self.session):
            if extra is not None and len(extra) != n:
                raise ValueError(f"parallel lists differ in length: {n}, {len(extra)}")
        if self.blocks is not None and self.block_tokens < 1:
            raise ValueError("blocks need block_tokens >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)


def write_trace(path: str | Path, requests: Requests) -> None:
    """Write one JSON object a line: ``{"t", "input_tokens", "output_tokens"}``.

    Times are written with full float precision, so :func:`read_trace` gives
    back exactly the same requests.
    """
    with Path(path).open("w", encoding="utf-8") as out:
        for t, n_in, n_out in zip(
            requests.arrival_s, requests.input_tokens, requests.output_tokens, strict=True
        ):
            out.write(json.dumps({"t": t, "input_tokens": n_in, "output_tokens": n_out}))
            out.write("\n")


# Tokens per block of the Mooncake traces' hash_ids.
MOONCAKE_BLOCK_TOKENS = 512


def _mooncake_row(row: Mapping[str, Any], at: str, where: str) -> tuple[float, int, int,
                                                                       tuple[int, ...]]:
    """A Mooncake FAST'25 trace line: ``timestamp`` (ms), ``input_length``,
    ``output_length``, ``hash_ids`` (one per 512-token block of the input)."""
    ts = row.get("timestamp")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts) or ts < 0:
        raise ConfigError(where, f"{at}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    counts = _row_counts(row, ("input_length", "output_length"), at, where)
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                            for h in ids):
        raise ConfigError(where, f"{at}: 'hash_ids' must be a list of integers")
    return float(ts) / 1000.0, counts[0], counts[1], tuple(ids)


def _row_counts(row: Mapping[str, Any], keys: tuple[str, str], at: str,
                where: str) -> list[int]:
    """A trace line's two token counts, each an integer in ``[1, TOKEN_CAP]``."""
    counts: list[int] = []
    for key in keys:
        n = row.get(key)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= TOKEN_CAP:
            raise ConfigError(where, f"{at}: {key!r} must be an integer >= 1, got {n!r}")
        counts.append(n)
    return counts


def read_trace(path: str | Path, where: str = "trace") -> Requests:
    """Read a JSONL trace, sorted by time (stable for equal times).

    Two formats: tailguard's (``t`` in seconds, ``input_tokens``,
    ``output_tokens``) and Mooncake's FAST'25 release (``timestamp`` in ms,
    ``input_length``, ``output_length``, ``hash_ids`` of 512-token prompt
    blocks, which the engines' prefix caches key on). Blank lines are skipped
    and unknown keys ignored. A bad line raises a :class:`ConfigError` on
    ``where`` that names the file and line.
    """
    file = Path(path)
    rows: list[tuple[float, int, int]] = []
    hashed: list[tuple[float, int, int, tuple[int, ...]]] = []
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(where, f"cannot read trace {file}: {exc.strerror or exc}") from exc
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{file}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(where, f"{at}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ConfigError(where, f"{at}: expected an object, got {type(row).__name__}")
        if "op" in row:  # a gateway's decision recording, not a trace
            return requests_from_recording(text, where, file)
        if "timestamp" in row:
            hashed.append(_mooncake_row(row, at, where))
            continue
        t = row.get("t")
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0.0:
            raise ConfigError(where, f"{at}: 't' must be a finite number >= 0, got {t!r}")
        counts = _row_counts(row, ("input_tokens", "output_tokens"), at, where)
        rows.append((float(t), counts[0], counts[1]))
    if hashed:
        if rows:
            raise ConfigError(where, f"{file}: mixes Mooncake lines (timestamp) with t lines")
        hashed.sort(key=lambda r: r[0])
        return Requests([r[0] for r in hashed], [r[1] for r in hashed], [r[2] for r in hashed],
                        blocks=[r[3] for r in hashed], block_tokens=MOONCAKE_BLOCK_TOKENS,
                        session=[r[3][0] if r[3] else -1 for r in hashed])
    rows.sort(key=lambda r: r[0])
    return Requests([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def requests_from_recording(text: str, where: str, file: Path) -> Requests:
    """The requests a live gateway saw, from its ``--record`` file.

    Each first attempt (a ``pick`` or an ``admit`` without excluded nodes,
    admitted, queued or shed alike) is one arrival, at its time relative to the
    first one, with its prompt length; its answer length is what the finish
    of its ticket (for a queued request: the ticket ``poll_queue`` dispatched
    it with) reported when it succeeded, else its ``max_tokens``, else the
    median of the successful answers.
    """
    # t, prompt, max_tokens, ticket, waiter
    picks: list[tuple[float, int, int | None, int | None, int | None]] = []
    outputs: dict[int, int] = {}
    dispatched: dict[int, int] = {}  # waiter -> ticket
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(where, f"{file}:{lineno}: not JSON ({exc.msg})") from exc
        op = rec.get("op")
        if op == "pick" and not rec.get("exclude"):
            picks.append((float(rec["t"]), int(rec["prompt_tokens"]), rec.get("max_tokens"),
                          rec.get("ticket"), None))
        elif op == "admit" and not rec.get("exclude"):
            result = rec.get("result") or {}
            picks.append((float(rec["t"]), int(rec["prompt_tokens"]), rec.get("max_tokens"),
                          result.get("ticket"), result.get("queued")))
        elif op == "poll_queue":
            for d in rec.get("decisions", ()):
                if "ticket" in d:
                    dispatched[int(d["waiter"])] = int(d["ticket"])
        elif op == "finish" and rec.get("outcome") == "ok" and rec.get("output_tokens", 0) > 0:
            outputs[int(rec["ticket"])] = int(rec["output_tokens"])
    if not picks:
        raise ConfigError(where, f"{file}: the recording holds no requests")
    known = sorted(outputs.values())
    fallback = known[len(known) // 2] if known else 1
    picks.sort(key=lambda p: p[0])
    t0 = picks[0][0]
    arrivals, prompts, answers = [], [], []
    for t, prompt, max_tokens, ticket, waiter in picks:
        if ticket is None and waiter is not None:
            ticket = dispatched.get(waiter)
        arrivals.append(t - t0)
        prompts.append(max(1, prompt))
        out = outputs.get(ticket) if ticket is not None else None
        answers.append(out if out is not None else int(max_tokens or fallback))
    return Requests(arrivals, prompts, answers)


__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "Requests",
    "read_trace",
    "requests_from_recording",
    "write_trace",
]
