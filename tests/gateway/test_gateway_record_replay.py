"""Record a live run on emulated engines, replay it offline: zero differing decisions.

This is the parity test of the design: the gateway and the offline replayer
(the same core the simulator drives) make the same decisions from the same
inputs. The recording also serves as a simulator workload.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from openai import AsyncOpenAI, RateLimitError

from tailguard.cli import main
from tailguard.config.fleet import parse_fleet
from tailguard.core.replay import replay
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.gateway.app import run_gateway
from tailguard.gateway.recording import read_decisions
from tailguard.traffic.workload import read_trace

MODEL = "llama-3.1-8b"


async def live_run(record: Path) -> int:
    nodes = [EmulatedNode("h100-0", "H100", models=(MODEL,)),
             EmulatedNode("a100-0", "A100", models=(MODEL,)),
             EmulatedNode("l4-0", "L4", models=(MODEL,))]
    async with run_emulator(nodes, speed=20.0) as emu:
        fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: {"policy": "tailguard"}},
            "scrape": {"interval_s": 0.1},
        })
        async with run_gateway(fleet, record=record) as gw:
            client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

            async def one(i: int) -> None:
                await asyncio.sleep(0.01 * i)
                words = "tell me about GPUs " * (5 + (i * 37) % 200)
                if i % 3:
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": words}],
                        max_tokens=8 + i % 40, stream=True)
                    async for _ in stream:
                        pass
                else:
                    await client.completions.create(model=MODEL, prompt=words,
                                                    max_tokens=8 + i % 40)

            await asyncio.gather(*(one(i) for i in range(60)))
            await client.close()
            await asyncio.sleep(0.3)  # a few ticks and scrapes with the fleet idle
            # Take a node out by hand: operator actions are inputs too.
            gw.fleet.balancer.set_state("l4-0", gw.fleet.balancer.nodes["l4-0"].state)
    return 60


def test_recorded_live_run_replays_with_zero_differences(tmp_path: Path) -> None:
    record = tmp_path / "decisions.jsonl"
    sent = asyncio.run(live_run(record))
    records = read_decisions(record)
    ops = {r["op"] for r in records}
    assert {"init", "add_pool", "add_node", "pick", "first_token", "no_first_token", "finish",
            "tick", "engine_metrics"} <= ops
    result = replay(records)
    assert result.decisions >= sent
    assert result.differences == []
    # The CLI says the same, and exits 0.
    assert main(["replay", str(record)]) == 0
    # A tampered recording is caught (exit 1).
    picks = [i for i, r in enumerate(records) if r["op"] == "pick"]
    records[picks[5]]["node"] = "elsewhere"
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["replay", str(tampered)]) == 1


def test_recording_is_a_simulator_workload(tmp_path: Path) -> None:
    record = tmp_path / "decisions.jsonl"
    asyncio.run(live_run(record))
    reqs = read_trace(record)
    assert len(reqs) == 60
    assert reqs.arrival_s[0] == 0.0 and reqs.arrival_s == sorted(reqs.arrival_s)
    # Answer lengths are what the gateway counted: exact for non-streamed
    # answers (usage), up to two high for streams without a usage chunk (the
    # role-only first event and the finish event; see adapters/sse.py).
    assert all(8 <= n <= 47 + 2 for n in reqs.output_tokens)
    assert sum(reqs.input_tokens) > 60 * 10


async def live_admission_run(record: Path) -> tuple[int, int]:
    """A pool with a fixed limit of 2 per node and a short queue, offered 40 streams
    at once in three priorities: tickets, queue places, 429s and dispatches from the
    queue, all through the real gateway. Returns (answered, shed)."""
    nodes = [EmulatedNode("a100-0", "A100", models=(MODEL,)),
             EmulatedNode("l4-0", "L4", models=(MODEL,))]
    async with run_emulator(nodes, speed=20.0) as emu:
        fleet = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": emu.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: {"policy": "tailguard", "slo": {"ttft_s": 5.0, "tpot_s": 0.2},
                              "limits": {"kind": "fixed", "initial": 2},
                              "admission": {"queue_max": 8}}},
        })
        async with run_gateway(fleet, record=record) as gw:
            client = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)

            async def one(i: int) -> bool:
                priority = ("high", "normal", "low")[i % 3]
                try:
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi " * (10 + i)}],
                        max_tokens=16, stream=True,
                        extra_headers={"x-tailguard-priority": priority})
                    async for _ in stream:
                        pass
                except RateLimitError:
                    return False
                return True

            done = await asyncio.gather(*(one(i) for i in range(40)))
            await client.close()
            await asyncio.sleep(0.3)
    return sum(done), len(done) - sum(done)


def test_recorded_admission_replays_with_zero_differences(tmp_path: Path) -> None:
    record = tmp_path / "decisions.jsonl"
    answered, shed = asyncio.run(live_admission_run(record))
    assert answered >= 4 and shed >= 1  # the queue held some, the rest got 429s
    records = read_decisions(record)
    results = [r["result"] for r in records if r["op"] == "admit"]
    assert len(results) == 40
    assert any("queued" in r for r in results) and any("shed" in r for r in results)
    assert any(d for r in records if r["op"] == "poll_queue" for d in r["decisions"])
    result = replay(records)
    assert result.differences == [], result.differences[:3]
    # As a simulator workload: every arrival, admitted, queued or shed.
    assert len(read_trace(record)) == 40
