"""The detector's sample intake: per-request samples and outcomes (O(1) each)
and the decode windows, judged against each node's references."""

from __future__ import annotations

import math
from collections.abc import Mapping

from tailguard.core.fleet import Node, NodeState, Outcome
from tailguard.core.outliers.config import OutlierConfig
from tailguard.core.outliers.evidence import (
    FRESH,
    MOSTLY_DECODE,
    QUEUED,
    REF_REUSE,
    TOKEN_BUCKETS,
    Evidence,
    NodeHealth,
    clamp,
    decode_bucket,
    first,
    median,
    prefill_bucket,
)


class SampleIntake:
    """The detector's state and its per-request side: samples, outcomes, windows.

    :class:`~tailguard.core.outliers.OutlierDetector` adds the periodic side
    (``tick``); the two are one object, split by what each half does.
    """

    def __init__(self, config: OutlierConfig | None = None) -> None:
        self.config = config or OutlierConfig()
        self.health: dict[str, NodeHealth] = {}
        self.detected_ejections = 0
        self.enforced_ejections = 0
        self._next_eval = -1.0
        self._nominal: dict[str, float] = {}
        self.on_probation = 0  # nodes on probation now: the request path checks it first
        # False on a gateway replica that follows another's decisions
        # (core/shared.py): it keeps pooling samples and learning each node's
        # history, so it can take over, but changes no state itself.
        self.authority = True
        # The records of each GPU class (a node's peers), rebuilt when nodes come or go.
        self._classes: dict[str, list[tuple[Node, NodeHealth]]] = {}
        self._classes_for = -1
        # ...and those of them healthy and not flagged, as of the last tick: the
        # nodes whose levels are references.
        self._references: dict[str, list[tuple[Node, NodeHealth]]] = {}
        self._interval = 0  # intervals closed so far: the age of a node's levels
        # The CUSUM's allowance k (per sample, so set once per tick: a reload may
        # change slow_ratio; records, and so samples, exist only after a tick).
        self._allowance = 0.75 * math.log(self.config.slow_ratio)
        self._window_t = -math.inf  # when the decode window last closed (_flush_decode)
        self._windows = 0  # decode windows closed so far
        self.stall_samples = 0  # decode samples left out: they timed a stall (on_decode)
        self.kv_short_samples = 0  # samples left out: their node was short of KV cache

    # -- per-request bookkeeping (O(1)) ----------------------------------------

    def _rec(self, node: Node, now: float) -> NodeHealth:
        h = self.health.get(node.id)
        if h is None:
            h = self.health[node.id] = NodeHealth(now, self.config)
            h.known_state = node.state
            h.stalled.append((node.stalls, node.stalled_s))
            self._classes_for = -1
        return h

    def _peers(self, nodes: Mapping[str, Node]) -> None:
        if self._classes_for == len(nodes):
            return
        classes: dict[str, list[tuple[Node, NodeHealth]]] = {}
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is not None:
                classes.setdefault(node.spec.gpu_class, []).append((node, h))
        self._classes = classes
        self._classes_for = len(nodes)

    def alone(self, node: Node) -> bool:
        """Whether ``node`` is the only one of its GPU class: its own history is then
        its only reference."""
        peers = self._classes.get(node.spec.gpu_class)
        return peers is not None and len(peers) == 1

    # Records are created by tick (every node, every tick): the request path
    # only looks them up, and drops the samples of a node not yet ticked.

    def on_progress(self, node: Node, now: float) -> None:
        """The node produced a first token (its sample may come later)."""
        h = self.health.get(node.id)
        if h is not None:
            h.last_progress = now

    def on_prefill(self, node: Node, ttft: float, expected: float, now: float,
                   tokens: int = 0, batch: int = 1, queued: bool = False) -> None:
        """A TTFT sample: ``tokens`` the engine had to compute before this first token
        (the backlog ahead plus the prompt's uncached part), ``batch`` requests on the
        node with it at dispatch (a short prompt's first token waits for the step
        that computes the others' prompts too); ``queued``: it found every engine
        slot taken and waited for one, a wait the roofline does not price."""
        h = self.health.get(node.id)
        if h is not None:
            h.last_progress = now
            if node.kv_short_since(now - ttft):  # see on_decode
                self.kv_short_samples += 1
                return
            b = prefill_bucket(tokens) + TOKEN_BUCKETS * decode_bucket(batch)
            self._sample(node, h, h.prefill, 0, b + QUEUED if queued else b, ttft, expected,
                         None)

    def on_decode(self, node: Node, tpot: float, expected: float, batch: int = 1,
                  now: float | None = None, since: float | None = None,
                  share: float = 1.0) -> None:
        """A TPOT sample seen at ``now``, over a decode that began at ``since``, where
        the decode step alone is ``share`` of the ``expected`` time per token.

        The rest is the prompt chunks the node computed between its tokens, and
        the sample counts in proportion to ``share``: an engine that spends 90%
        of its time on a long prompt's chunks gives tokens at ``step / (1 -
        duty)``, where a tenth's error in the duty the model puts on the
        window is a 2x error in the expected time (a healthy A100 computing a
        31k-token prompt read 1.6x slow). A slow node is slow between prompts
        too, where its samples count whole. A node alone in its class (no peers,
        only its own history) counts a window's whole ratio instead, and the
        share weighs the evidence it carries (:meth:`_flush_decode`): the
        proportion read a half-speed throttle of a lone H100 whose pieces were
        55-70% prompt chunks as 1.3x, under the flag; weighing the evidence, a
        large ratio in a piece of mostly mispriced chunks still moves it little.

        Where decode is judged in pieces (``segment_s``), the samples one node
        gives in one bucket within a window of ``segment_s`` are one sample,
        their mean (in log), judged at the tick that closes the window
        (:meth:`_flush_decode`): they timed the same moments of the node, the
        pieces of concurrent streams and the ends of the answers finishing
        then alike. Counted one by one, the dozens of streams of a busy node
        gave dozens of samples of each second, and a healthy card 1.2-1.3x its
        peers (the spread of identical SKUs) was degraded whenever one second
        ran a few tenths slower. A window's ``since`` is the earliest of its
        samples': its excess outlived the run's first window (``run_spread``)
        only when all the work it timed began after that window closed, which
        a throttle's third slow window does and the windows a 2 s stall
        touches do not (the work they time began before it).
        """
        h = self.health.get(node.id)
        if h is None or tpot <= 0.0 or expected <= 0.0:
            return
        if now is not None:  # tokens came: the node is not hung, however queued its prompts
            h.last_progress = now
        if since is not None and now is not None and node.spans_stall(since, now):
            # It timed a stall (Node.spans_stall), which the router dodges as it
            # happens: the node's speed is what it does between stalls.
            self.stall_samples += 1
            return
        if since is not None and node.kv_short_since(since):
            # Its node was short of KV cache meanwhile (Load.note_kv): the engine
            # queued prompts and preempted decodes to recompute them, which is the
            # load's doing. Overload is met by admission and shedding, never by
            # ejecting the nodes that carry it.
            self.kv_short_samples += 1
            return
        b = decode_bucket(batch)
        if now is None or self.config.segment_s <= 0.0:
            if share < 1.0:  # the log-ratio in proportion: observed as expected x ratio^share
                tpot = expected * (tpot / expected) ** share
            self._sample(node, h, h.decode, 1, b, tpot, expected, now, since)
            return
        raw = math.log(tpot / expected)
        acc = h.pending.get(b)
        if acc is None:
            h.pending[b] = [raw * share, 1.0, now, now if since is None else since, raw, share]
        else:
            acc[0] += raw * share
            acc[1] += 1.0
            if now > acc[2]:
                acc[2] = now
            if since is not None and since < acc[3]:
                acc[3] = since
            acc[4] += raw
            acc[5] += share

    def _flush_decode(self, nodes: Mapping[str, Node], now: float) -> None:
        """Close the decode window (see :meth:`on_decode`) once ``segment_s`` old: every
        node's levels learn the window first, so that each is judged against its
        peers' levels of the same moments (what every node met at once cancels)."""
        if now - self._window_t < 0.99 * self.config.segment_s:  # ticks drift by a hair
            return
        self._window_t = now
        self._windows += 1
        window = self._windows
        closed: list[tuple[Node, Evidence, int, float, float, float, float]] = []
        for node in nodes.values():
            h = self.health.get(node.id)
            if h is None or not h.pending:
                continue
            pending, h.pending = h.pending, {}
            alone = self.alone(node)
            for b, (total, n, seen, since, raw, shares) in sorted(pending.items()):
                if alone:  # its own history in the unweighted ratio (see on_decode)
                    x, weight = clamp(raw / n), shares / n
                    if weight >= 0.5:
                        b += MOSTLY_DECODE
                else:
                    x, weight = clamp(total / n), 1.0
                h.decode.learn(b, x, self._interval, n, window)
                closed.append((node, h.decode, b, x, seen, since, weight))
        # Each class's peer levels of these moments, by bucket: read once a window
        # (a class of 24 read each other's 24 levels, twice a second live).
        moments: dict[tuple[str, int], list[tuple[float, Node]]] = {}
        older: dict[tuple[str, int], list[tuple[float, Node]]] = {}
        for node, ev, b, x, seen, since, weight in closed:
            key = (node.spec.gpu_class, b)
            levels = moments.get(key)
            if levels is None:
                levels = moments[key] = self._peer_levels(key[0], b, window)
            ref = self._window_reference(node, ev, b, levels, older)
            if ref is not None:
                self._residual(ev, x - ref, seen, since, weight)

    def _peer_levels(self, gpu_class: str, b: int, window: int) -> list[tuple[float, Node]]:
        """The levels in decode bucket ``b`` of the class's healthy, clean nodes, sorted:
        those of decode ``window`` or the one before, or (``window`` -1) any at most
        ``FRESH`` intervals old."""
        evidence, interval = self.config.evidence, self._interval
        return sorted(((lv, other) for other, oh in self._references.get(gpu_class, ())
                       if oh.decode.cusum < evidence
                       and (lv := oh.decode.level(b, interval, window)) is not None),
                      key=first)

    def judged_prefill_slowdown(self, node: Node) -> float:
        """The prefill slowdown the node's decode pieces are judged at (the prompt
        chunks sharing their steps). A node that slows down teaches its own
        prefill speed, and chunks priced at it absorb the slowdown of every piece
        they fill. So: its class's speed, but its peers' once its own TTFT reads
        slow for its class (its prefill evidence at the flag's threshold: in a
        class of two, the mean with its own excused half a throttle); for a node
        alone in its class, whose class speed is its own, no more than it was
        when its decode evidence was last clean (a throttled lone H100 read
        1.45x, not 2x). Not its peers' always: under a long-prompt overload the
        nodes' learned prefill speeds part by the load's doing, and priced at
        the others' a node's decode read slow more often."""
        h = self.health.get(node.id)
        if not self.alone(node):
            if h is not None and h.prefill.cusum >= self.config.evidence:
                return node.peers_prefill_slowdown
            return node.class_prefill_slowdown
        slowdown = node.class_prefill_slowdown
        if h is not None and 0.0 < h.clean_prefill < slowdown:
            return h.clean_prefill
        return slowdown

    def _window_reference(self, node: Node, ev: Evidence, b: int,
                          levels: list[tuple[float, Node]],
                          older: dict[tuple[str, int], list[tuple[float, Node]]]) -> float | None:
        """A decode window's reference: the median of the peers' levels of that window
        or the one before (``levels``, sorted, the node's own among them perhaps),
        else the node's own clean history, and the peers' older levels (at most
        ``FRESH`` intervals old; ``older``, filled as needed, by class and bucket)
        where they are slower than it.

        Own history alone is the reference of a class of one. Where the node has
        peers that ran its bucket lately but not this moment, a history that is
        faster than they are does not stand: a history falls at once and rises
        slowly, so it keeps the fastest moments the node had, and on a shared
        host those were the quiet ones (a healthy llama.cpp engine, its peer
        degraded, read 2.35x its own history at the CPU share its busy peer
        had). The peers' older levels alone are no reference either: a healthy
        A100 running a batch its faster peer had run seconds before read 1.6x
        slow against that peer's moment."""
        ref = _median_of_others(levels, node)
        if ref is not None:
            ev.peers = True
            return ref
        own = ev.history.get(b)
        key = (node.spec.gpu_class, b)
        lately = older.get(key)
        if lately is None:
            lately = older[key] = self._peer_levels(key[0], b, -1)
        recent = _median_of_others(lately, node)
        ev.peers = recent is not None and (own is None or recent > own)
        return recent if ev.peers else own

    def _sample(self, node: Node, h: NodeHealth, ev: Evidence, k: int, b: int,
                observed: float, expected: float, now: float | None,
                since: float | None = None) -> None:
        if observed <= 0.0 or expected <= 0.0:
            return
        x = clamp(math.log(observed / expected))
        ev.learn(b, x, self._interval)
        cached = ev.refs.get(b)
        if cached is not None and cached[1] > 0.0:
            cached[1] -= 1.0
            ref = cached[0]
        else:
            found = self._reference(node, ev, k, b)
            if found is None:
                return
            ref = found
        self._residual(ev, x - ref, now, since)

    def _residual(self, ev: Evidence, r: float, now: float | None, since: float | None,
                  weight: float = 1.0) -> None:
        """A sample's excess over its reference, as evidence (``weight``: how much of
        a sample's evidence it carries)."""
        ev.add(r, 1, self._allowance, 2.0 * self.config.evidence, self.config.sigma_floor, now,
               since, weight)
        ev.own_n += 1
        ev.own_total += r

    def _reference(self, node: Node, ev: Evidence, k: int, b: int) -> float | None:
        """The median level of the node's healthy, clean class peers in bucket ``b``, else
        the node's own history there; reused for the next ``REF_REUSE`` samples of
        the bucket (the peers' levels move little per sample; a reference kept for a
        whole interval was seconds stale, and what a host's contention or a burst of
        load does to every node at once then read as one node's slowness)."""
        evidence = self.config.evidence
        # The peers' levels by bucket (Evidence.level, inlined: the hot path).
        peers = [oev.levels for other, oh in self._references.get(node.spec.gpu_class, ())
                 if other is not node
                 and (oev := oh.prefill if k == 0 else oh.decode).cusum < evidence]
        oldest = self._interval - FRESH
        levels: list[float] = []
        # The bucket itself, else (prefill) the next octave of tokens at the same
        # batch: at low rates a node's peers may not have run exactly its kind of
        # request. Never another batch: on a CPU a batch of two steps 2x slower.
        near = (b, b - 1, b + 1) if k == 0 else (b,)
        for bb in near:
            if bb // TOKEN_BUCKETS != b // TOKEN_BUCKETS:
                continue
            for by_bucket in peers:
                lv = by_bucket.get(bb)
                if lv is not None and lv[0] >= 2.0 and lv[2] >= oldest:
                    levels.append(lv[1])
            if levels:
                break
        if levels:
            ref: float | None = median(levels)
            ev.peers = True
        else:
            ref = ev.history.get(b) if k == 1 else None  # TTFT: peers only
            ev.peers = False
        if ref is not None:
            ev.refs[b] = [ref, REF_REUSE]
        return ref

    def on_outcome(self, node: Node, outcome: Outcome, now: float) -> None:
        h = self.health.get(node.id)
        if h is None:
            return
        h.last_progress = now
        if outcome is Outcome.OK:
            h.requests += 1
            h.own_requests += 1
            h.consecutive_failures = 0
        elif outcome.is_node_failure:
            h.requests += 1
            h.failures += 1
            h.own_requests += 1
            h.own_failures += 1
            h.consecutive_failures += 1

    def absorb(self, node_id: str, prefill: tuple[int, float], decode: tuple[int, float],
               requests: int, failures: int, tail_failures: int) -> None:
        """Samples and outcomes another gateway replica saw on the node since it last said.

        They join the current interval as if seen here (so detection pools
        every replica's samples); ``tail_failures`` is the replica's run of
        node failures since its last success on the node, which continues
        this one's run when every outcome it reports is a failure.
        """
        h = self.health.get(node_id)
        if h is None:
            return
        cfg = self.config
        for ev, (n, total) in ((h.prefill, prefill), (h.decode, decode)):
            if n > 0:
                ev.add(total / n, n, self._allowance, 2.0 * cfg.evidence, cfg.sigma_floor, None)
        h.requests += requests
        h.failures += failures
        if failures:
            if requests > failures:  # a success among them: the run is the replica's
                h.consecutive_failures = max(h.consecutive_failures, tail_failures)
            else:
                h.consecutive_failures += failures

    def forget(self, node_id: str) -> None:
        self._classes_for = -1
        h = self.health.pop(node_id, None)
        if h is not None and h.known_state is NodeState.PROBATION:
            self.on_probation -= 1
        self._nominal.pop(node_id, None)


def _median_of_others(levels: list[tuple[float, Node]], node: Node) -> float | None:
    """The median of sorted ``levels`` but ``node``'s own, if any are left."""
    others = [lv for lv, other in levels if other is not node]
    n = len(others)
    if not n:
        return None
    mid = n // 2
    return others[mid] if n % 2 else 0.5 * (others[mid - 1] + others[mid])
