"""What a node has measurably delivered: its learned slowdowns over the roofline
prior, its class's, and the latency estimates observers read."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from tailguard.core.estimate import CapacityEstimate, Ewma, PeakEwma

# A node's own decode speed counts for the router (decode_excess) after this many
# samples, where it is slower than its class's by more than OWN_MARGIN (a node's
# own estimate moves by about 4% with its sample noise; identical SKUs differ by
# ~8%, SC'22).
OWN_SAMPLES = 8
OWN_MARGIN = 1.2


class Speed:
    """The node's learned speed (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ("capacity", "class_decode_slowdown", "class_prefill_slowdown", "decode_excess",
              "latency", "peers_prefill_slowdown", "presumed_cache_hits", "tpot", "ttft")

    capacity: CapacityEstimate  # the node's own slowdowns (the learner's samples)
    # The GPU class's learned slowdowns (geometric mean over its nodes), which is
    # what the router uses; refreshed at each tick.
    class_decode_slowdown: float
    class_prefill_slowdown: float
    # The node's own learned decode slowdown over its class's where the node is
    # clearly the slower (by OWN_MARGIN, after OWN_SAMPLES samples), else 1.0:
    # what the router's TPOT check multiplies by. A card 1.4x slow for its class
    # is below what the detector flags; not where the two differ by noise, or
    # the check would move load from one of two identical cards to the other.
    decode_excess: float
    # The prefill slowdown of the class's others (its healthy ones; the class's
    # where the node is alone or not healthy): what the outlier detector prices
    # the prompt chunks in the node's decode at once its TTFT reads slow, so that
    # its own slowness does not, through the class's mean, excuse itself.
    peers_prefill_slowdown: float
    latency: PeakEwma
    ttft: Ewma
    tpot: Ewma
    # First tokens too fast for the node's speed with no cached-token count from
    # the engine: taken for prefix-cache hits, not learnt from.
    presumed_cache_hits: int

    def _init_speed(self) -> None:
        self.capacity = CapacityEstimate()
        self.class_decode_slowdown = 1.0
        self.class_prefill_slowdown = 1.0
        self.decode_excess = 1.0
        self.peers_prefill_slowdown = 1.0
        self.latency = PeakEwma(tau=10.0)
        self.ttft = Ewma(tau=10.0)
        self.tpot = Ewma(tau=10.0)
        self.presumed_cache_hits = 0

    def set_class_speed(self, decode: float, prefill: float, excess: float,
                        peers_prefill: float | None = None) -> None:
        """The class's slowdowns, the node's own decode excess over them, and its
        peers' prefill slowdown (None: the class's), each tick."""
        self.class_decode_slowdown = decode
        self.class_prefill_slowdown = prefill
        self.decode_excess = excess
        self.peers_prefill_slowdown = prefill if peers_prefill is None else peers_prefill

    def presumed_cache_hit(self) -> None:
        """A first token taken for a prefix-cache hit (nothing learnt from it)."""
        self.presumed_cache_hits += 1
