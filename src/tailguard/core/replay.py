"""Replay a recording into a fresh balancer and report every decision that differs.

See :mod:`tailguard.core.record` for the format. The replayer applies each
recorded input with its recorded ``now`` to a new
:class:`~tailguard.core.balancer.Balancer` whose routing RNG starts in the
recorded state, and compares what it decides (the node of each ``pick``, the
ticket, queue place or 429 of each ``admit``, the dispatches and sheds each
``poll_queue`` returns, the events of each ``tick``) with what was recorded. Zero differences means the
recorded run's decisions are exactly reproducible offline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tailguard.core.admission import Waiter
from tailguard.core.balancer import Balancer, PoolConfig, Ticket, decision_dict, pair_dict
from tailguard.core.fleet import Actor, NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG, Catalog, PerfParams
from tailguard.core.outliers import OutlierConfig
from tailguard.core.policies import options_type
from tailguard.core.probes import ProbeRule
from tailguard.core.record import event_to_dict, from_jsonable, rng_from_init


@dataclass(slots=True)
class ReplayResult:
    records: int = 0
    decisions: int = 0
    differences: list[dict[str, Any]] = field(default_factory=list)


def replay(records: Iterable[dict[str, Any]], catalog: Catalog = DEFAULT_CATALOG) -> ReplayResult:
    """Apply ``records`` to a fresh balancer; every decision that differs is reported."""
    r = _Replayer(catalog)
    for i, rec in enumerate(records):
        r.apply(i, rec)
    r.settle([])
    return r.out


Record = dict[str, Any]


def _args(rec: Record) -> tuple[str, int, float, int | None, int, tuple[str, ...]]:
    """A routing call's common inputs: model, prompt, now, max_tokens, priority, exclude."""
    return (rec["model"], rec["prompt_tokens"], rec["t"], rec.get("max_tokens"),
            rec.get("priority", 1), tuple(rec.get("exclude", ())))


