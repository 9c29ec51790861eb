"""``tailguard epp`` and ``tailguard envoy-config`` as a user runs them."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import yaml
from epp_harness import MODEL, emulated, free_port
from grpc_health.v1 import health_pb2, health_pb2_grpc


def test_epp_process_serves_health_metrics_and_stops_on_sigterm(tmp_path: Path) -> None:
    async def body() -> None:
        async with emulated(["A100"]) as (_, cfg):
            fleet = tmp_path / "fleet.yaml"
            fleet.write_text(yaml.safe_dump({
                "nodes": [{"id": n.id, "url": n.url, "gpu": n.gpu, "models": [MODEL]}
                          for n in cfg.nodes], "pools": {MODEL: {}}}))
            grpc_port, health_port, http_port = free_port(), free_port(), free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "tailguard", "epp", "-c", str(fleet),
                 "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
                 "--grpc-health-port", str(health_port), "--listen", f"127.0.0.1:{http_port}"],
                stderr=subprocess.PIPE, text=True)
            try:
                status = None
                async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    for _ in range(100):
                        try:
                            got = await stub.Check(health_pb2.HealthCheckRequest(
                                service="readiness"), timeout=1)
                            status = got.status
                            if status == health_pb2.HealthCheckResponse.SERVING:
                                break
                        except grpc.aio.AioRpcError:
                            pass
                        await asyncio.sleep(0.1)
                assert status == health_pb2.HealthCheckResponse.SERVING
                async with aiohttp.ClientSession() as s, \
                        s.get(f"http://127.0.0.1:{http_port}/metrics") as r:
                    assert r.status == 200 and "tailguard_node_slots" in await r.text()
                proc.send_signal(signal.SIGTERM)
                _, err = await asyncio.to_thread(proc.communicate, None, 20)
                assert proc.returncode == 0, err
                assert f"ext_proc on 127.0.0.1:{grpc_port}" in err
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_envoy_config_prints_a_bootstrap(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"nodes": [
        {"id": "a", "url": "http://10.0.0.1:8000", "gpu": "A100", "models": ["m"]}]}))
    out = subprocess.run([sys.executable, "-m", "tailguard", "envoy-config", "-c", str(fleet),
                          "--picker", "10.0.0.9:9002", "--failure-mode-allow"],
                         capture_output=True, text=True, check=True).stdout
    boot = yaml.safe_load(out)
    names = [c["name"] for c in boot["static_resources"]["clusters"]]
    assert names == ["engines", "epp"]
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    assert [f["typed_config"].get("failure_mode_allow") for f in filters[:2]] == [True, True]
    bad = subprocess.run([sys.executable, "-m", "tailguard", "epp", "-c", str(fleet),
                          "--objective", "oops"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--objective" in bad.stderr
