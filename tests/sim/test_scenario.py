"""Scenario validation: each bad input names its field and the allowed values."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tailguard.errors import ConfigError
from tailguard.sim.scenario import parse_scenario

BASE: dict[str, Any] = {
    "name": "t",
    "seed": 1,
    "model": "llama-3.1-8b",
    "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
    "network_rtt_s": 0.001,
    "fleet": [
        {"gpu": "H100-SXM", "count": 2},
        {"gpu": "A100-80GB", "count": 4, "tp": 1,
         "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 4096}},
        {"gpu": "L4", "count": 8},
    ],
    "workload": {
        "duration_s": 600, "warmup_s": 60,
        "arrival": {"process": "poisson", "load": 0.8},
        "input_tokens": {"dist": "lognormal", "mu": 6.6, "sigma": 1.0, "max": 8192},
        "output_tokens": {"dist": "azure-conv"},
    },
    "faults": [{"node": "L4#3", "kind": "throttle", "factor": 0.4, "at_s": 120, "duration_s": 300}],
    "policies": ["round_robin", "least_request", "seed_weighted", "tailguard"],
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    node: Any = doc
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


def test_the_documented_shape_parses() -> None:
    scn = parse_scenario(BASE)
    ids = [n.id for n in scn.nodes()]
    assert ids[:3] == ["H100-SXM#0", "H100-SXM#1", "A100-80GB#0"]
    assert "L4#7" in ids and len(ids) == 14
    assert scn.fleet[1].engine.max_num_seqs == 128
    assert scn.faults[0].node == "L4#3" and scn.faults[0].factor == 0.4
    assert [p.name for p in scn.policies] == BASE["policies"]


@pytest.mark.parametrize(
    ("path", "value", "field", "mentions"),
    [
        ("fleet.0.gpu", "H900", "fleet[0].gpu", "H100-SXM"),
        ("model", "gpt-9", "model", "llama-3.1-8b"),
        ("policies", ["tailguard", "fastest"], "policies[1]", "round_robin"),
        ("fleet.2.gpu", "T4", "fleet[2].gpu", "does not fit"),
        ("workload.arrival", {"process": "poisson", "rate": -3}, "workload.arrival.rate", "> 0"),
        ("workload.arrival", {"process": "poisson", "rate": 0}, "workload.arrival.rate", "> 0"),
        ("faults", [{"node": "L4#9", "kind": "throttle", "factor": 0.5, "at_s": 1}],
         "faults[0].node", "L4#7"),
        ("faults", [{"node": "L4#1", "kind": "melt", "at_s": 1}], "faults[0].kind", "throttle"),
        ("fleet.0.count", 0, "fleet[0].count", ">= 1"),
        ("slo", {"ttft_s": 2.0, "tpot": 0.1}, "slo.tpot", "unknown key"),
    ],
)
def test_bad_input_names_the_field(path: str, value: Any, field: str, mentions: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_scenario(with_change(path, value))
    assert err.value.field == field, str(err.value)
    assert mentions in str(err.value)


def test_unknown_top_level_key() -> None:
    doc = copy.deepcopy(BASE)
    doc["fleeet"] = []
    with pytest.raises(ConfigError, match="fleeet: unknown key"):
        parse_scenario(doc)
