"""Workloads whose prompts share prefixes: multi-turn chats, tenants' system
prompts and agent loops, with the hashed blocks an engine's prefix cache keys on.

A scenario's ``workload:`` gains a ``prefix:`` section::

    workload:
      duration_s: 600
      arrival: {process: poisson, load: 0.7}   # requests (turns and steps), not sessions
      input_tokens: {dist: lognormal, mu: 5.5, sigma: 0.8, max: 4096}   # each new message
      output_tokens: {dist: azure-conv}
      prefix:
        block_tokens: 128         # tokens per hashed block (Mooncake's traces: 512)
        tenants: 16               # shared system prompts, one per tenant ...
        system_tokens: 1500       # ... of this many tokens
        zipf: 1.0                 # tenant popularity: share of tenant k ~ 1/k**zipf
        turns: 4                  # mean turns of a chat (geometric, >= 1)
        think_s: 20               # mean pause before the next turn (exponential)
        agents: 0.25              # share of sessions that are agent loops ...
        agent_steps: 8            # ... of this many steps (geometric mean) ...
        agent_think_s: 2          # ... a tool call apart ...
        tool_tokens: 300          # ... each adding a tool result of about this size
        max_context: 32000        # a session ends before a prompt would exceed this

Each session picks a tenant and starts with its system prompt. A chat's turn
sends the history (system prompt, every earlier message and answer) plus a new
message drawn from ``input_tokens``; an agent's step sends the history plus
the last step's answer and a tool result (lognormal around ``tool_tokens``,
sigma 0.5). Answers are drawn from ``output_tokens``. Sessions start as the
``arrival`` process at ``rate / mean requests per session``, so requests arrive
at about ``rate``; a turn comes ``think`` seconds after the one before (an
open-loop approximation: the pause is taken to cover the answer).

Blocks: the content of a session is a run of segments (the system prompt,
each message, answer and tool result, each with its own id; a tenant's system
prompt has the same id in every session). Every full ``block_tokens`` block
gets a hash chained over the block before it and the pieces of segments it
covers, so two prompts share block ``i``'s hash exactly when their first
``i + 1`` blocks hold the same content: vLLM's rule. A request carries the
hashes of its prompt and answer blocks; the engine looks the prompt's up and,
when the request ends, keeps both (the next turn resends that answer).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailguard.config.files import check_keys, require_mapping
from tailguard.errors import ConfigError

_HASH_MASK = (1 << 62) - 1

PREFIX_KEYS = ("block_tokens", "tenants", "system_tokens", "zipf", "turns", "think_s", "agents",
               "agent_steps", "agent_think_s", "tool_tokens", "max_context")


@dataclass(frozen=True, slots=True)
class PrefixSpec:
    """A validated ``prefix:`` section (see the module docstring)."""

    block_tokens: int = 128
    tenants: int = 16
    system_tokens: int = 1500
    zipf: float = 1.0
    turns: float = 4.0
    think_s: float = 20.0
    agents: float = 0.0
    agent_steps: float = 8.0
    agent_think_s: float = 2.0
    tool_tokens: int = 300
    max_context: int = 32000

    @property
    def requests_per_session(self) -> float:
        return (1.0 - self.agents) * self.turns + self.agents * self.agent_steps


def parse_prefix(raw: object, where: str) -> PrefixSpec:
    spec = require_mapping(raw, where)
    check_keys(spec, PREFIX_KEYS, where)
    values: dict[str, Any] = {}
    defaults = PrefixSpec()
    for key in PREFIX_KEYS:
        if key not in spec:
            continue
        v = spec[key]
        default = getattr(defaults, key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ConfigError(f"{where}.{key}", f"must be a number, got {v!r}")
        if isinstance(default, int):
            if v != int(v):
                raise ConfigError(f"{where}.{key}", f"must be a whole number, got {v!r}")
            v = int(v)
        values[key] = v
    out = PrefixSpec(**values)
    checks = (
        ("block_tokens", out.block_tokens >= 1, ">= 1"),
        ("tenants", out.tenants >= 1, ">= 1"),
        ("system_tokens", out.system_tokens >= 0, ">= 0"),
        ("zipf", out.zipf >= 0.0, ">= 0"),
        ("turns", out.turns >= 1.0, ">= 1"),
        ("think_s", out.think_s >= 0.0, ">= 0"),
        ("agents", 0.0 <= out.agents <= 1.0, "between 0 and 1"),
        ("agent_steps", out.agent_steps >= 1.0, ">= 1"),
        ("agent_think_s", out.agent_think_s >= 0.0, ">= 0"),
        ("tool_tokens", out.tool_tokens >= 1, ">= 1"),
        ("max_context", out.max_context > out.system_tokens, "> system_tokens"),
    )
    for key, ok, what in checks:
        if not ok:
            raise ConfigError(f"{where}.{key}", f"must be {what}, got {getattr(out, key)!r}")
    return out


class Chain:
    """The hashed full blocks of one session's content, built as it grows."""

    __slots__ = ("_last", "_tail", "_tail_len", "bt", "hashes")

    def __init__(self, block_tokens: int) -> None:
        self.bt = block_tokens
        self.hashes: list[int] = []
        self._tail: list[tuple[int, int, int]] = []  # (segment, from, to) in the open block
        self._tail_len = 0
        self._last = 0

    def add(self, segment: int, tokens: int) -> None:
        off = 0
        bt = self.bt
        while tokens > 0:
            take = min(tokens, bt - self._tail_len)
            self._tail.append((segment, off, off + take))
            self._tail_len += take
            off += take
            tokens -= take
            if self._tail_len == bt:
                self._last = hash((self._last, tuple(self._tail))) & _HASH_MASK
                self.hashes.append(self._last)
                self._tail = []
                self._tail_len = 0


