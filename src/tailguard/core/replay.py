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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tailguard.core.admission import Waiter
from tailguard.core.balancer import Balancer, PoolConfig, Ticket, decision_dict
from tailguard.core.fleet import NodeSpec, NodeState, Outcome
from tailguard.core.hardware import DEFAULT_CATALOG, Catalog, PerfParams
from tailguard.core.outliers import OutlierConfig
from tailguard.core.record import event_to_dict, from_jsonable, rng_from_init


@dataclass(slots=True)
class ReplayResult:
    records: int = 0
    decisions: int = 0
    differences: list[dict[str, Any]] = field(default_factory=list)


def replay(records: Iterable[dict[str, Any]], catalog: Catalog = DEFAULT_CATALOG) -> ReplayResult:
    out = ReplayResult()
    balancer: Balancer | None = None
    tickets: dict[int, Ticket] = {}
    waiters: dict[int, Waiter] = {}  # queued requests by the recording's waiter id
    # Events of the last replayed tick, until the recording says what it had
    # (an "events" record follows a tick only when the tick decided something).
    pending: tuple[int, float, list[dict[str, Any]]] | None = None

    def settle(recorded: list[dict[str, Any]]) -> None:
        nonlocal pending
        if pending is not None and pending[2] != recorded:
            out.differences.append({"record": pending[0], "op": "tick", "t": pending[1],
                                    "recorded": recorded, "replayed": pending[2]})
        pending = None

    for i, rec in enumerate(records):
        out.records += 1
        op = rec.get("op")
        if op == "events":
            settle(rec["events"])
            continue
        settle([])
        if op == "init":
            outliers = rec.get("outliers")
            balancer = Balancer([], [], rng_from_init(rec), catalog,
                                from_jsonable(PerfParams, rec["perf_params"]),
                                outliers=from_jsonable(OutlierConfig, outliers)
                                if outliers is not None else None)
            tickets.clear()
            waiters.clear()
            continue
        if balancer is None:
            raise ValueError(f"record {i}: {op!r} before 'init'")
        if op == "add_pool":
            balancer.add_pool(from_jsonable(PoolConfig, rec["config"]))
        elif op == "replace_pool":
            balancer.replace_pool(from_jsonable(PoolConfig, rec["config"]))
        elif op == "add_node":
            spec: NodeSpec = from_jsonable(NodeSpec, rec["spec"])
            balancer.add_node(spec)
        elif op == "remove_node":
            balancer.remove_node(rec["node"])
        elif op == "set_state":
            balancer.set_state(rec["node"], NodeState(rec["state"]))
        elif op == "pick":
            ticket = balancer.pick(rec["model"], rec["prompt_tokens"], rec["t"],
                                   rec.get("max_tokens"), rec.get("priority", 1),
                                   tuple(rec.get("exclude", ())), tuple(rec.get("prefix", ())),
                                   rec.get("session"))
            out.decisions += 1
            got = ticket.node_id if ticket is not None else None
            if got != rec["node"]:
                out.differences.append({"record": i, "op": "pick", "t": rec["t"],
                                        "recorded": rec["node"], "replayed": got})
            if ticket is not None and rec.get("ticket") is not None:
                tickets[rec["ticket"]] = ticket
        elif op == "rank":
            ranked = balancer.rank(rec["model"], rec["prompt_tokens"], rec["t"],
                                   rec.get("max_tokens"), rec.get("priority", 1),
                                   tuple(rec.get("exclude", ())), rec.get("n", 1),
                                   tuple(rec.get("prefix", ())), rec.get("session"))
            out.decisions += 1
            if ranked != rec["nodes"]:
                out.differences.append({"record": i, "op": "rank", "t": rec["t"],
                                        "recorded": rec["nodes"], "replayed": ranked})
        elif op == "take":
            taken = balancer.take(rec["model"], rec["node"], rec["prompt_tokens"], rec["t"],
                                  tuple(rec.get("prefix", ())))
            if taken is not None:
                tickets[rec["ticket"]] = taken
        elif op == "admit":
            admitted = balancer.admit(rec["model"], rec["prompt_tokens"], rec["t"],
                                 rec.get("max_tokens"), rec.get("priority", 1),
                                 tuple(rec.get("exclude", ())), rec.get("ttft_s"),
                                 rec.get("size_bytes", 0), prefix=tuple(rec.get("prefix", ())),
                                 session=rec.get("session"))
            out.decisions += 1
            replayed = decision_dict(admitted)
            if replayed != rec["result"]:
                out.differences.append({"record": i, "op": "admit", "t": rec["t"],
                                        "recorded": rec["result"], "replayed": replayed})
            if isinstance(admitted, Ticket) and "ticket" in rec["result"]:
                tickets[rec["result"]["ticket"]] = admitted
            elif isinstance(admitted, Waiter) and "queued" in rec["result"]:
                waiters[rec["result"]["queued"]] = admitted
        elif op == "poll_queue":
            decisions = balancer.poll_queue(rec["t"])
            out.decisions += 1
            replayed_list = [{"waiter": w.wid, **decision_dict(d)} for w, d in decisions]
            if replayed_list != rec["decisions"]:
                out.differences.append({"record": i, "op": "poll_queue", "t": rec["t"],
                                        "recorded": rec["decisions"],
                                        "replayed": replayed_list})
            for (w, d), recorded in zip(decisions, rec["decisions"], strict=False):
                waiters.pop(w.wid, None)
                if isinstance(d, Ticket) and "ticket" in recorded:
                    tickets[recorded["ticket"]] = d
        elif op == "cancel_queued":
            waiter = waiters.pop(rec["waiter"], None)
            if waiter is not None:
                balancer.cancel_queued(waiter)
        elif op == "first_token":
            t = tickets.get(rec["ticket"])
            if t is not None:
                balancer.on_first_token(t, rec["t"], defer_prefill=rec.get("defer", False))
        elif op == "progress":
            t = tickets.get(rec["ticket"])
            if t is not None:
                balancer.on_stream_progress(t, rec["tokens"], rec["t"])
        elif op == "no_first_token":
            t = tickets.get(rec["ticket"])
            if t is not None:
                balancer.expect_no_first_token(t, rec["t"])
        elif op == "finish":
            t = tickets.pop(rec["ticket"], None)
            if t is not None:
                balancer.on_finish(t, rec["t"], Outcome(rec["outcome"]), rec["output_tokens"],
                                   judged=rec.get("judged", True), timed=rec.get("timed", True),
                                   cached_tokens=rec.get("cached_tokens"))
        elif op == "blame":
            balancer.blame(rec["node"], Outcome(rec["outcome"]), rec["t"])
        elif op == "engine_metrics":
            balancer.on_engine_metrics(rec["node"], rec["t"], rec["running"], rec["waiting"],
                                       rec["kv_usage"])
        elif op == "tick":
            out.decisions += 1
            pending = (i, rec["t"], [event_to_dict(e) for e in balancer.tick(rec["t"])])
        elif op == "peers":
            out.decisions += 1
            adopted = balancer.on_peers(rec["t"], rec["reports"], rec["leader"])
            pending = (i, rec["t"], [event_to_dict(e) for e in adopted])
        else:
            raise ValueError(f"record {i}: unknown op {op!r}")
    settle([])
    return out
