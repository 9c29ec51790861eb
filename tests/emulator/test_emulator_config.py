"""Fleet-file adaptation, fault specs and request parsing of the emulator (no sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailguard.cli import main
from tailguard.config.fleet import parse_fleet
from tailguard.emulator import EmulatedNode, nodes_from_fleet, parse_fault
from tailguard.emulator.faults import combine
from tailguard.emulator.protocol import RequestError, estimate_prompt_tokens, parse_request
from tailguard.errors import ConfigError


def fleet(*nodes: dict[str, object], **top: object) -> list[EmulatedNode]:
    return nodes_from_fleet(parse_fleet({"nodes": list(nodes), **top}), base_port=9100)


def test_local_nodes_get_their_url_port_or_base_ports_and_remote_nodes_are_skipped() -> None:
    nodes = fleet(
        {"id": "h", "url": "http://127.0.0.1:8101", "gpu": "H100", "models": ["llama-3.1-8b"]},
        {"id": "r", "url": "http://10.0.0.5:8000", "gpu": "A100", "models": ["llama-3.1-8b"]},
        {"id": "l", "url": "http://localhost", "gpu": "NVIDIA L4", "models": ["custom"],
         "engine": "sglang", "max_num_seqs": 64,
         "faults": [{"kind": "throttle", "factor": 0.5, "at_s": 10}],
         "emulator": {"speed": 0.8, "max_num_batched_tokens": 512}},
        {"id": "t", "url": "http://127.0.0.1", "gpu": "T4", "models": ["m"]},
        emulator={"long_prefill_token_threshold": 256},
    )
    assert [(n.id, n.port) for n in nodes] == [("h", 8101), ("l", 9100), ("t", 9101)]
    l4 = nodes[1]
    assert l4.dialect == "sglang"
    assert l4.speed == 0.8
    assert (l4.engine.max_num_seqs, l4.engine.max_num_batched_tokens) == (64, 512)
    # vLLM's long-prefill cap, from the fleet's defaults
    assert {n.engine.long_prefill_token_threshold for n in nodes} == {256}
    assert l4.faults[0].kind == "throttle" and l4.faults[0].at_s == 10
    assert l4.perf().model.name == "llama-3.1-8b"  # an unknown served name falls back
    assert l4.perf().gpu.name == "L4"


def test_pool_catalog_model_picks_the_roofline_model() -> None:
    nodes = fleet({"id": "a", "url": "http://127.0.0.1:1", "gpu": "A100", "models": ["my-70b"],
                   "tp": 2},
                  pools={"my-70b": {"catalog_model": "llama-3.1-70b"}})
    assert nodes[0].perf().model.name == "llama-3.1-70b"
    assert nodes[0].perf().tp == 2


@pytest.mark.parametrize(("node", "field"), [
    ({"gpu": "MysteryGPU"}, "nodes[0].gpu"),
    ({"faults": [{"kind": "errors", "rate": 2}]}, "nodes[0].faults[0].rate"),
    ({"faults": [{"kind": "melt"}]}, "nodes[0].faults[0].kind"),
    ({"emulator": {"sped": 2}}, "nodes[0].emulator.sped"),
    ({"emulator": {"speed": -1}}, "nodes[0].emulator.speed"),
    ({"emulator": {"long_prefill_token_threshold": -1}},
     "nodes[0].emulator.long_prefill_token_threshold"),
])
def test_bad_nodes_name_the_field(node: dict[str, object], field: str) -> None:
    base = {"id": "a", "url": "http://127.0.0.1:1", "gpu": "A100", "models": ["m"]}
    with pytest.raises(ConfigError) as err:
        fleet({**base, **node})
    assert err.value.field == field


def test_fault_specs_and_their_combination() -> None:
    with pytest.raises(ConfigError) as renamed:
        parse_fault({"kind": "error_rate", "rate": 0.2})
    assert renamed.value.field == "fault.kind" and "'errors'" in renamed.value.message
    with pytest.raises(ConfigError) as stray:
        parse_fault({"kind": "errors", "rate": 0.2, "factor": 0.5})
    assert stray.value.field == "fault.factor"
    stall = parse_fault({"kind": "stall", "seconds": 1, "period_s": 10, "duration_s": 60})
    assert (stall.seconds, stall.period_s, stall.duration_s) == (1, 10, 60)
    with pytest.raises(ConfigError):
        parse_fault({"kind": "stall", "seconds": 2, "period_s": 1})
    with pytest.raises(ConfigError):
        parse_fault({"kind": "throttle", "factor": 0})
    state = combine([parse_fault({"kind": "throttle", "factor": 0.5}),
                     parse_fault({"kind": "throttle", "factor": 0.5}),
                     parse_fault({"kind": "errors", "rate": 0.5}),
                     parse_fault({"kind": "errors", "rate": 0.5}),
                     parse_fault({"kind": "hang"})])
    assert state.speed_factor == 0.25
    assert state.error_rate == 0.75
    assert state.hang and not state.crash
    assert not state.slow_link
    link = combine([parse_fault({"kind": "network", "delay_s": 0.2}),
                    parse_fault({"kind": "network", "delay_s": 0.1, "jitter_s": 0.05})])
    assert (link.delay_s, link.jitter_s) == (pytest.approx(0.3), 0.05) and link.slow_link
    with pytest.raises(ConfigError) as err:
        parse_fault({"kind": "network"})
    assert err.value.field == "fault.delay_s"
    with pytest.raises(ConfigError):
        parse_fault({"kind": "network", "delay_s": 0, "jitter_s": 0})


def test_request_parsing() -> None:
    req = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "12345678"}],'
                        b' "stream": true, "stream_options": {"include_usage": true}}',
                        True, ("m",), 256)
    assert (req.prompt_tokens, req.max_tokens, req.explicit_max) == (5, 256, False)
    assert req.stream and req.include_usage
    req = parse_request(b'{"messages": [{"role": "user", "content": [{"type": "text", '
                        b'"text": "abcd"}]}], "max_completion_tokens": 7}', True, ("m",), 256)
    assert (req.model, req.prompt_tokens, req.max_tokens) == ("m", 4, 7)
    assert estimate_prompt_tokens([[1, 2], [3]]) == 3
    assert estimate_prompt_tokens(["abcd", "abcde"]) == 3
    for bad in (b"[1]", b'{"model": "x", "prompt": "a"}', b'{"prompt": {}}',
                b'{"prompt": "a", "max_tokens": true}'):
        with pytest.raises(RequestError):
            parse_request(bad, False, ("m",), 16)


def test_cli_reports_a_bad_fleet_with_exit_code_2(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("nodes:\n  - {id: a, url: 'http://127.0.0.1:1', gpu: A100, models: [m],"
                    " faults: [{kind: throttle}]}\n")
    assert main(["emulate", "--fleet", str(path)]) == 2
    assert "nodes[0].faults[0].factor" in capsys.readouterr().err
    path.write_text("nodes:\n  - {id: a, url: 'http://10.1.1.1:1', gpu: A100, models: [m]}\n")
    assert main(["emulate", "--fleet", str(path)]) == 2
