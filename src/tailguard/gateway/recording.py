"""``tailguard serve --record FILE``: the balancer's inputs and decisions as JSON lines.

Each record (see :mod:`tailguard.core.record`) is one line, written through a
buffered file as it happens: a few microseconds per request, flushed every
``flush_every`` records and at shutdown. ``tailguard replay FILE`` feeds the
same inputs to a fresh balancer and reports every decision that differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any


class DecisionFile:
    """A recorder for :class:`~tailguard.core.balancer.Balancer` writing JSONL."""

    def __init__(self, path: str | Path, flush_every: int = 256) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = self.path.open("w", buffering=1 << 16)
        self._flush_every = flush_every
        self._count = 0

    def __call__(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._count += 1
        if self._count % self._flush_every == 0:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_decisions(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