def _geometric(rng: random.Random, mean: float) -> int:
    """A count >= 1 with the given mean (1 + geometric)."""
    if mean <= 1.0:
        return 1
    p = 1.0 / mean
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def _tenant_weights(spec: PrefixSpec) -> list[float]:
    return [1.0 / (k + 1) ** spec.zipf for k in range(spec.tenants)]


@dataclass(slots=True)
class SessionRequests:
    """Requests of a prefix workload, sorted by arrival (parallel lists)."""

    arrival_s: list[float]
    input_tokens: list[int]
    output_tokens: list[int]
    blocks: list[tuple[int, ...]]
    session: list[int]


def generate_sessions(
    spec: PrefixSpec,
    starts: list[float],
    duration: float,
    messages: Mapping[str, Any],
    rng: random.Random,
) -> SessionRequests:
    """One session per start time; ``messages`` holds the ``input_tokens`` and
    ``output_tokens`` length distributions (``LengthDist``)."""
    msg_dist = messages["input_tokens"]
    out_dist = messages["output_tokens"]
    weights = _tenant_weights(spec)
    tenants = list(range(spec.tenants))
    rows: list[tuple[float, int, int, tuple[int, ...], int]] = []
    seg = 0
    for sid, t0 in enumerate(starts):
        tenant = rng.choices(tenants, weights)[0]
        agent = rng.random() < spec.agents
        n = _geometric(rng, spec.agent_steps if agent else spec.turns)
        think = spec.agent_think_s if agent else spec.think_s
        chain = Chain(spec.block_tokens)
        chain.add(-(tenant + 1), spec.system_tokens)
        context = spec.system_tokens
        t = t0
        for i in range(n):
            if i and think > 0.0:
                t += rng.expovariate(1.0 / think)
            if t >= duration:
                break
            if agent and i:
                new = max(1, int(rng.lognormvariate(math.log(spec.tool_tokens), 0.5)))
            else:
                new = msg_dist.sample(rng)
            out = out_dist.sample(rng)
            if context + new + out > spec.max_context:
                break
            seg += 1
            chain.add(seg, new)
            prompt = context + new
            seg += 1
            chain.add(seg, out)
            context = prompt + out
            rows.append((t, prompt, out, tuple(chain.hashes), sid))
    rows.sort(key=lambda r: r[0])
    return SessionRequests(
        [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
        [r[3] for r in rows], [r[4] for r in rows],
    )


__all__ = ["PREFIX_KEYS", "Chain", "PrefixSpec", "SessionRequests", "generate_sessions",
           "parse_prefix"]
