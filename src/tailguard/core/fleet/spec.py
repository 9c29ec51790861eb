"""A node's static description (:class:`NodeSpec`), how a request ended
(:class:`Outcome`) and the classic balancer's static weights."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from tailguard.core.hardware import GPU
from tailguard.core.kv_transfer import Link
from tailguard.core.pipeline import Layout

ROLES = ("both", "prefill", "decode")


class Outcome(enum.Enum):
    """How a request ended, tagged by where the failure came from."""

    OK = "ok"
    CONNECT_FAILURE = "connect_failure"
    TIMEOUT = "timeout"
    UPSTREAM_5XX = "upstream_5xx"
    UPSTREAM_429 = "upstream_429"
    CLIENT_CANCELLED = "client_cancelled"
    # The engine refused the request itself (a 4xx other than 429: bad
    # parameters, context too long): says nothing about the node's health or
    # speed, so nothing is learned from it.
    CLIENT_ERROR = "client_error"

    @property
    def is_node_failure(self) -> bool:
        """Failures that say something about the node (not the client)."""
        return self in (Outcome.CONNECT_FAILURE, Outcome.TIMEOUT, Outcome.UPSTREAM_5XX)


# Static weights of the classic heterogeneous balancer (``seed_weighted``).
SEED_WEIGHTS: Mapping[str, float] = {"H100": 1.0, "A100": 0.8, "T4": 0.2}
SEED_DEFAULT_WEIGHT = 0.5


def seed_weight(gpu_name: str) -> float:
    """The baseline's weight by GPU class: H100 1.0, A100 0.8, T4 0.2, else 0.5."""
    upper = gpu_name.upper()
    for prefix, w in SEED_WEIGHTS.items():
        if upper.startswith(prefix) or f" {prefix}" in upper:
            return w
    return SEED_DEFAULT_WEIGHT


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Static description of one engine replica (``tp`` GPUs serving together)."""

    id: str
    gpu: GPU | None  # None: a GPU the catalog does not know
    gpu_name: str
    tp: int = 1
    models: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    weight: float | None = None  # declared weight, overrides the GPU prior
    url: str | None = None
    max_num_seqs: int = 256
    # A pipeline-parallel replica's stages (core/pipeline.py); None: one stage,
    # ``tp`` GPUs of ``gpu``.
    layout: Layout | None = None
    # Disaggregated serving: ``prefill`` computes prompts for other nodes to
    # decode, ``decode`` decodes prompts computed elsewhere (and may compute one
    # itself, as a fallback or where that finishes sooner), ``both`` does both.
    role: str = "both"
    kv_link: Link | None = None  # its own KV path (its NIC), over the pool's default

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")

    @property
    def prefills(self) -> bool:
        """Computes prompts for other nodes' decodes (role prefill or both)."""
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        """Streams answers (role decode or both)."""
        return self.role != "prefill"

    @property
    def gpu_class(self) -> str:
        """What the node is compared with: its GPU, or its pipeline's layout."""
        if self.layout is not None:
            return self.layout.name
        return self.gpu.name if self.gpu else self.gpu_name
