"""Disaggregated roles and KV links as files spell them: scenarios and fleet files
take them; kv_link faults are the simulator's alone."""

from __future__ import annotations

from typing import Any

import pytest

from tailguard.config.fleet import parse_fleet
from tailguard.core.kv_transfer import LINKS, Link, PairLink
from tailguard.emulator.faults import parse_fault
from tailguard.errors import ConfigError
from tailguard.sim.scenario import parse_scenario


def scenario(**extra: Any) -> dict[str, Any]:
    fleet = extra.pop("fleet", [{"gpu": "H100", "role": "prefill", "kv_link": "rdma-8x400"},
                                {"gpu": "A100", "count": 2, "role": "decode",
                                 "kv_link": {"gb_per_s": 12.5, "setup_ms": 2}}])
    return {"model": "llama-3.1-8b", "fleet": fleet,
            "workload": {"duration_s": 60, "arrival": {"process": "poisson", "rate": 1},
                         "input_tokens": {"dist": "azure-conv"},
                         "output_tokens": {"dist": "azure-conv"}},
            **extra}


def test_a_scenario_gives_roles_and_links() -> None:
    scn = parse_scenario(scenario(kv_link="tcp"))
    nodes = scn.nodes()
    assert [n.role for n in nodes] == ["prefill", "decode", "decode"]
    assert nodes[0].kv_link == LINKS["rdma-8x400"]
    assert nodes[1].kv_link == Link(12.5, 0.002)
    assert scn.kv_link == LINKS["tcp"]
    scn = parse_scenario(scenario(kv_pairs=[{"nodes": ["H100-SXM#0", "A100-80GB#1"],
                                             "link": "nvlink"}]))
    assert scn.kv_pairs == (PairLink("H100-SXM#0", "A100-80GB#1", LINKS["nvlink"]),)


@pytest.mark.parametrize(("raw", "field", "says"), [
    (scenario(kv_link="infiniband"), "kv_link", "unknown link"),
    (scenario(fleet=[{"gpu": "H100", "role": "encode"}]), "fleet[0].role", "both"),
    (scenario(fleet=[{"gpu": "H100", "kv_link": {"gb_per_s": 0}}]), "fleet[0].kv_link", ""),
    (scenario(kv_pairs=[{"nodes": ["H100-SXM#0", "A100-80GB#7"], "link": "tcp"}]),
     "kv_pairs[0].nodes[1]", "unknown node"),
])
def test_bad_roles_and_links_name_their_field(raw: dict[str, Any], field: str,
                                              says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_scenario(raw)
    assert err.value.field.startswith(field) and says in str(err.value)


def test_fleet_file_nodes_take_roles_and_refuse_kv_link_faults() -> None:
    node = {"id": "a", "url": "http://127.0.0.1:9", "models": ["m"], "gpu": "A100"}
    fleet = parse_fleet({"nodes": [dict(node, role="decode", kv_link="tcp")]})
    assert fleet.nodes[0].core.role == "decode"
    assert fleet.nodes[0].core.kv_link == LINKS["tcp"]
    with pytest.raises(ConfigError) as err:
        parse_fleet({"nodes": [dict(node, role="encode")]})
    assert err.value.field == "nodes[0].role"
    with pytest.raises(ConfigError, match="no kv_link fault"):
        parse_fleet({"nodes": [dict(node, faults=[{"kind": "kv_link", "factor": 0.1}])]})
    with pytest.raises(ConfigError, match="KV link has no fault"):
        parse_fault({"kind": "kv_link", "factor": 0.5})
    with pytest.raises(ConfigError, match="factor"):
        parse_scenario(scenario(faults=[{"node": "H100-SXM#0", "kind": "kv_link"}]))