class _Replayer:
    """The replay's state: the balancer, the recording's tickets and waiters
    by their recorded ids, and the events of the last replayed tick."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.out = ReplayResult()
        self._balancer: Balancer | None = None
        self.tickets: dict[int, Ticket] = {}
        self.waiters: dict[int, Waiter] = {}  # queued requests by the recording's waiter id
        # Events of the last replayed tick, until the recording says what it had
        # (an "events" record follows a tick only when the tick decided something).
        self.pending: tuple[int, float, list[dict[str, Any]]] | None = None
        self.ops: dict[str, Callable[[int, Record], None]] = {
            "add_pool": self._add_pool, "replace_pool": self._replace_pool,
            "add_node": self._add_node, "remove_node": self._remove_node,
            "set_state": self._set_state, "probe": self._probe, "pick": self._pick,
            "rank": self._rank,
            "take": self._take, "admit": self._admit, "poll_queue": self._poll_queue,
            "cancel_queued": self._cancel_queued, "first_token": self._first_token,
            "progress": self._progress, "silence": self._silence,
            "no_first_token": self._no_first_token,
            "finish": self._finish, "blame": self._blame, "hand_off": self._hand_off,
            "engine_metrics": self._engine_metrics, "tick": self._tick, "peers": self._peers,
        }

    @property
    def b(self) -> Balancer:
        assert self._balancer is not None
        return self._balancer

    def apply(self, i: int, rec: Record) -> None:
        self.out.records += 1
        op = rec.get("op")
        if op == "events":
            self.settle(rec["events"])
            return
        self.settle([])
        if op == "init":
            self._init(rec)
            return
        if self._balancer is None:
            raise ValueError(f"record {i}: {op!r} before 'init'")
        handler = self.ops.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ValueError(f"record {i}: unknown op {op!r}")
        handler(i, rec)

    def settle(self, recorded: list[dict[str, Any]]) -> None:
        if self.pending is not None and self.pending[2] != recorded:
            i, t, replayed = self.pending
            self.out.differences.append({"record": i, "op": "tick", "t": t,
                                         "recorded": recorded, "replayed": replayed})
        self.pending = None

    def _differs(self, i: int, rec: Record, recorded: Any, replayed: Any) -> None:
        self.out.decisions += 1
        if replayed != recorded:
            self.out.differences.append({"record": i, "op": rec["op"], "t": rec["t"],
                                         "recorded": recorded, "replayed": replayed})

    # -- the fleet ------------------------------------------------------------------

    def _init(self, rec: Record) -> None:
        outliers = rec.get("outliers")
        probes = rec.get("probes")
        self._balancer = Balancer([], [], rng_from_init(rec), self.catalog,
                                  from_jsonable(PerfParams, rec["perf_params"]),
                                  outliers=from_jsonable(OutlierConfig, outliers)
                                  if outliers is not None else None,
                                  probes=from_jsonable(ProbeRule, probes)
                                  if probes is not None else None)
        self.tickets.clear()
        self.waiters.clear()

    def _add_pool(self, i: int, rec: Record) -> None:
        self.b.add_pool(_pool_config(rec["config"]))

    def _replace_pool(self, i: int, rec: Record) -> None:
        self.b.replace_pool(_pool_config(rec["config"]))

    def _add_node(self, i: int, rec: Record) -> None:
        spec: NodeSpec = from_jsonable(NodeSpec, rec["spec"])
        self.b.add_node(spec)

    def _remove_node(self, i: int, rec: Record) -> None:
        self.b.remove_node(rec["node"])

    def _set_state(self, i: int, rec: Record) -> None:
        self.b.set_state(rec["node"], NodeState(rec["state"]), Actor(rec.get("by", "operator")))

    def _probe(self, i: int, rec: Record) -> None:
        self.b.on_probe(rec["node"], rec["ok"], rec["t"])

    # -- routing decisions ----------------------------------------------------------

    def _pick(self, i: int, rec: Record) -> None:
        ticket = self.b.pick(*_args(rec), tuple(rec.get("prefix", ())), rec.get("session"))
        recorded: Any = rec["node"]
        replayed: Any = ticket.node_id if ticket is not None else None
        pair = pair_dict(ticket).get("prefill")
        if pair is not None or rec.get("prefill") is not None:  # a disaggregated request
            recorded, replayed = [recorded, rec.get("prefill")], [replayed, pair]
        self._differs(i, rec, recorded, replayed)
        if ticket is not None and rec.get("ticket") is not None:
            self._hold(ticket, rec)

    def _hold(self, ticket: Ticket, recorded: Record) -> None:
        """Keep a replayed ticket (and its prefill leg's) under the recording's numbers."""
        self.tickets[recorded["ticket"]] = ticket
        pre = recorded.get("prefill")
        if ticket.prefill is not None and isinstance(pre, dict):
            self.tickets[pre["ticket"]] = ticket.prefill

    def _rank(self, i: int, rec: Record) -> None:
        ranked = self.b.rank(*_args(rec), rec.get("n", 1), tuple(rec.get("prefix", ())),
                             rec.get("session"))
        self._differs(i, rec, rec["nodes"], ranked)

    def _take(self, i: int, rec: Record) -> None:
        taken = self.b.take(rec["model"], rec["node"], rec["prompt_tokens"], rec["t"],
                            tuple(rec.get("prefix", ())))
        if taken is not None:
            self.tickets[rec["ticket"]] = taken

    def _admit(self, i: int, rec: Record) -> None:
        admitted = self.b.admit(*_args(rec), rec.get("ttft_s"), rec.get("size_bytes", 0),
                                prefix=tuple(rec.get("prefix", ())), session=rec.get("session"))
        result = rec["result"]
        self._differs(i, rec, result, decision_dict(admitted))
        if isinstance(admitted, Ticket) and "ticket" in result:
            self._hold(admitted, result)
        elif isinstance(admitted, Waiter) and "queued" in result:
            self.waiters[result["queued"]] = admitted

    def _poll_queue(self, i: int, rec: Record) -> None:
        decisions = self.b.poll_queue(rec["t"])
        replayed = [{"waiter": w.wid, **decision_dict(d)} for w, d in decisions]
        self._differs(i, rec, rec["decisions"], replayed)
        for (w, d), recorded in zip(decisions, rec["decisions"], strict=False):
            self.waiters.pop(w.wid, None)
            if isinstance(d, Ticket) and "ticket" in recorded:
                self._hold(d, recorded)

    def _cancel_queued(self, i: int, rec: Record) -> None:
        waiter = self.waiters.pop(rec["waiter"], None)
        if waiter is not None:
            self.b.cancel_queued(waiter)

    # -- a request's life on its node -----------------------------------------------

    def _first_token(self, i: int, rec: Record) -> None:
        t = self.tickets.get(rec["ticket"])
        if t is not None:
            self.b.on_first_token(t, rec["t"], defer_prefill=rec.get("defer", False))

    def _progress(self, i: int, rec: Record) -> None:
        t = self.tickets.get(rec["ticket"])
        if t is not None:
            self.b.on_stream_progress(t, rec["tokens"], rec["t"])

    def _silence(self, i: int, rec: Record) -> None:
        t = self.tickets.get(rec["ticket"])
        if t is not None:
            self.b.on_stream_silence(t, rec["since"], rec["t"])

    def _no_first_token(self, i: int, rec: Record) -> None:
        t = self.tickets.get(rec["ticket"])
        if t is not None:
            self.b.expect_no_first_token(t, rec["t"])

    def _finish(self, i: int, rec: Record) -> None:
        t = self.tickets.pop(rec["ticket"], None)
        if t is not None:
            self.b.on_finish(t, rec["t"], Outcome(rec["outcome"]), rec["output_tokens"],
                             judged=rec.get("judged", True), timed=rec.get("timed", True),
                             cached_tokens=rec.get("cached_tokens"))

    def _hand_off(self, i: int, rec: Record) -> None:
        t = self.tickets.get(rec["ticket"])
        if t is not None:
            self.b.hand_off(t, rec["t"])

    def _blame(self, i: int, rec: Record) -> None:
        self.b.blame(rec["node"], Outcome(rec["outcome"]), rec["t"])

    def _engine_metrics(self, i: int, rec: Record) -> None:
        self.b.on_engine_metrics(rec["node"], rec["t"], rec["running"], rec["waiting"],
                                 rec["kv_usage"], rec.get("preemptions", -1))

    # -- periodic decisions: compared when the recording's "events" record comes ----

    def _tick(self, i: int, rec: Record) -> None:
        self.out.decisions += 1
        self.pending = (i, rec["t"], [event_to_dict(e) for e in self.b.tick(rec["t"])])

    def _peers(self, i: int, rec: Record) -> None:
        self.out.decisions += 1
        adopted = self.b.on_peers(rec["t"], rec["reports"], rec["leader"])
        self.pending = (i, rec["t"], [event_to_dict(e) for e in adopted])


def _pool_config(data: dict[str, Any]) -> PoolConfig:
    """A recorded pool, its policy's options rebuilt as that policy's dataclass."""
    config: PoolConfig = from_jsonable(PoolConfig, data)
    kind = options_type(config.policy)
    given = config.policy_options
    options = from_jsonable(kind, given) if kind is not None and given else None
    return replace(config, policy_options=options)
