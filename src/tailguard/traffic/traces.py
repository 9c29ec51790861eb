"""Request lists and trace files: what the simulator replays.

:class:`Requests` is a workload once drawn (parallel lists sorted by arrival).
:func:`read_trace` reads, detecting the format from the file itself:

* tailguard's JSONL (``t`` in seconds, ``input_tokens``, ``output_tokens``);
* Mooncake's FAST'25 release (JSONL: ``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token prompt blocks);
* a gateway's ``--record`` file (JSONL of balancer inputs);
* the Azure LLM inference traces, 2023 and 2024 releases (CSV:
  ``TIMESTAMP,ContextTokens,GeneratedTokens``, the timestamp a date and time
  with up to 7 decimals of a second), as the Splitwise and DynamoLLM papers
  published them;
* BurstGPT (CSV: ``Timestamp,Model,Request tokens,Response tokens,Total
  tokens,Log Type``, the timestamp in seconds).

Times start at the first request's. :func:`write_trace` writes tailguard's
format back exactly.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
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


def window(requests: Requests, start_s: float) -> Requests:
    """The requests from ``start_s`` on, their times counted from it."""
    if start_s <= 0.0:
        return requests
    first = next((i for i, t in enumerate(requests.arrival_s) if t >= start_s),
                 len(requests.arrival_s))
    return Requests([t - start_s for t in requests.arrival_s[first:]],
                    requests.input_tokens[first:], requests.output_tokens[first:],
                    requests.blocks[first:] if requests.blocks is not None else None,
                    requests.block_tokens,
                    requests.session[first:] if requests.session is not None else None)


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


# CSV formats: their header's columns for (time, prompt tokens, answer tokens).
CSV_FORMATS: dict[str, tuple[str, str, str]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}


def read_trace(path: str | Path, where: str = "trace") -> Requests:
    """Read a trace in any of the module docstring's formats, sorted by time (stable
    for equal times). Blank lines are skipped and unknown keys or columns ignored.
    A bad line raises a :class:`ConfigError` on ``where`` that names the file, the
    line and, in a CSV, the column."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(where, f"cannot read trace {file}: {reason or exc}") from exc
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first and not first.startswith("{"):
        return _read_csv(text, file, where)
    return _read_jsonl(text, file, where)


def _read_csv(text: str, file: Path, where: str) -> Requests:
    reader = csv.reader(line for line in text.splitlines() if line.strip())
    header = [h.strip() for h in next(reader)]
    found = next(((name, columns) for name, columns in CSV_FORMATS.items()
                  if all(c in header for c in columns)), None)
    if found is None:
        known = "; ".join(f"{k}: {', '.join(v)}" for k, v in CSV_FORMATS.items())
        raise ConfigError(where, f"{file}:1: not a trace format tailguard reads (JSONL with "
                                 f"t or timestamp, or CSV with the columns of {known})")
    name, columns = found
    cols = [header.index(c) for c in columns]
    rows: list[tuple[float, int, int]] = []
    for lineno, record in enumerate(reader, start=2):
        at = f"{file}:{lineno}"
        if len(record) < len(header):
            raise ConfigError(where, f"{at}: {len(record)} columns, the header has "
                                     f"{len(header)}")
        stamp = record[cols[0]].strip()
        t = _azure_time(stamp) if name == "azure" else _number(stamp)
        if t is None or not math.isfinite(t) or (name != "azure" and t < 0.0):
            raise ConfigError(where, f"{at}: column {header[cols[0]]!r}: not a time: "
                                     f"{stamp[:40]!r}")
        counts = []
        for c in cols[1:]:
            value = _number(record[c].strip())
            if value is None or value < 0 or value != int(value):
                raise ConfigError(where, f"{at}: column {header[c]!r}: not a token count: "
                                         f"{record[c][:40]!r}")
            # A logged failure has no answer (0 tokens): replayed as a one-token one.
            counts.append(min(max(1, int(value)), TOKEN_CAP))
        rows.append((t, counts[0], counts[1]))
    if not rows:
        raise ConfigError(where, f"{file}: the trace holds no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Requests([r[0] - t0 for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _azure_time(text: str) -> float | None:
    """``2023-11-16 18:15:46.6805900`` (seconds since the epoch; more than six decimals
    are cut, which datetime does not read)."""
    head, dot, frac = text.partition(".")
    try:
        stamp = datetime.fromisoformat(f"{head}.{frac[:6]}" if dot else head)
    except ValueError:
        return None
    return stamp.replace(tzinfo=UTC).timestamp()


def _read_jsonl(text: str, file: Path, where: str) -> Requests:
    rows: list[tuple[float, int, int]] = []
    hashed: list[tuple[float, int, int, tuple[int, ...]]] = []
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
    "CSV_FORMATS",
    "MOONCAKE_BLOCK_TOKENS",
    "Requests",
    "read_trace",
    "requests_from_recording",
    "window",
    "write_trace",
]
