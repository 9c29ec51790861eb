"""Kubernetes discovery with the real kubernetes_asyncio client against a local API stand-in.

No cluster here (Debian has no kube-apiserver), so a small aiohttp server on
127.0.0.1 speaks the two calls discovery makes: list and watch pods (with
``resourceVersion``, ``410 Gone`` once a version is compacted away, and
dropped connections as an API-server restart drops them) and get a node. The
pods point at real emulated engines; the gateway serves through them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tailguard.config.fleet import parse_fleet
from tailguard.core.fleet import NodeState
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.errors import ConfigError
from tailguard.gateway.app import RunningGateway, run_gateway

pytest.importorskip("kubernetes_asyncio")

MODEL = "m"
NS = "llm"


class FakeApiServer:
    """Pods in one namespace, with versions, watches and node labels."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self.oldest = 0  # versions below this are compacted: a watch from them gets 410
        self.watchers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.nodes = {"gpu-node-1": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
        self.lists = 0
        self.watches = 0
        self.closed = False
        self.pools: dict[str, dict[str, Any]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self.pods_route)
        app.router.add_get("/api/v1/nodes/{name}", self.node_route)
        app.router.add_get(
            f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/{{name}}",
            self.pool_route)
        return app

    async def pool_route(self, request: web.Request) -> web.Response:
        pool = self.pools.get(request.match_info["name"])
        if pool is None:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound",
                                      "message": "no such pool"}, status=404)
        return web.json_response(pool)

    def _emit(self, kind: str, pod: dict[str, Any]) -> None:
        for q in self.watchers:
            q.put_nowait({"type": kind, "object": pod})

    def put(self, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        kind = "MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED"
        self.pods[pod["metadata"]["name"]] = pod
        self._emit(kind, pod)

    def delete(self, name: str) -> None:
        self.rv += 1
        pod = self.pods.pop(name)
        self._emit("DELETED", pod)

    def drop_watches(self) -> None:
        """An API-server restart: every watch connection ends."""
        for q in self.watchers:
            q.put_nowait(None)

    def compact(self) -> None:
        """Old versions are gone: watches resuming from them get 410."""
        self.oldest = self.rv + 1
        self.drop_watches()

    async def node_route(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.nodes:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response({"kind": "Node", "apiVersion": "v1",
                                  "metadata": {"name": name, "labels": self.nodes[name]}})

    async def pods_route(self, request: web.Request) -> web.StreamResponse:
        wanted = [term.partition("=")[::2]
                  for term in request.query.get("labelSelector", "").split(",") if term]

        def match(pod: dict[str, Any]) -> bool:
            labels = pod["metadata"].get("labels", {})
            return all(labels.get(k) == v for k, v in wanted)

        if request.query.get("watch") not in ("true", "True", "1"):
            self.lists += 1
            return web.json_response({
                "kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": [p for p in self.pods.values() if match(p)]})
        self.watches += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        since = int(request.query.get("resourceVersion", "0") or 0)
        if since < self.oldest:
            await resp.write(json.dumps({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                "reason": "Expired", "message": "too old resource version"}}).encode() + b"\n")
            return resp
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        if self.closed:
            return resp
        self.watchers.append(q)
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    break
                if match(ev["object"]):
                    await resp.write(json.dumps(ev).encode() + b"\n")
        finally:
            self.watchers.remove(q)
        return resp


def pod(name: str, port: int, *, ready: bool = True, gpu: str | None = None,
        node: str = "gpu-node-1", deleting: bool = False, gpus: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS,
                            "labels": {"app": "engine", "tailguard.io/model": MODEL}}
    if gpu:
        meta["annotations"] = {"tailguard.io/gpu": gpu}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta,
            "spec": {"nodeName": node, "containers": [{
                "name": "engine", "ports": [{"name": "http", "containerPort": port}],
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"podIP": "127.0.0.1", "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@asynccontextmanager
async def stack(tmp_path: Path, n: int = 3, discovery: dict[str, Any] | None = None,
                api: FakeApiServer | None = None) -> AsyncIterator[
                    tuple[FakeApiServer, RunningGateway, dict[str, int]]]:
    api = api or FakeApiServer()
    runner = web.AppRunner(api.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "u"}}]}))
    # e2 serves a second model: a pod without a model label gets both from its /v1/models
    engines = [EmulatedNode(f"e{i}", "A100", models=(MODEL, "other") if i == 2 else (MODEL,))
               for i in range(n)]
    try:
        async with run_emulator(engines, speed=50) as emu:
            ports = {e.id: int(emu.urls[e.id].rsplit(":", 1)[1]) for e in engines}
            cfg = parse_fleet({"listen": "127.0.0.1:0", "pools": {MODEL: {}},
                               "health": {"interval_s": 0.2},
                               "discovery": {"kubernetes": {
                                   "namespace": NS, "kubeconfig": str(kubeconfig),
                                   "watch_timeout_s": 30,
                                   **(discovery or {"selector": "app=engine", "port": "http"})}}})
            async with run_gateway(cfg) as gw:
                yield api, gw, ports
    finally:
        api.closed = True
        api.drop_watches()  # the handlers blocked on their queues end
        await runner.cleanup()


async def wait_for(cond: Any, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def chat(gw: RunningGateway) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 3}) as r:
        await r.read()
        return r.status, r.headers.get("x-tailguard-node", "")


