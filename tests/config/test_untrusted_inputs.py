"""What reaches the core from outside, arbitrary: the other replicas' reports (through
``config.wire``) and the engines' metric pages (through ``adapters.engine_metrics``).

The core must never raise on them and never route to a node it would not route to.
"""

from __future__ import annotations

import json
import math
import os
import random
from typing import Any

from hypothesis import HealthCheck, given, settings, strategies as st

from tailguard.adapters.engine_metrics import ADAPTERS, parse_engine_metrics
from tailguard.config.wire import WireError, parse_report
from tailguard.core.admission import AdmissionConfig
from tailguard.core.balancer import Balancer, PoolConfig
from tailguard.core.fleet import NodeSpec
from tailguard.core.hardware import DEFAULT_CATALOG
from tailguard.core.limits import LimitConfig

MODEL = "m"
NODES = ("n0", "n1", "n2")
EXAMPLES = int(os.environ.get("TAILGUARD_PROPERTY_EXAMPLES", "2000"))

numbers = (st.integers(-10**20, 10**20) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, 1, -1, 0.5, 1e308, -1e308, 2**63]))
scalars = st.none() | st.booleans() | numbers | st.text(max_size=6)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                           max_leaves=12)
pairs = st.lists(numbers, min_size=0, max_size=3) | json_values
decisions = st.lists(st.sampled_from(["healthy", "degraded", "quarantined", "probation",
                                      "cordoned", "down", "?"]) | numbers | st.text(max_size=4),
                     min_size=5, max_size=5) | json_values
entries = st.fixed_dictionaries({}, optional={
    "f": numbers | scalars, "b": numbers | scalars, "d": pairs, "p": pairs,
    "l": numbers | scalars, "o": st.lists(numbers, min_size=7, max_size=7) | json_values,
    "s": decisions}) | json_values
reports = st.fixed_dictionaries({"epoch": st.text(max_size=6) | scalars}, optional={
    "demand": numbers | scalars, "seq": numbers, "ts": numbers,
    "nodes": st.dictionaries(st.sampled_from(NODES) | st.text(max_size=3), entries, max_size=4)
    | json_values,
    "budgets": st.dictionaries(st.just(MODEL) | st.text(max_size=3), pairs, max_size=2)
    | json_values,
}) | json_values
# Reports the schema accepts, at and near its bounds: what a buggy replica could send.
edge_ints = st.sampled_from([0, 1, 7, 10**6])
edge_ratios = st.sampled_from([-7.0, -1.0, 0.0, 0.3, 7.0])
valid_entries = st.fixed_dictionaries({}, optional={
    "f": edge_ints, "b": st.sampled_from([0, 10, 10**10]),
    "d": st.tuples(edge_ratios, edge_ints), "p": st.tuples(edge_ratios, edge_ints),
    "l": st.sampled_from([1.0, 3.5, 1e6]),
    "o": st.tuples(edge_ints, st.sampled_from([-1e12, 0.0, 5.0]), edge_ints,
                   st.sampled_from([-3.0, 1e12]), edge_ints, edge_ints, edge_ints),
    "s": st.tuples(st.sampled_from(["healthy", "degraded", "quarantined", "probation"]),
                   st.sampled_from([0.0, 0.1, 1.0]), st.sampled_from([0, 1, 10_000]),
                   st.sampled_from([0.0, 30.0, 1e7]), st.text(max_size=10))})
valid_reports = st.fixed_dictionaries({
    "epoch": st.sampled_from(["a", "b"]), "demand": st.sampled_from([0, 3, 10**6]),
    "nodes": st.dictionaries(st.sampled_from(NODES), valid_entries, max_size=3)})
reports = valid_reports | valid_reports | reports
metric_names = st.sampled_from([n.split("{")[0] for a in ADAPTERS.values()
                                for n in (*a.running, *a.waiting, *a.kv_usage)])
metric_values = st.sampled_from(["1", "-3", "+Inf", "-Inf", "NaN", "1e400", "7.5", "", "x",
                                 "1e18", "0x10"]) | st.floats().map(repr)
pages = st.lists(st.tuples(metric_names, st.sampled_from(["", '{engine="0"}', "{"]),
                           metric_values), max_size=6).map(
    lambda lines: "\n".join(f"{n}{labels} {v}" for n, labels, v in lines))


def balancer(limited: bool, policy: str) -> Balancer:
    specs = [NodeSpec(n, DEFAULT_CATALOG.gpu("A100"), "A100-80GB", models=(MODEL,))
             for n in NODES]
    limits = LimitConfig(kind="gradient", initial=4) if limited else None
    admission = AdmissionConfig(queue_max=4) if limited else None
    b = Balancer(specs, [PoolConfig(MODEL, policy, limits=limits, admission=admission)],
                 random.Random(1))
    b.tick(0.0)
    return b


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(reports, st.booleans()), min_size=1, max_size=3),
       st.lists(st.tuples(st.sampled_from(NODES), st.sampled_from(sorted(ADAPTERS)), pages),
                max_size=3),
       st.booleans(), st.sampled_from(["tailguard", "least_request", "seed_weighted"]))
def test_the_core_never_raises_on_what_others_send(
        sent: list[tuple[Any, bool]], scraped: list[tuple[str, str, str]], limited: bool,
        policy: str) -> None:
    b = balancer(limited, policy)
    now = 1.0
    taken: dict[str, dict[str, Any]] = {}
    for i, (raw, leads) in enumerate(sent):
        text = raw if isinstance(raw, str) else json.dumps(raw)  # NaN, Infinity as Python writes
        try:
            report = parse_report(text)
        except WireError:
            continue
        taken[f"r{i}"] = report.core(leads)
    for node, engine, page in scraped:
        sample = parse_engine_metrics(page, engine)
        if sample is not None:
            assert sample.running >= 0 and sample.waiting >= 0
            assert sample.kv_usage == -1.0 or 0.0 <= sample.kv_usage <= 1.0
            b.on_engine_metrics(node, now, sample.running, sample.waiting, sample.kv_usage)
    assert all(isinstance(r, (dict, list, str, int, float, bool)) or r is None for r, _ in sent)
    for _ in range(2):
        b.on_peers(now, taken, leader=False)
        b.tick(now)
        for prompt in (1, 500, 100_000):
            ticket = b.pick(MODEL, prompt, now)
            if ticket is not None:
                assert ticket.node.state.routable
                assert math.isfinite(ticket.expected_ttft())
                b.on_first_token(ticket, now + 0.1)
                b.on_finish(ticket, now + 0.5, _ok(), 10)
        now += 1.0


def _ok() -> Any:
    from tailguard.core.fleet import Outcome

    return Outcome.OK
