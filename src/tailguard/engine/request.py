"""One request's scheduler state inside the engine model (:mod:`tailguard.engine.model`)."""

from __future__ import annotations

WAITING = 0
PREFILL = 1
DECODE = 2
GONE = 3


class Request:
    """Scheduler state of one request (internal; exposed for type hints only)."""

    __slots__ = (
        "alloc",
        "blocks",
        "bt",
        "cached",
        "epoch",
        "first_done",
        "g0",
        "gen",
        "hold",
        "nheld",
        "output",
        "priority",
        "prompt",
        "remote",
        "rid",
        "s0",
        "state",
        "target",
    )

    def __init__(
        self, rid: int, prompt: int, output: int, blocks: tuple[int, ...] = (), bt: int = 0,
        remote: bool = False, hold: bool = False, priority: int = 0,
    ) -> None:
        self.rid = rid
        self.priority = priority  # lower is admitted first (vLLM's priority scheduling)
        self.prompt = prompt
        self.output = output
        self.state = WAITING
        self.gen = 0  # tokens generated, valid while not decoding
        self.target = prompt  # tokens to prefill: prompt + tokens generated before a preemption
        self.cached = 0  # prefill tokens computed so far
        self.alloc = 0  # KV blocks held while prefilling
        self.first_done = False
        self.g0 = 0  # tokens generated when it joined the decode batch
        self.s0 = 0  # engine step counter when it joined the decode batch
        self.epoch = 0  # identifies its current stay in the decode batch (heap validity)
        self.blocks = blocks  # hashes of its full blocks of prompt + answer (bt tokens each)
        self.bt = bt
        self.nheld = 0  # leading blocks it holds a reference on in the prefix cache
        # Disaggregated serving: its prompt's KV came from a prefill instance (all but
        # the last token counts as computed, until a preemption drops it) ...
        self.remote = remote
        # ... or, on a prefill instance, its KV stays held after it ends until the
        # decode side has taken it (Engine.release_kv).
        self.hold = hold


def blocks_for(tokens: int, bs: int) -> int:
    """KV blocks of ``bs`` tokens that ``tokens`` tokens fill (rounded up)."""
    return -(-tokens // bs)
