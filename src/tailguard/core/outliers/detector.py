"""The detector's periodic work: intervals, verdicts and the quarantine lifecycle."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from random import Random

from tailguard.core.events import Event
from tailguard.core.fleet import Actor, Node, NodeState
from tailguard.core.outliers.config import PoolView
from tailguard.core.outliers.evidence import CLEAN_RISE, Evidence, NodeHealth, Verdict
from tailguard.core.outliers.intake import SampleIntake

# A class of one's clean prefill speed (the price of the prompt chunks in its
# decode pieces, SampleIntake.judged_prefill_slowdown) rises at most CLEAN_RISE
# per clean interval. A prompt mix that makes the node's roofline 1.5x too fast
# for its prompts reads, on a piece 70% prompt chunks, log(0.3 + 0.7 x 1.5) = 0.30
# before the share weighting (on_decode) and 0.09 after, under the CUSUM's
# allowance (0.30 at slow_ratio 1.5): it is followed within five intervals and
# never read as the node's slowness; a throttle's 2x on both phases is not.


class OutlierDetector(SampleIntake):
    """Consumes per-request samples and outcomes; ``tick`` moves nodes through the lifecycle."""

    # -- periodic work -----------------------------------------------------------

    def tick(self, now: float, nodes: Mapping[str, Node], pools: Iterable[PoolView],
             rng: Random) -> list[Event]:
        cfg = self.config
        events: list[Event] = []
        pool_list = list(pools)
        self._peers(nodes)
        self._allowance = 0.75 * math.log(cfg.slow_ratio)
        self._flush_decode(nodes, now)
        if not self.authority:
            self._follow(now, nodes)
            return events
        for node in nodes.values():
            h = self._rec(node, now)
            self._observe_state(node, h, now)
            if node.state is NodeState.QUARANTINED and now >= h.eject_until:
                self._to_probation(node, h, now, pool_list, events)
            elif node.state is NodeState.PROBATION:
                ramp = min(1.0, (now - h.probation_since) / max(cfg.slow_start_s, 1e-9))
                node.reweigh(cfg.canary_weight + (1.0 - cfg.canary_weight) * ramp)
                if ramp >= 1.0:
                    self._set(node, h, NodeState.HEALTHY, now, pool_list, events,
                              "probation passed")
            if node.state.routable:
                reason = self._failure_reason(node, h, now)
                if reason is not None:
                    self._eject(node, h, now, pool_list, rng, events, reason)
                elif node.state is NodeState.HEALTHY and h.decode.cusum >= cfg.evidence:
                    self._sure(node, h, now, pool_list, events)
        if now >= self._next_eval:
            if self._next_eval >= 0.0:
                self._evaluate(now, nodes, pool_list, rng, events)
                self._interval += 1
            self._next_eval = now + cfg.interval_s
        self._refresh_references()
        return events

    def _refresh_references(self) -> None:
        """Each class's healthy, unflagged records: whose levels are references."""
        self._references = {
            gpu: [(n, h) for n, h in members
                  if n.state is NodeState.HEALTHY and not h.flagged_streak]
            for gpu, members in self._classes.items()}

    def _follow(self, now: float, nodes: Mapping[str, Node]) -> None:
        """A follower's tick: intervals close and histories learn; states are the leader's."""
        for node in nodes.values():
            self._observe_state(node, self._rec(node, now), now)
        self._refresh_references()
        if now < self._next_eval:
            return
        if self._next_eval >= 0.0:
            verdicts = self.verdicts(nodes)
            for node in nodes.values():
                h = self.health[node.id]
                v = verdicts.get(node.id)
                self._push_window(node, h)
                if v is not None:
                    h.slowness = v.slowness
                self._close_interval(node, h, v)
            self._interval += 1
        self._next_eval = now + self.config.interval_s

    def adopt(self, node: Node, state: NodeState, weight_scale: float, ejections: int,
              eject_in_s: float, reason: str, now: float, pools: Iterable[PoolView],
              events: list[Event]) -> None:
        """The leading replica's decision about ``node``: taken as this detector's own.

        A follower that later leads (its leader gone) carries on from it:
        the quarantine ends when the leader's would, and a node ejected
        again backs off from the leader's count.

        A decision is held to the rules this detector keeps itself, so that a
        buggy or forged leader cannot take more out than the detector would: a
        quarantine past the pools' ``max_ejection_share`` is taken as a
        degradation, and a routable node's weight stays within
        ``[min_weight, 1]``.
        """
        h = self._rec(node, now)
        self._observe_state(node, h, now)
        pools = list(pools)
        if state is NodeState.QUARANTINED and node.state is not NodeState.QUARANTINED \
                and not self._cap_allows(node, pools):
            state, eject_in_s = NodeState.DEGRADED, 0.0
            reason = f"{reason}; not quarantined: max ejection share reached"
        if state.routable:
            weight_scale = min(1.0, max(self.config.min_weight, weight_scale))
        h.ejections = ejections
        h.eject_until = now + eject_in_s if state is NodeState.QUARANTINED else math.inf
        node.reweigh(weight_scale)
        if state is not node.state:
            if state is NodeState.PROBATION:
                h.probation_since = now
            self._set(node, h, state, now, list(pools), events, reason, Actor.LEADER)
            node.reweigh(weight_scale)

    def decision(self, node_id: str, now: float) -> tuple[int, float, str] | None:
        """What a leader publishes of a node's lifecycle: ejections, seconds left, reason."""
        h = self.health.get(node_id)
        if h is None:
            return None
        left = h.eject_until - now if h.eject_until != math.inf else 0.0
        return h.ejections, max(0.0, left), h.reason

    def _observe_state(self, node: Node, h: NodeHealth, now: float) -> None:
        """Account time per state, and notice changes made outside the detector."""
        if node.state is not h.known_state:
            self._account(h, now)
            if h.known_state is NodeState.PROBATION:
                self.on_probation -= 1
            if node.state is NodeState.PROBATION:
                self.on_probation += 1
                h.probation_since = now
            if node.state is NodeState.HEALTHY:
                # An operator (uncordon/resume) or the health checks put it back
                # (at its full weight: the transition's).
                h.flagged_streak = 0
                h.consecutive_failures = 0
                h.prefill.restart()
                h.decode.restart()
            h.known_state = node.state

    @staticmethod
    def _account(h: NodeHealth, now: float) -> None:
        key = h.known_state.value
        h.state_seconds[key] = h.state_seconds.get(key, 0.0) + (now - h.state_since)
        h.state_since = now

    def _failure_reason(self, node: Node, h: NodeHealth, now: float) -> str | None:
        cfg = self.config
        if h.consecutive_failures >= cfg.consecutive_failures:
            return f"{h.consecutive_failures} consecutive failures"
        if node.prefilling > 0:
            if h.busy_since < 0.0:
                h.busy_since = now
            waited = now - max(h.busy_since, h.last_progress)
            if waited > cfg.hang_s:
                return f"hang: {node.prefilling} requests, no token for {waited:.0f} s"
        else:
            h.busy_since = -1.0
        return None

    # -- interval evaluation -----------------------------------------------------

    def _flag(self, name: str, ev: Evidence, prefills_only: bool = False) -> tuple[float, bool, str]:
        """One kind's recent slowness, whether it is flagged, and why. A node that
        only computes prompts (role prefill) has no decode to show a milder
        slowness, and no decodes beside its prompts to blur its TTFT: its
        prefill is held to the decode bar."""
        cfg = self.config
        s = math.exp(ev.ew)
        bar = cfg.slow_ratio if name == "decode" or prefills_only else cfg.prefill_slow_ratio
        flagged = ev.cusum >= cfg.evidence and ev.run >= cfg.min_samples and s > bar
        how = "class peers" if ev.peers else "own history"
        return s, flagged, f"{name} {s:.2f}x {how} (evidence {ev.cusum:.1f} over {ev.run} samples)"

    def _stalls(self, node: Node, h: NodeHealth) -> tuple[float, bool, str] | None:
        """The node's recent stalls (Node.spans_stall) as a slowness, None without any:
        silent a share f of the last ``failure_window`` intervals, it took 1 / (1 - f)
        of its work's time, flagged as a node that slow is (at two stalls or more).
        Decode samples across a stall are left out, so this prices a node that stalls
        often: silent 2 s in every 10 reads 1.25x, below the flag; 5 s in 10, 2x."""
        cfg = self.config
        stalls, silent = h.stalled[0] if h.stalled else (0, 0.0)
        silent = node.stalled_s - silent
        if silent <= 0.0:
            return None
        stalls = node.stalls - stalls
        span = cfg.failure_window * cfg.interval_s
        share = min(silent / span, 0.9)
        s = 1.0 / (1.0 - share)
        flagged = s > cfg.slow_ratio and stalls >= cfg.min_samples
        return s, flagged, (f"stalls {s:.2f}x: silent {silent:.1f} s of the last {span:.0f} s"
                            f" in {stalls} stalls")

    def verdicts(self, nodes: Mapping[str, Node]) -> dict[str, Verdict]:
        """Slowness of every node with new evidence in the current interval, and its flag.
        Stalls may set the slowness and the flag, not the floor (what the samples agree
        on), and alone only when flagged (only clean samples make a node healthy)."""
        out: dict[str, Verdict] = {}
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is None:
                continue
            best: Verdict | None = None
            for name, ev in (("prefill", h.prefill), ("decode", h.decode)):
                if ev.n == 0:  # no new sample: no verdict
                    continue
                s, flagged, why = self._flag(name, ev, node.spec.role == "prefill")
                if best is None:
                    best = Verdict(s, flagged, why, s)
                else:
                    floor = min(s, best.floor)
                    if (flagged, s) > (best.flagged, best.slowness):
                        best = Verdict(s, flagged, why, floor)
                    else:
                        best = Verdict(best.slowness, best.flagged, best.why, floor)
            stalls = self._stalls(node, h)
            if stalls is not None and (stalls[1], stalls[0]) > (
                    (best.flagged, best.slowness) if best is not None else (False, math.inf)):
                best = Verdict(*stalls, best.floor if best is not None else stalls[0])
            if best is not None:
                out[node.id] = best
        return out

    def _evaluate(self, now: float, nodes: Mapping[str, Node], pools: list[PoolView],
                  rng: Random, events: list[Event]) -> None:
        cfg = self.config
        verdicts = self.verdicts(nodes)
        for node in nodes.values():
            h = self.health[node.id]
            v = verdicts.get(node.id)
            state = node.state
            requests, failures = self._push_window(node, h)
            if (state.routable and requests >= cfg.failure_min_requests
                    and failures >= cfg.failure_ratio * requests):
                h.window.clear()
                self._eject(node, h, now, pools, rng, events,
                            f"{failures} of {requests} requests failed")
            elif v is not None and state.routable:
                self._judge(node, h, v, now, pools, rng, events)
            elif state is NodeState.DEGRADED and not (h.prefill.n or h.decode.n):
                # No evidence either way: the weight comes back so the router tries
                # the node again, but only clean samples make it healthy (declared
                # healthy on the weight alone, a throttled node flapped).
                node.reweigh(min(1.0, node.weight_scale * cfg.regain_factor))
            self._close_interval(node, h, v)

    def _sure(self, node: Node, h: NodeHealth, now: float, pools: list[PoolView],
              events: list[Event]) -> None:
        """Degrade a healthy node at once, between intervals, on conclusive decode
        evidence (flagged at ``sure_ratio`` or slower): at a few samples a minute the
        interval's close would add up to ``interval_s`` for nothing. The only place
        that acts on one flag: it runs every tick, before any interval's verdicts."""
        s, flagged, why = self._flag("decode", h.decode)
        # ...and only once the excess outlived the requests that showed it first: a
        # stall hits every request in flight at once, and their slow TPOTs arrive
        # together as one burst; work begun after it ends runs at full speed.
        if flagged and s >= self.config.sure_ratio and h.decode.run_spread:
            h.slowness = s
            h.flagged_streak = 1
            h.clean_streak = 0
            node.reweigh(max(self.config.min_weight, 1.0 / s))
            self._set(node, h, NodeState.DEGRADED, now, pools, events, f"slow: {why}")

    def _push_window(self, node: Node, h: NodeHealth) -> tuple[int, int]:
        """The interval's outcomes into the failure window, and the node's stalls so
        far into the stall window; the failure window's totals."""
        window = self.config.failure_window
        h.window.append((h.requests, h.failures))
        if len(h.window) > window:
            h.window.popleft()
        h.stalled.append((node.stalls, node.stalled_s))
        while len(h.stalled) > window:
            h.stalled.popleft()
        return sum(r for r, _ in h.window), sum(f for _, f in h.window)

    def _close_interval(self, node: Node, h: NodeHealth, v: Verdict | None) -> None:
        """Levels decay (a clean healthy node's become its history); the next interval starts."""
        cfg = self.config
        decay = 0.5 ** (cfg.interval_s / max(cfg.level_half_life_s, 1e-9))
        clean = node.state is NodeState.HEALTHY and (v is None or not v.flagged)
        half = 0.5 * cfg.evidence
        h.prefill.close(decay, clean and h.prefill.cusum < half)
        # A node alone in its class has no reference but its own clean past: that
        # rises only with no excess under way at all. Let rise while its evidence
        # was under half the flag, a half-speed throttle's history and prefill
        # speed followed it up 1.1x an interval each, and the evidence never
        # reached the flag (a lone H100 under the Azure code shape).
        steady = h.decode.run == 0 if self.alone(node) else h.decode.cusum < half
        if clean and steady:
            # Followed down at once, up by at most CLEAN_RISE an interval: a
            # throttle's first samples are pooled into a decode window that has
            # not yet flushed when the interval closes, so "clean" may already
            # hold its first seconds, and the prefill speed learns them faster.
            pslow, last = node.class_prefill_slowdown, h.clean_prefill
            h.clean_prefill = pslow if last <= 0.0 else min(pslow, last * CLEAN_RISE)
        h.decode.close(decay, clean and steady)
        h.requests = h.failures = 0

    def _judge(self, node: Node, h: NodeHealth, v: Verdict, now: float, pools: list[PoolView],
               rng: Random, events: list[Event]) -> None:
        cfg = self.config
        h.slowness = v.slowness
        if not v.flagged:
            h.flagged_streak = 0
            h.clean_streak += 1
            if node.state is NodeState.DEGRADED:
                if h.clean_streak >= cfg.recover_intervals:
                    self._set(node, h, NodeState.HEALTHY, now, pools, events,
                              f"recovered: {v.why}")
                else:
                    node.reweigh(max(cfg.min_weight, min(1.0, 1.0 / v.slowness)))
            return
        h.clean_streak = 0
        h.flagged_streak += 1
        if node.state is NodeState.PROBATION:
            if v.floor >= cfg.quarantine_ratio:
                self._eject(node, h, now, pools, rng, events, f"slow on probation: {v.why}")
            else:
                node.reweigh(max(cfg.min_weight, 1.0 / v.slowness))
                self._set(node, h, NodeState.DEGRADED, now, pools, events,
                          f"slow on probation: {v.why}")
        elif node.state is NodeState.DEGRADED:
            node.reweigh(max(cfg.min_weight, 1.0 / v.slowness))
            if (h.flagged_streak > cfg.consecutive_intervals
                    and v.floor >= cfg.quarantine_ratio):
                self._eject(node, h, now, pools, rng, events, f"slow: {v.why}")
        elif h.flagged_streak >= cfg.consecutive_intervals:
            node.reweigh(max(cfg.min_weight, 1.0 / v.slowness))
            self._set(node, h, NodeState.DEGRADED, now, pools, events, f"slow: {v.why}")

    # -- transitions -------------------------------------------------------------

    def canary(self, nodes: Sequence[Node], rng: Random) -> str | None:
        """A probation node for this request (``canary_share`` each), or None: the policy's."""
        share = self.config.canary_share
        for node in nodes:
            if node.state is NodeState.PROBATION and rng.random() < share:
                return node.id
        return None

    def _set(self, node: Node, h: NodeHealth, state: NodeState, now: float,
             pools: list[PoolView], events: list[Event], reason: str,
             actor: Actor = Actor.DETECTOR) -> None:
        self._account(h, now)
        if node.state is NodeState.PROBATION:
            self.on_probation -= 1
        if state is NodeState.PROBATION:
            self.on_probation += 1
        node.move(state, actor)
        h.known_state = state
        h.reason = reason
        if state is NodeState.HEALTHY or state is NodeState.PROBATION:
            h.prefill.restart()
            h.decode.restart()
        if state is NodeState.HEALTHY:
            h.flagged_streak = h.clean_streak = 0
        events.append(Event(now, node.id, "state", state.value, reason))

    def _nominal_capacity(self, node: Node) -> float:
        cap = self._nominal.get(node.id)
        if cap is None:
            cap = self._nominal[node.id] = node.perf.decode_tokens_per_s(
                max(1, min(node.slots, 64)), 1024.0)
        return cap

    def _cap_allows(self, node: Node, pools: Sequence[PoolView]) -> bool:
        for pool in pools:
            if node not in pool.nodes:
                continue
            total = out = 0.0
            for n in pool.nodes:
                c = self._nominal_capacity(n)
                total += c
                if n is node or n.state is NodeState.QUARANTINED:
                    out += c
            if total > 0.0 and out > self.config.max_ejection_share * total:
                return False
        return True

    def _eject(self, node: Node, h: NodeHealth, now: float, pools: list[PoolView], rng: Random,
               events: list[Event], reason: str) -> None:
        cfg = self.config
        self.detected_ejections += 1
        h.flagged_streak = h.clean_streak = 0
        h.consecutive_failures = 0
        if not self._cap_allows(node, pools):
            node.reweigh(max(cfg.min_weight,
                             min(node.weight_scale, 1.0 / max(h.slowness, 2.0))))
            if node.state is NodeState.DEGRADED:
                events.append(Event(now, node.id, "detect", "degraded",
                                    f"{reason}; not quarantined: max ejection share reached"))
            else:
                self._set(node, h, NodeState.DEGRADED, now, pools, events,
                          f"{reason}; not quarantined: max ejection share reached")
            return
        self.enforced_ejections += 1
        h.ejections += 1
        backoff = min(cfg.base_ejection_s * 2.0 ** (h.ejections - 1), cfg.max_ejection_s)
        backoff *= 1.0 + cfg.jitter * (2.0 * rng.random() - 1.0)
        h.eject_until = now + backoff
        h.busy_since = -1.0
        self._set(node, h, NodeState.QUARANTINED, now, pools, events,
                  f"{reason}; ejection {h.ejections}, back in {backoff:.0f} s")

    def _to_probation(self, node: Node, h: NodeHealth, now: float, pools: list[PoolView],
                      events: list[Event]) -> None:
        h.eject_until = math.inf
        h.probation_since = now
        h.last_progress = now
        node.reweigh(self.config.canary_weight)
        self._set(node, h, NodeState.PROBATION, now, pools, events, "backoff over: canary")

    # -- reports -------------------------------------------------------------------

    def time_in_states(self, now: float) -> dict[str, dict[str, float]]:
        """Seconds each node spent in each state, up to ``now``."""
        out: dict[str, dict[str, float]] = {}
        for node_id, h in self.health.items():
            d = dict(h.state_seconds)
            key = h.known_state.value
            d[key] = d.get(key, 0.0) + (now - h.state_since)
            out[node_id] = d
        return out
