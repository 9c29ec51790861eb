"""The other gateway replicas' view of a node, set only by applying their reports
(:meth:`~tailguard.core.shared.Peers.merge`); zero with one gateway."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar


class PeerView:
    """What the other replicas have on the node (a part of :class:`~tailguard.core.fleet.Node`)."""

    if not TYPE_CHECKING:  # slots are the node's (mypy would take these as the part's)
        __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ("own_backlog_base", "own_in_flight_base", "remote_backlog", "remote_in_flight",
              "remote_ratio", "remote_speed")

    in_flight: int  # read from the node's load
    prefill_backlog: int
    # The others' in-flight requests and prompt backlog here, as they last published them.
    remote_in_flight: int
    remote_backlog: int
    # Between two merges the others' counts are extrapolated from this replica's
    # own change since the last one (from the ``own_*_base`` counts), times
    # remote_ratio (the others' demand over this one's): replicas that route
    # alike load a node alike, so a rush of this replica's requests to a node
    # is taken for everyone's rush, not as if the others had stopped (0: no others).
    remote_ratio: float
    own_in_flight_base: int
    own_backlog_base: int
    # The others' learned slowdowns, as (sum of decode log-ratio x weight, decode
    # weight, the same for prefill); None: no other replica knows.
    remote_speed: tuple[float, float, float, float] | None

    def _init_peers(self) -> None:
        self.remote_in_flight = self.remote_backlog = 0
        self.remote_ratio = 0.0
        self.own_in_flight_base = self.own_backlog_base = 0
        self.remote_speed = None

    def apply_peers(self, in_flight: int, backlog: int, ratio: float,
                    speed: tuple[float, float, float, float] | None) -> None:
        """The others' latest reports, summed: their load here, the others' demand over
        this replica's, and their speed estimates."""
        self.remote_in_flight = in_flight
        self.remote_backlog = backlog
        self.remote_ratio = ratio
        self.own_in_flight_base = self.in_flight
        self.own_backlog_base = self.prefill_backlog
        self.remote_speed = speed

    @property
    def fleet_in_flight(self) -> int:
        """Requests on the node from every gateway replica: this one's exact count plus the
        others' (their last report, extrapolated by this one's change since)."""
        ratio = self.remote_ratio
        if ratio == 0.0:
            return self.in_flight
        est = self.remote_in_flight + ratio * (self.in_flight - self.own_in_flight_base)
        return self.in_flight + (int(est + 0.5) if est > 0.0 else 0)

    @property
    def fleet_backlog(self) -> int:
        """Prompt tokens waiting for their first token on the node, from every replica."""
        ratio = self.remote_ratio
        if ratio == 0.0:
            return self.prefill_backlog
        est = self.remote_backlog + ratio * (self.prefill_backlog - self.own_backlog_base)
        return self.prefill_backlog + (int(est) if est > 0.0 else 0)