def test_pods_become_nodes_and_leave_cleanly(tmp_path: Path) -> None:
    async def body() -> None:
        async with stack(tmp_path) as (api, gw, ports):
            fleet = gw.fleet
            api.put(pod("p0", ports["e0"]))  # GPU from its node's GFD label
            api.put(pod("p1", ports["e1"], gpu="L4"))  # GPU from its annotation
            unlabelled = pod("p2", ports["e2"], ready=False)  # not ready: not yet
            del unlabelled["metadata"]["labels"]["tailguard.io/model"]  # its /v1/models says
            api.put(unlabelled)
            await wait_for(lambda: {"p0", "p1"} <= set(fleet.nodes), "two pods discovered")
            assert "p2" not in fleet.nodes
            assert fleet.nodes["p0"].gpu_class == "H100-SXM"
            assert fleet.nodes["p1"].gpu_class == "L4"
            assert fleet.nodes["p0"].url == f"http://127.0.0.1:{ports['e0']}"
            assert fleet.nodes["p0"].models == (MODEL,)
            served = {(await chat(gw))[1] for _ in range(6)}
            assert served <= {"p0", "p1"} and served
            unlabelled = pod("p2", ports["e2"])  # ready now
            del unlabelled["metadata"]["labels"]["tailguard.io/model"]
            api.put(unlabelled)
            await wait_for(lambda: "p2" in fleet.nodes, "p2 once ready")
            assert fleet.nodes["p2"].models == (MODEL, "other")
            api.put(pod("p1", ports["e1"], gpu="L4", ready=False))  # not ready: drained
            await wait_for(lambda: fleet.balancer.nodes["p1"].state is NodeState.DRAINING,
                           "p1 drained")
            api.put(pod("p1", ports["e1"], gpu="L4"))  # and back
            await wait_for(lambda: fleet.balancer.nodes["p1"].state.routable, "p1 back")
            api.put(pod("p0", ports["e0"], deleting=True))  # terminating: retired
            await wait_for(lambda: "p0" not in fleet.nodes, "p0 removed")
            api.delete("p2")
            await wait_for(lambda: "p2" not in fleet.nodes, "p2 removed")
            assert set(fleet.nodes) == {"p1"}
            assert (await chat(gw)) == (200, "p1")

    asyncio.run(asyncio.wait_for(body(), 60))


def test_watch_resumes_after_a_restart_and_relists_after_410(tmp_path: Path) -> None:
    async def body() -> None:
        async with stack(tmp_path) as (api, gw, ports):
            fleet = gw.fleet
            api.put(pod("p0", ports["e0"], gpu="A100"))
            await wait_for(lambda: "p0" in fleet.nodes and len(api.watchers) == 1, "p0, watched")
            lists = api.lists
            api.drop_watches()  # the API server restarts: the watch resumes, no relist
            await wait_for(lambda: api.watches >= 2, "a second watch")
            api.put(pod("p1", ports["e1"], gpu="A100"))
            await wait_for(lambda: "p1" in fleet.nodes, "p1 after the restart")
            assert api.lists == lists
            # While nobody watches, p0 is deleted and the history compacted: 410, relist.
            await wait_for(lambda: len(api.watchers) == 1, "the watch resumed")
            api.pods.pop("p0")
            api.compact()
            await wait_for(lambda: api.lists > lists, "a relist after 410")
            await wait_for(lambda: "p0" not in fleet.nodes, "p0 reconciled away")
            assert "p1" in fleet.nodes

    asyncio.run(asyncio.wait_for(body(), 60))


def test_an_inference_pool_names_the_pods_and_their_port(tmp_path: Path) -> None:
    async def body() -> None:
        api = FakeApiServer()
        async with stack(tmp_path, 2, {"inference_pool": "llama-pool"}, api) as (_, gw, ports):
            await asyncio.sleep(0.3)  # no pool yet: discovery retries, the gateway serves on
            assert not gw.fleet.nodes
            api.pools["llama-pool"] = {
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "llama-pool", "namespace": NS},
                "spec": {"selector": {"matchLabels": {"app": "engine", "tier": "a"}},
                         "targetPorts": [{"number": ports["e0"]}],
                         "endpointPickerRef": {"name": "tailguard-epp"}}}
            inside = pod("p0", 1, gpu="H100")
            inside["metadata"]["labels"]["tier"] = "a"
            api.put(inside)
            api.put(pod("p1", ports["e1"], gpu="H100"))  # not the pool's: no tier label
            await wait_for(lambda: "p0" in gw.fleet.nodes, "the pool's pod", timeout=20)
            assert gw.fleet.nodes["p0"].url == f"http://127.0.0.1:{ports['e0']}"  # targetPorts
            assert "p1" not in gw.fleet.nodes
            assert (await chat(gw)) == (200, "p0")

    asyncio.run(asyncio.wait_for(body(), 60))


def test_discovery_keys_are_checked() -> None:
    base = {"namespace": "n", "selector": "a=b", "port": 8000}
    parse_fleet({"discovery": {"kubernetes": base}})
    for bad, field in ((dict(base, port=True), "port"), (dict(base, selector=""), "selector"),
                       (dict(base, color=1), "color"), ({"namespace": "n"}, "selector")):
        with pytest.raises(ConfigError, match=field):
            parse_fleet({"discovery": {"kubernetes": bad}})
    with pytest.raises(ConfigError, match="discovery"):
        parse_fleet({"discovery": {"consul": {}}})
    pool = parse_fleet({"discovery": {"kubernetes": {"namespace": "n", "inference_pool": "p"}}})
    assert pool.discovery is not None and pool.discovery.port == 0  # the pool's targetPorts
    with pytest.raises(ConfigError, match="selector"):
        parse_fleet({"discovery": {"kubernetes": {"namespace": "n", "inference_pool": "p",
                                                  "selector": "a=b"}}})
