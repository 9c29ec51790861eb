"""Emulated OpenAI-compatible GPU engines that run :mod:`tailguard.engine` in real time.

``tailguard emulate --fleet fleet.yaml`` serves every local node of a fleet
file from one process, so the gateway, its tests and the demo run against
engines that batch, queue, fill their KV cache and slow down like the GPUs
they stand for, without a GPU.

Layers, bottom up:

* :mod:`~tailguard.emulator.protocol`: OpenAI request parsing, response and
  SSE bytes (pre-encoded per request, nothing encoded per token);
* :mod:`~tailguard.emulator.driver`: one engine model on the loop clock, one
  timer per engine, tokens handed to waiting handlers once per step;
* :mod:`~tailguard.emulator.metrics`: vLLM-format ``/metrics`` (or another
  engine's dialect);
* :mod:`~tailguard.emulator.faults`: throttle, stall, errors, hang, crash;
* :mod:`~tailguard.emulator.server`: the per-node aiohttp servers and
  :class:`Emulator`;
* :mod:`~tailguard.emulator.fleet`: which nodes of a fleet file to emulate.

Programmatic use (tests, demo, benchmarks)::

    nodes = [EmulatedNode("h100-0", "H100"), EmulatedNode("l4-0", "L4")]
    async with run_emulator(nodes, speed=1.0) as emu:
        emu.urls["l4-0"]                        # http://127.0.0.1:<free port>
        emu.server("l4-0").inject(parse_fault({"kind": "throttle", "factor": 0.5}))
"""

from tailguard.emulator.faults import FaultSpec, parse_fault
from tailguard.emulator.fleet import EmulatedNode, load_emulated_nodes, nodes_from_fleet
from tailguard.emulator.server import Emulator, EngineServer, run_emulator

__all__ = [
    "EmulatedNode",
    "Emulator",
    "EngineServer",
    "FaultSpec",
    "load_emulated_nodes",
    "nodes_from_fleet",
    "parse_fault",
    "run_emulator",
]
