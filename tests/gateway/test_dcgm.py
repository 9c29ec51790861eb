"""GPU telemetry from DCGM exporter pages: the parser, and the gateway scraping an emulator's.

The fixture's first block is dcgm-exporter's own README sample (its spaces
after commas, empty Kubernetes labels and the blank value DCGM writes for a
missing reading, 9223372036854775794); the second has the labels of a
current exporter (modelName, pci_bus_id, the driver version) as a GPU
Operator install prints them, with a thermally throttled L40S.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from tailguard.adapters.dcgm import DcgmError, gpu_mismatch, parse_dcgm
from tailguard.config.fleet import parse_fleet, parse_node
from tailguard.core.events import Event
from tailguard.emulator import EmulatedNode, parse_fault, run_emulator
from tailguard.gateway.app import run_gateway

FIXTURE = Path(__file__).parent / "fixtures" / "dcgm_exporter.txt"


def test_parser_reads_a_real_page_and_ignores_blank_readings() -> None:
    g0, g1 = parse_dcgm(FIXTURE.read_text())
    assert (g0.index, g0.uuid, g0.sm_clock_mhz, g0.power_w) == \
        (0, "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52", 139.0, 23.528)
    assert g0.temp_c is None  # DCGM's blank, not 9.2e18 degrees
    assert g0.throttle_reasons == 1 and g0.slowdowns() == []  # idle is no slowdown
    assert g0.cause() is None
    assert g1.model == "NVIDIA L40S" and g1.clock_ratio == pytest.approx(1185 / 2520)
    assert g1.slowdowns() == ["hardware thermal slowdown"]
    assert g1.cause(2) == "GPU 1 of 2: hardware thermal slowdown, SM clock 1.19 of 2.52 GHz"
    assert g1.fb_used_mib == 41210 and g1.xid == 0
    with pytest.raises(DcgmError):
        parse_dcgm("vllm:num_requests_running 3\n")


def test_mismatch_with_the_fleet_file_is_named() -> None:
    gpus = parse_dcgm(FIXTURE.read_text())
    as_written = parse_node({"id": "a", "url": "http://x:1", "gpu": "H100", "models": ["m"],
                             "tp": 1}, "n")
    problem = gpu_mismatch(as_written, gpus)
    assert problem is not None and "2 GPUs" in problem and "L40S" in problem
    right = parse_node({"id": "a", "url": "http://x:1", "gpu": "L40S", "models": ["m"],
                        "tp": 2}, "n")
    assert gpu_mismatch(right, gpus) is None


def test_gateway_shows_an_emulated_nodes_gpus_and_names_the_throttled_one() -> None:
    os.environ["TG_TEST_DCGM_TOKEN"] = "tok"

    async def body() -> None:
        node = EmulatedNode("h0", "H100", models=("m",), tp=2)
        async with run_emulator([node]) as emu:
            url = emu.urls["h0"]
            cfg = parse_fleet({"listen": "127.0.0.1:0", "admin": {"token_env": "TG_TEST_DCGM_TOKEN"},
                               "nodes": [{"id": "h0", "url": url, "gpu": "A100", "tp": 2,
                                          "models": ["m"], "dcgm_url": url + "/dcgm"}]})
            async with run_gateway(cfg) as gw, aiohttp.ClientSession() as s:
                async def telemetry() -> dict[str, object]:
                    async with s.get(gw.url + "/admin/nodes",
                                     headers={"Authorization": "Bearer tok"}) as r:
                        nodes = (await r.json())["nodes"]
                    t = nodes[0]["telemetry"]
                    assert isinstance(t, dict)
                    return t

                mon = gw.fleet.monitors["h0"]
                for _ in range(100):
                    if mon.gpus:
                        break
                    await asyncio.sleep(0.05)
                t = await telemetry()
                assert [g["gpu"] for g in t["gpus"]] == [0, 1]  # type: ignore[index]
                assert t["cause"] is None
                # a slow replica whose GPUs are all fine: the cause is elsewhere
                ev = gw.fleet._with_gpu_cause(Event(1.0, "h0", "state", "degraded", "slow"))
                assert ev.cause == "gpus_healthy"
                assert ev.advice.startswith("its GPUs are healthy: restart the engine")
                assert ev.reason == ("slow; all 2 GPUs healthy (DCGM): the engine, host or "
                                     "network then")
                assert "H100" in str(t["warning"])  # the file said A100
                emu.server("h0").inject(parse_fault({"kind": "throttle", "factor": 0.5,
                                                     "duration_s": 30}))
                await mon.dcgm_once()
                t = await telemetry()
                assert t["cause"] == "GPU 0 of 2: hardware thermal slowdown, SM clock 0.99 of " \
                                     "1.98 GHz"
                async with s.get(gw.url + "/metrics") as r:
                    page = await r.text()
                assert ('tailguard_gpu_slowdown{gpu="0",model="NVIDIA H100 80GB HBM3",node="h0",'
                        'reason="hardware thermal slowdown"} 1.0') in page
                assert 'tailguard_gpu_sm_clock_ratio{gpu="1"' in page
                # A detector event about the node names the GPU behind it.
                ev = gw.fleet._with_gpu_cause(Event(1.0, "h0", "state", "degraded",
                                                    "slow: decode 1.9x its peers"))
                assert ev.reason == ("slow: decode 1.9x its peers; GPU 0 of 2: hardware "
                                     "thermal slowdown, SM clock 0.99 of 1.98 GHz")
                assert ev.cause == "gpu_throttle"  # what remediation rules match on
                assert ev.advice.startswith("GPU 0 of 2 is throttling") and "--exclude" in ev.advice
                # One GPU of the pair throttled: it alone is named; the replica runs at its pace.
                server = emu.server("h0")
                server.clear_faults()
                server.inject(parse_fault({"kind": "throttle", "factor": 0.4, "gpu_index": 1,
                                           "duration_s": 30}))
                assert server._state.speed_factor == pytest.approx(0.4)
                await mon.dcgm_once()
                t = await telemetry()
                assert t["cause"] == "GPU 1 of 2: hardware thermal slowdown, SM clock 0.79 of " \
                                     "1.98 GHz"
                slow = [g["gpu"] for g in t["gpus"] if g["slowdowns"]]  # type: ignore[index]
                assert slow == [1]
                async with s.get(gw.url + "/dashboard/state") as r:  # the dashboard's feed
                    card = (await r.json())["nodes"][0]
                assert [g["gpu"] for g in card["gpus"] if g["slowdowns"]] == [1]
                assert card["gpu_cause"].startswith("GPU 1 of 2")
                async with s.post(url + "/admin/faults",
                                  json={"kind": "throttle", "factor": 0.5, "gpu_index": 2}) as r:
                    assert r.status == 400  # a replica of two has no GPU 2

    asyncio.run(asyncio.wait_for(body(), 30))
