"""deploy/: the Kubernetes manifests build with kustomize and match the API's own schema.

No cluster is available here, so each built object is validated by the
models of the official ``kubernetes`` client, generated from the API's OpenAPI
schema (pydantic, strict, unknown keys forbidden): every key a field of its
type, every value of the field's type, every required field present. The
ServiceMonitor (a CRD) is checked by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from kubernetes import client

from tailguard.config.fleet import parse_fleet

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KINDS = {("v1", "ServiceAccount"): "V1ServiceAccount",
         ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
         ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
         ("v1", "ConfigMap"): "V1ConfigMap",
         ("apps/v1", "Deployment"): "V1Deployment",
         ("v1", "Service"): "V1Service",
         ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget"}


def build() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        msg = "kubectl is not installed (apt-get install kubectl)"
        if os.environ.get("REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def check(doc: dict[str, Any], type_name: str) -> None:
    """``doc`` against the client's model ``type_name``: pydantic, strict, no unknown keys."""
    model = getattr(client, type_name)
    try:
        model.model_validate(doc)
    except pydantic.ValidationError as exc:
        raise AssertionError(f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}: "
                             f"{exc}") from None


def test_manifests_build_and_match_the_api_schema() -> None:
    docs = build()
    kinds: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
        assert d["metadata"]["namespace"] == "llm", d["metadata"]
        key = (d["apiVersion"], d["kind"])
        if key in KINDS:
            check(d, KINDS[key])
        else:
            assert key == ("monitoring.coreos.com/v1", "ServiceMonitor"), key
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment",
                          "Service", "PodDisruptionBudget", "ServiceMonitor"}


def test_the_gateway_deployment_is_what_replicas_need() -> None:
    docs = build()

    def one(kind: str, name: str) -> dict[str, Any]:
        found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
        return found[0]

    deploy = one("Deployment", "tailguard")
    spec = deploy["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = spec["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == \
        spec["selector"]["matchLabels"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert pod["serviceAccountName"] == one("ServiceAccount", "tailguard")["metadata"]["name"]
    # the fleet file the pods mount: valid, discovery on, shared through the Redis Service
    cm_name = pod["volumes"][0]["configMap"]["name"]
    fleet_cm = one("ConfigMap", cm_name)
    os.environ["POD_NAME"] = "tailguard-abc"
    try:
        fleet = parse_fleet(yaml.safe_load(fleet_cm["data"]["fleet.yaml"]))
    finally:
        del os.environ["POD_NAME"]
    assert fleet.shared_state is not None and fleet.shared_state.replica == "tailguard-abc"
    redis_svc = one("Service", "tailguard-redis")
    assert f"//{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}/" in \
        fleet.shared_state.url
    assert fleet.discovery is not None
    assert pod["terminationGracePeriodSeconds"] > fleet.shutdown_timeout_s
    # least privilege: read the pods, nothing else
    rules = one("Role", "tailguard")["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    pdb = one("PodDisruptionBudget", "tailguard")
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]
    svc = one("Service", "tailguard")
    assert svc["spec"]["selector"] == spec["selector"]["matchLabels"]
    sm = one("ServiceMonitor", "tailguard")
    assert sm["spec"]["selector"]["matchLabels"] == svc["metadata"]["labels"]
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # the dashboard ConfigMap is deploy/grafana/tailguard.json, for Grafana's sidecar
    dash = one("ConfigMap", "tailguard-grafana-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["tailguard.json"]) == \
        json.loads((DEPLOY / "grafana" / "tailguard.json").read_text())


def test_the_schema_check_catches_mistakes() -> None:
    assert client.V1Service.model_config.get("extra") == "forbid"
    with pytest.raises(AssertionError, match="Extra inputs"):
        check({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"selectr": {}}}, "V1Service")
    with pytest.raises(AssertionError, match="replicas"):
        check({"spec": {"replicas": "two", "selector": {}, "template": {}}}, "V1Deployment")
    with pytest.raises(AssertionError, match="containerPort"):
        check({"spec": {"containers": [{"name": "c", "ports": [{"name": "http"}]}]}}, "V1Pod")
