"""Kubernetes discovery: engines are the pods a label selector matches.

    discovery:
      kubernetes:
        namespace: llm
        selector: app=vllm            # a label selector, as kubectl -l takes it
        port: http                    # a container port's name, or a number
        models: [llama-3.1-8b]        # served models when a pod has no model label

The gateway lists the pods, then watches them from the list's
``resourceVersion`` (``kubernetes_asyncio``, the ``kubernetes`` extra):

* a pod that is Ready, has an IP and is not terminating becomes a node
  (id: the pod's name; url ``http://POD_IP:PORT``), added as the admin API
  adds one, with its own health checks and scrapes;
* a pod that stops being Ready is drained (no new requests) and comes back
  when Ready again; a terminating or deleted pod is retired: drained, then
  removed once its requests finished;
* its GPU: the pod's annotation ``tailguard.io/gpu`` (e.g. ``H100``), else
  its Kubernetes node's NVIDIA GPU feature discovery label
  ``nvidia.com/gpu.product`` (``NVIDIA-H100-80GB-HBM3``); the GPU count (the
  replica's ``tp``) is the pod's ``nvidia.com/gpu`` resource limit, else the
  annotation ``tailguard.io/gpu-count``, else 1;
* its models: the pod label ``tailguard.io/model``, else ``models`` from the
  file, else what the engine's own ``GET /v1/models`` lists, else every pool
  of the file.

With ``inference_pool: NAME`` instead of ``selector`` (and ``port``), the
pods are those of a Gateway API Inference Extension ``InferencePool``
(``inference.networking.k8s.io/v1``): its ``spec.selector.matchLabels`` and
first ``spec.targetPorts`` number, read again at every relist (so an edited
pool takes effect within one watch timeout). The endpoint picker
(``tailguard epp``) then picks among exactly the pool's pods.

A watch that ends (the API server's timeout) resumes from the last
``resourceVersion``; ``410 Gone`` (the version is too old) or an error
relists and reconciles, with a back-off, so an API-server restart loses
nothing. RBAC: ``get``, ``list`` and ``watch`` on ``pods`` in the namespace,
and ``get`` on ``nodes`` only when pods carry no GPU annotation
(``deploy/kubernetes/``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import aiohttp

from tailguard.config.discovery import KubernetesDiscoveryConfig
from tailguard.config.fleet import NodeConfig, parse_node
from tailguard.core.fleet import NodeState
from tailguard.errors import ConfigError

if TYPE_CHECKING:
    from tailguard.adapters.live_fleet import LiveFleet

log = logging.getLogger("tailguard.discovery")

GPU_ANNOTATION = "tailguard.io/gpu"
GPU_COUNT_ANNOTATION = "tailguard.io/gpu-count"
MODEL_LABEL = "tailguard.io/model"
GFD_PRODUCT = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


class KubernetesDiscovery:
    """Keeps the fleet's discovered nodes equal to the selector's Ready pods."""

    def __init__(self, fleet: LiveFleet, cfg: KubernetesDiscoveryConfig) -> None:
        self.fleet = fleet
        self.cfg = cfg
        self.nodes: set[str] = set()  # node ids this discovery added
        self.drained: set[str] = set()  # ... and drained while not Ready
        self._gpu_of_node: dict[str, str | None] = {}  # Kubernetes node -> GFD product
        self._task: asyncio.Task[None] | None = None
        self.port: int | str = cfg.port
        self._api: Any = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubernetes-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        try:
            from kubernetes_asyncio import client, config, watch
            from kubernetes_asyncio.client.exceptions import ApiException
        except ImportError:
            log.error("discovery.kubernetes needs the kubernetes_asyncio package "
                      "(pip install 'tailguard[kubernetes]'); no pods are discovered")
            return
        cfg = self.cfg
        if cfg.kubeconfig is not None:
            await config.load_kube_config(config_file=cfg.kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
        failures = 0
        async with client.ApiClient() as api_client:
            api = client.CoreV1Api(api_client)
            self._api = api
            custom = client.CustomObjectsApi(api_client)
            selector, self.port = cfg.selector, cfg.port
            while True:
                try:
                    if cfg.inference_pool is not None:
                        selector, self.port = await self._pool(custom)
                    pods = await api.list_namespaced_pod(cfg.namespace, label_selector=selector)
                    await self._reconcile(pods.items)
                    version = pods.metadata.resource_version
                    if failures:
                        log.info("discovery: the API server answers again")
                    failures = 0
                    while True:  # watch, resuming where the last watch ended
                        w = watch.Watch()
                        async with w.stream(api.list_namespaced_pod, cfg.namespace,
                                            label_selector=selector,
                                            resource_version=version,
                                            timeout_seconds=cfg.watch_timeout_s) as stream:
                            async for ev in stream:
                                await self._on_event(ev["type"], ev["object"])
                        version = w.resource_version or version
                except asyncio.CancelledError:
                    raise
                except ApiException as exc:
                    if exc.status == 410:  # the version is gone: list again
                        log.info("discovery: watch expired (410); relisting")
                        continue
                    failures = self._failed(failures, f"API error {exc.status}: {exc.reason}")
                except Exception as exc:  # a dropped connection, an API server restarting
                    failures = self._failed(failures, f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])

    async def _pool(self, custom: Any) -> tuple[str, int | str]:
        """The InferencePool's label selector and target port."""
        cfg = self.cfg
        pool = await custom.get_namespaced_custom_object(
            "inference.networking.k8s.io", "v1", cfg.namespace, "inferencepools",
            cfg.inference_pool)
        spec = pool.get("spec", {})
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        if not labels:
            raise ValueError(f"InferencePool {cfg.inference_pool} has no selector.matchLabels")
        ports = spec.get("targetPorts") or []
        port: int | str = cfg.port or (int(ports[0]["number"]) if ports else 0)
        if not port:
            raise ValueError(f"InferencePool {cfg.inference_pool} has no targetPorts")
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), port

    def _failed(self, failures: int, why: str) -> int:
        if failures == 0:
            log.warning("discovery: %s; the fleet stays as it is, retrying", why)
        return failures + 1

    # -- pods to nodes ---------------------------------------------------------------

    async def _reconcile(self, pods: list[Any]) -> None:
        seen = set()
        for pod in pods:
            seen.add(pod.metadata.name)
            await self._apply(pod)
        for node_id in list(self.nodes - seen):  # deleted while nobody watched
            self._retire(node_id)

    async def _on_event(self, kind: str, pod: Any) -> None:
        if kind == "DELETED":
            self._retire(pod.metadata.name)
        elif kind in ("ADDED", "MODIFIED"):
            await self._apply(pod)

    async def _apply(self, pod: Any) -> None:
        name = pod.metadata.name
        fleet = self.fleet
        if pod.metadata.deletion_timestamp is not None:
            self._retire(name)
            return
        ready = _ready(pod) and bool(pod.status and pod.status.pod_ip)
        if name in self.nodes and name in fleet.nodes and not fleet.retiring(name):
            if not ready and name not in self.drained:
                log.info("discovery: pod %s is not ready; draining it", name)
                fleet.set_state(name, NodeState.DRAINING, shared=False)
                self.drained.add(name)
            elif ready and name in self.drained:
                log.info("discovery: pod %s is ready again", name)
                fleet.set_state(name, NodeState.HEALTHY, shared=False)
                self.drained.discard(name)
            return
        if not ready or name in fleet.nodes:
            return  # not yet; or a node of the file (or the admin API) with the same name
        node = await self._node(pod)
        if node is None:
            return
        fleet.add_node(node, dynamic=True)
        self.nodes.add(name)

    def _retire(self, name: str) -> None:
        if name in self.nodes:
            log.info("discovery: pod %s is gone; retiring it", name)
            self.nodes.discard(name)
            self.drained.discard(name)
            self.fleet.retire(name)

    async def _node(self, pod: Any) -> NodeConfig | None:
        name = pod.metadata.name
        port = _port(pod, self.port)
        if port is None:
            log.warning("discovery: pod %s has no container port %r; skipped", name,
                        self.port)
            return None
        annotations = pod.metadata.annotations or {}
        labels = pod.metadata.labels or {}
        gpu = annotations.get(GPU_ANNOTATION)
        count = _int(annotations.get(GPU_COUNT_ANNOTATION)) or _gpu_limit(pod)
        if gpu is None and pod.spec.node_name:
            gpu = await self._node_gpu(pod.spec.node_name)
        model = labels.get(MODEL_LABEL)
        url = f"http://{pod.status.pod_ip}:{port}"
        models = [model] if model else list(self.cfg.models) or await _served_models(url) \
            or list(self.fleet.config.pools)
        if not models:
            log.warning("discovery: pod %s names no model (label %s) and the file has no "
                        "pool; skipped", name, MODEL_LABEL)
            return None
        raw = {"id": name, "url": url, "gpu": gpu or "unknown",
               "models": models, "tp": count or 1,
               "labels": {"pod": name, "k8s_node": pod.spec.node_name or ""}}
        try:
            return parse_node(raw, f"pod {name}", self.fleet.config.catalog, warnings=[])
        except ConfigError as exc:
            log.warning("discovery: pod %s: %s; skipped", name, exc)
            return None

    async def _node_gpu(self, node_name: str) -> str | None:
        """The GPU product a Kubernetes node's GPU feature discovery labels name."""
        if node_name not in self._gpu_of_node:
            gpu = None
            try:
                node = await self._api.read_node(node_name)
                gpu = (node.metadata.labels or {}).get(GFD_PRODUCT)
            except Exception as exc:  # no RBAC for nodes, or no such node
                log.warning("discovery: cannot read node %s (%s); annotate pods with %s",
                            node_name, exc, GPU_ANNOTATION)
            self._gpu_of_node[node_name] = gpu
        return self._gpu_of_node[node_name]


async def _served_models(url: str, timeout_s: float = 2.0) -> list[str]:
    """The engine's own ``GET /v1/models`` (empty if it does not answer in time)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
                s.get(url + "/v1/models") as r:
            doc = await r.json(content_type=None) if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.info("discovery: %s/v1/models: %s", url, exc)
        return []
    data = doc.get("data") if isinstance(doc, dict) else None
    return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]


def _ready(pod: Any) -> bool:
    for c in (pod.status.conditions or []) if pod.status else []:
        if c.type == "Ready":
            return bool(c.status == "True")
    return False


def _port(pod: Any, want: int | str) -> int | None:
    if isinstance(want, int):
        return want
    for c in pod.spec.containers or []:
        for p in c.ports or []:
            if p.name == want:
                return int(p.container_port)
    return None


def _gpu_limit(pod: Any) -> int | None:
    total = 0
    for c in pod.spec.containers or []:
        limits = (c.resources.limits if c.resources else None) or {}
        total += _int(limits.get(GPU_RESOURCE)) or 0
    return total or None


def _int(raw: Any) -> int | None:
    try:
        v = int(raw)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


__all__ = ["KubernetesDiscovery"]
