"""The published JSON Schemas (``tailguard schema fleet|scenario``, ``schemas/``):
current, valid, and in agreement with the loaders on shipped and broken files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from tailguard.cli import main, schema
from tailguard.config.fleet import parse_fleet
from tailguard.errors import ConfigError
from tailguard.sim.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "fleet": [ROOT / "deploy/envoy/fleet.yaml", ROOT / "deploy/kubernetes/gateway/fleet.yaml"],
    "scenario": sorted((ROOT / "scenarios").glob("*.yaml")),
}


def validator(name: str) -> Draft202012Validator:
    doc = schema(name)
    Draft202012Validator.check_schema(doc)
    return Draft202012Validator(doc)


@pytest.mark.parametrize("name", ["fleet", "scenario"])
def test_the_committed_schema_is_what_the_cli_prints(name: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", name]) == 0
    printed = json.loads(capsys.readouterr().out)
    committed = json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text())
    assert printed == committed, f"run `tailguard schema {name} -o schemas/{name}.schema.json`"
    assert main(["schema", name, "-o", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == committed


@pytest.mark.parametrize("name", ["fleet", "scenario"])
def test_shipped_files_validate(name: str) -> None:
    check = validator(name)
    assert SHIPPED[name]
    for path in SHIPPED[name]:
        errors = [e.message for e in check.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, f"{path}: {errors}"


FLEET = {"nodes": [{"id": "a", "url": "http://127.0.0.1:9", "gpu": "H100", "models": ["m"]}]}
SCENARIO = {"model": "llama-3.1-8b", "fleet": [{"gpu": "L4", "count": 2}],
            "workload": {"duration_s": 10, "arrival": {"process": "poisson", "rate": 1},
                         "input_tokens": {"dist": "fixed", "value": 100},
                         "output_tokens": {"dist": "fixed", "value": 10}}}


def _with(doc: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**doc, **changes}


GOOD = [
    ("fleet", FLEET),
    ("fleet", _with(FLEET, pools={"m": {"retries": 2, "limits": {"kind": "aimd", "min": 2}}},
                    **{"x-owner": "team-a"})),
    ("fleet", _with(FLEET, nodes=[{**FLEET["nodes"][0], "faults": [
        {"kind": "throttle", "factor": 0.5}], "emulator": {"speed": 0.8}}])),
    ("scenario", SCENARIO),
    ("scenario", _with(SCENARIO, faults=[{"node": "L4#0", "kind": "stall", "seconds": 1}],
                       policies=["tailguard", {"name": "p2c"}])),
]
BAD = [
    ("fleet", _with(FLEET, listen_on=8080)),  # unknown key
    ("fleet", _with(FLEET, max_body_bytes="8M")),  # a string for an integer
    ("fleet", _with(FLEET, pools={"m": {"limits": {"kind": "magic"}}})),  # not one of
    ("fleet", _with(FLEET, pools={"m": {"retries": {"budget": -1}}})),  # below a bound
    ("fleet", _with(FLEET, nodes=[{**FLEET["nodes"][0], "tp": 0}])),
    ("scenario", _with(SCENARIO, fleet=[])),  # min length
    ("scenario", _with(SCENARIO, faults=[{"node": "L4#0", "kind": "melt"}])),
    ("scenario", {k: v for k, v in SCENARIO.items() if k != "model"}),  # required
]


def _loads(name: str, doc: dict[str, Any]) -> None:
    if name == "fleet":
        parse_fleet(doc)
    else:
        parse_scenario(doc)


@pytest.mark.parametrize(("name", "doc"), GOOD)
def test_schema_and_loader_accept_the_same_good_files(name: str, doc: dict[str, Any]) -> None:
    assert not list(validator(name).iter_errors(doc))
    _loads(name, doc)


@pytest.mark.parametrize(("name", "doc"), BAD)
def test_schema_and_loader_refuse_the_same_bad_files(name: str, doc: dict[str, Any]) -> None:
    assert list(validator(name).iter_errors(doc))
    with pytest.raises(ConfigError):
        _loads(name, doc)
