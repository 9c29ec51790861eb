"""Moving a prompt's KV cache from a prefill instance to a decode instance.

In disaggregated serving (DistServe, Splitwise, Mooncake; vLLM's P/D over
NIXL) a prompt is computed on one engine and decoded on another, and the
prompt's KV cache crosses the link between them before the decode side can
start. The time that takes is

    transfer_s = setup_s + tokens * kv_bytes_per_token / bandwidth

with ``kv_bytes_per_token = 2 (K and V) x layers x KV heads x head dim x dtype
bytes`` (:attr:`~tailguard.core.hardware.Model.kv_bytes_per_token`), summed over
the replica's ranks, and ``setup_s`` the fixed cost of one transfer (the
handshake and block lists a connector exchanges before the bytes move).

Worked example: Llama-3.1-8B keeps 128 KiB per token (32 layers x 8 KV heads x
128 x 2 x 2 bytes), so the Mooncake conversation trace's mean prompt of 12,035
tokens is 1.58 GB; Mooncake's transfer engine moves 87 GB/s over 4x200 Gb/s
RoCE (FAST'25), so the transfer takes 18 ms plus setup, about 0.4% of the
five seconds the prompt's TTFT SLO allows. At a TCP rate of 40 GB/s it takes
40 ms; over one 25 Gb/s NIC (3.1 GB/s) half a second.

A link is what a pair of nodes achieves between them. :class:`LinkMap` names
it for every pair: a pair's own link where one is given, else the slower of
the two nodes' links (a node's NIC: its own, or the fleet's default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True, slots=True)
class Link:
    """The KV path between two nodes: achieved bandwidth (GB/s) and the fixed
    cost of one transfer (seconds)."""

    gb_per_s: float
    setup_s: float = 0.001

    def __post_init__(self) -> None:
        if not self.gb_per_s > 0.0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.gb_per_s}")
        if self.setup_s < 0.0:
            raise ValueError(f"link setup must be >= 0 s, got {self.setup_s}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link."""
        return self.setup_s + nbytes / (self.gb_per_s * GB)

    def slower(self, other: Link) -> Link:
        """The path through both: the lower bandwidth, the larger setup."""
        return Link(min(self.gb_per_s, other.gb_per_s), max(self.setup_s, other.setup_s))


# Named links, achieved rates. Mooncake's transfer engine (FAST'25, facts.md):
# 87 GB/s on 4x200 Gb/s RoCE, 190 GB/s on 8x400 Gb/s, TCP about 36-41 GB/s.
# NVLink 4 (H100 SXM datasheet): 450 GB/s each way, for two replicas on one host.
LINKS: Mapping[str, Link] = {
    "nvlink": Link(450.0, 0.0005),
    "rdma-8x400": Link(190.0),
    "rdma-4x200": Link(87.0),
    "tcp": Link(40.0, 0.002),
}
DEFAULT_LINK = LINKS["rdma-4x200"]


def kv_transfer_s(kv_bytes_per_token: float, tokens: int, link: Link) -> float:
    """Seconds to move ``tokens`` tokens of KV over ``link``; 0 for none."""
    if tokens <= 0:
        return 0.0
    return link.transfer_s(tokens * kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class PairLink:
    """The link between two named nodes, over their own."""

    a: str
    b: str
    link: Link


@dataclass(frozen=True, slots=True)
class LinkMap:
    """The link of every pair of nodes: ``pairs`` (unordered) first, else the
    slower of the two nodes' links (``nodes``, or ``default`` for a node without
    one of its own). A node needs no link to itself."""

    default: Link = DEFAULT_LINK
    nodes: Mapping[str, Link] = field(default_factory=dict)
    pairs: Mapping[frozenset[str], Link] = field(default_factory=dict)
    # (from, to) -> how many times slower than its link the detector found a
    # pair's transfers (core/outliers/links.py); the map prices them so.
    slowness: dict[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def of(cls, default: Link, nodes: Mapping[str, Link | None],
           pairs: tuple[PairLink, ...] = (),
           slowness: dict[tuple[str, str], float] | None = None) -> LinkMap:
        """The map of a pool: its default, its nodes' own links, its pairs', and the
        measured slowness of pairs (shared, not copied)."""
        return cls(default, {k: v for k, v in nodes.items() if v is not None},
                   {frozenset((p.a, p.b)): p.link for p in pairs},
                   slowness if slowness is not None else {})

    def between(self, a: str, b: str) -> Link | None:
        """The link from ``a`` to ``b``; None when they are one node."""
        if a == b:
            return None
        pair = self.pairs.get(frozenset((a, b)))
        if pair is not None:
            return pair
        la, lb = self.nodes.get(a), self.nodes.get(b)
        if la is None and lb is None:
            return self.default
        return (la or self.default).slower(lb or self.default)

    def transfer_s(self, a: str, b: str, kv_bytes_per_token: float, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV from ``a`` to ``b`` (at the pair's
        measured slowness, where it has one)."""
        link = self.between(a, b)
        if link is None:
            return 0.0
        t = kv_transfer_s(kv_bytes_per_token, tokens, link)
        slow = self.slowness.get((a, b)) if self.slowness else None
        return t if slow is None else link.setup_s + (t - link.setup_s) * slow

    def nominal_s(self, a: str, b: str, kv_bytes_per_token: float, tokens: int) -> float:
        """:meth:`transfer_s` at the link's own rate, whatever was measured."""
        link = self.between(a, b)
        return 0.0 if link is None else kv_transfer_s(kv_bytes_per_token, tokens, link)
