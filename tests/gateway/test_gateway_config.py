"""The fleet file: the documented shape loads, errors name their field, the CLI exits 2."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from tailguard.cli import main
from tailguard.config.fleet import (
    DEFAULT_MAX_BODY_BYTES,
    AdminConfig,
    load_fleet,
    parse_fleet,
    parse_listen,
)
from tailguard.errors import ConfigError

EXAMPLE = """\
listen: 127.0.0.1:8080
nodes:
  - {id: h100-0, url: http://127.0.0.1:8101, gpu: H100-SXM, models: [llama-3.1-8b]}
  - {id: l4-0, url: http://127.0.0.1:8102, gpu: L4, tp: 1, models: [llama-3.1-8b], engine: vllm, labels: {zone: a}}
pools:
  llama-3.1-8b: {policy: tailguard, slo: {ttft_s: 2.0, tpot_s: 0.1}}
admin: {token_env: TAILGUARD_ADMIN_TOKEN}
"""


def test_example_from_the_issue_loads(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(EXAMPLE)
    cfg = load_fleet(path)
    assert cfg.listen == ("127.0.0.1", 8080)
    assert [n.id for n in cfg.nodes] == ["h100-0", "l4-0"]
    h100, l4 = cfg.nodes
    assert h100.gpu_spec is not None and h100.gpu_spec.name == "H100-SXM"
    assert h100.engine is None  # detected at run time
    assert l4.engine == "vllm" and dict(l4.labels) == {"zone": "a"} and l4.tp == 1
    pool = cfg.pools["llama-3.1-8b"]
    assert pool.policy == "tailguard" and pool.slo.ttft_s == 2.0 and pool.slo.tpot_s == 0.1
    assert cfg.admin.token_env == "TAILGUARD_ADMIN_TOKEN"
    assert cfg.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 8 * 1024 * 1024
    assert cfg.scrape.interval_s == 0.5 and cfg.scrape.stale_s == 2.0
    assert cfg.path == path.resolve()
    assert cfg.warnings == ()
    spec = l4.spec()
    assert spec.gpu is not None and spec.gpu.name == "L4" and spec.models == ("llama-3.1-8b",)


def _node(**kw: Any) -> dict[str, Any]:
    return {"id": "n0", "url": "http://10.0.0.1:8000", "gpu": "L4", "models": ["m"], **kw}


@pytest.mark.parametrize(("gpu", "expected"), [
    ("H100", "H100-SXM"),
    ("A100", "A100-80GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("Tesla T4", "T4"),
])
def test_gpu_aliases(gpu: str, expected: str) -> None:
    cfg = parse_fleet({"nodes": [_node(gpu=gpu)]})
    spec = cfg.nodes[0].gpu_spec
    assert spec is not None and spec.name == expected


def test_unknown_gpu_is_served_with_a_warning() -> None:
    cfg = parse_fleet({"nodes": [_node(gpu="Gaudi3")]})
    assert cfg.nodes[0].gpu_spec is None and cfg.nodes[0].gpu_class == "Gaudi3"
    assert len(cfg.warnings) == 1 and "nodes[0].gpu" in cfg.warnings[0]


def test_unknown_model_is_served_and_catalog_model_names_its_prior() -> None:
    cfg = parse_fleet({"nodes": [_node(models=["my-finetune"])],
                       "pools": {"my-finetune": {"catalog_model": "llama-3.1-8b"}}})
    assert cfg.models == ["my-finetune"]
    assert cfg.pool("my-finetune").catalog_model == "llama-3.1-8b"
    assert cfg.pool("other").policy == "tailguard"  # defaults for pools not in the file


def test_all_optional_keys() -> None:
    cfg = parse_fleet({
        "listen": 9000,
        "nodes": [_node(weight=2.0, max_num_seqs=64, api_key_env="K",
                        faults=[{"kind": "throttle", "at_s": 5, "factor": 0.4}],
                        emulator={"speed": 2})],
        "pools": {"m": {"policy": "p2c", "timeouts": {"connect_s": 0.5, "first_byte_s": 3,
                                                      "idle_s": 4, "total_s": 60},
                        "retries": {"attempts": 2, "budget": 0.1, "min_per_s": 1}}},
        "api_keys": ["k1", "k2"],
        "max_body_bytes": 1024,
        "scrape": {"interval_s": 1, "stale_s": 5, "path": "/m"},
        "health": {"interval_s": 3, "path": "/healthz", "failures": 3},
        "admin": {"token_env": "T", "allow": ["10.0.0.0/8", "gpu-host"]},
        "reload": {"poll_s": 0},
        "x-note": "free annotation",
    })
    n = cfg.nodes[0]
    assert cfg.listen == ("127.0.0.1", 9000)
    assert n.weight == 2.0 and n.max_num_seqs == 64 and n.faults[0].factor == 0.4
    assert n.emulator.speed == 2
    p = cfg.pool("m")
    assert p.timeouts.first_byte_s == 3 and p.retries.attempts == 2 and p.retries.budget == 0.1
    assert cfg.api_keys == ("k1", "k2") and cfg.max_body_bytes == 1024
    assert cfg.scrape.path == "/m" and cfg.health.failures == 3 and cfg.reload_poll_s == 0


def test_api_keys_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_KEYS", "a, b")
    assert parse_fleet({"api_keys_env": "GW_KEYS"}).api_keys == ("a", "b")
    monkeypatch.delenv("GW_KEYS")
    with pytest.raises(ConfigError) as err:
        parse_fleet({"api_keys_env": "GW_KEYS"})
    assert err.value.field == "api_keys_env"


@pytest.mark.parametrize(("doc", "field"), [
    ({"nodes": [_node(gpu=None)]}, "nodes[0].gpu"),
    ({"nodes": [_node(url="ftp://x")]}, "nodes[0].url"),
    ({"nodes": [_node(url="not a url")]}, "nodes[0].url"),
    ({"nodes": [_node(models=[])]}, "nodes[0].models"),
    ({"nodes": [_node(tp=0)]}, "nodes[0].tp"),
    ({"nodes": [_node(engine="ollama")]}, "nodes[0].engine"),
    ({"nodes": [_node(gpus="L4")]}, "nodes[0].gpus"),
    ({"nodes": [_node(), _node()]}, "nodes[1].id"),
    ({"nodes": "n0"}, "nodes"),
    ({"pools": {"m": {"policy": "fastest"}}}, "pools.m.policy"),
    ({"pools": {"m": {"policy_options": {"bogus": 1}}}}, "pools.m.policy_options.bogus"),
    ({"pools": {"m": {"policy_options": {"sample": 1}}}}, "pools.m.policy_options.sample"),
    ({"pools": {"m": {"policy_options": {"queue_weight": -1.0}}}},
     "pools.m.policy_options.queue_weight"),
    ({"pools": {"m": {"policy_options": {"ttft_weight": "fast"}}}},
     "pools.m.policy_options.ttft_weight"),
    ({"pools": {"m": {"policy": "round_robin", "policy_options": {"sample": 2}}}},
     "pools.m.policy_options.sample"),
    ({"pools": {"m": {"policy": "cache_aware", "policy_options": {"cache_threshold": 2.0}}}},
     "pools.m.policy_options.cache_threshold"),
    ({"pools": {"m": {"policy": "consistent_hash", "policy_options": {"replicas": 0}}}},
     "pools.m.policy_options.replicas"),
    ({"pools": {"m": {"slo": {"ttft_s": -1}}}}, "pools.m.slo.ttft_s"),
    ({"pools": {"m": {"slo": {"tpot_s": float("nan")}}}}, "pools.m.slo.tpot_s"),  # passed > 0
    ({"pools": {"m": {"timeouts": {"total_s": float("inf")}}}}, "pools.m.timeouts.total_s"),
    ({"pools": {"m": {"catalog_model": "gpt-17"}}}, "pools.m.catalog_model"),
    ({"pools": {"m": {"timeouts": {"idle": 3}}}}, "pools.m.timeouts.idle"),
    ({"pools": {"m": {"retries": {"budget": 2}}}}, "pools.m.retries.budget"),
    ({"listen": "localhost:http"}, "listen"),
    ({"max_body_bytes": "8M"}, "max_body_bytes"),
    ({"admin": {"allow": ["10.0.0.0/33"]}}, "admin.allow[0]"),
    ({"scrape": {"path": "metrics"}}, "scrape.path"),
    ({"listne": "x"}, "listne"),
])
def test_errors_name_the_field(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_fleet(doc)
    assert err.value.field == field, str(err.value)


def test_unknown_policy_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as err:
        parse_fleet({"pools": {"m": {"policy": "fastest"}}})
    assert err.value.allowed is not None and "tailguard" in err.value.allowed


@pytest.mark.parametrize(("raw", "expected"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    (":9000", ("0.0.0.0", 9000)),
    ("[::1]:8080", ("::1", 8080)),
    (8081, ("127.0.0.1", 8081)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
])
def test_listen_forms(raw: Any, expected: tuple[str, int]) -> None:
    assert parse_listen(raw) == expected


def test_admin_allow_list() -> None:
    admin = AdminConfig("T", ("10.0.0.0/8", "gpu-host", "::1/128"))
    assert admin.url_allowed("http://10.1.2.3:8000")
    assert admin.url_allowed("http://GPU-HOST:8000")
    assert admin.url_allowed("http://[::1]:8000")
    assert not admin.url_allowed("http://169.254.169.254/latest")
    assert not admin.url_allowed("http://gpu-host.evil.com:8000")
    assert not AdminConfig("T", ()).url_allowed("http://10.1.2.3:8000")


def test_cli_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent("""\
        nodes:
          - {id: a, url: http://127.0.0.1:1, gpu: L4, models: [m], tp: zero}
        """))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nodes[0].tp" in err and "Traceback" not in err
    path.write_text("nodes: [unclosed\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
