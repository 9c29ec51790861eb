"""A do-nothing endpoint picker: the yardstick of ``benchmarks/epp.py``'s added latency.

It speaks the same ext_proc exchange as ``tailguard epp`` in the shape that
``tailguard envoy-config`` writes (full duplex, an observer filter in
observability mode) on the same grpcio asyncio server, and does no work: the
request's body is gathered and echoed, every request is routed to one fixed
endpoint, the observer's messages are read and dropped. What Envoy plus this
adds over Envoy alone is the floor any grpcio picker pays on this machine;
what ``tailguard epp`` adds over it is tailguard's own work.

    python benchmarks/epp_floor.py --port P --endpoint 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)

from tailguard.adapters.runtime import loop_factory
from tailguard.epp.protocol import body_echo, routing


class FloorPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, endpoint: str) -> None:
        self.route = routing(endpoint, None, duplex=True)  # tailguard's own reply, built once

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        body = bytearray()
        async for msg in requests:
            if msg.observability_mode:  # the observer's stream: Envoy reads no reply
                continue
            if msg.HasField("request_headers") and msg.request_headers.end_of_stream:
                yield self.route
            elif msg.HasField("request_body"):
                body += msg.request_body.body
                if msg.request_body.end_of_stream:
                    yield self.route
                    yield body_echo(bytes(body))
                    body = bytearray()


async def serve(port: int, endpoint: str) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(FloorPicker(endpoint), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--endpoint", required=True, help="ip:port every request is routed to")
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory) as runner:  # tailguard epp's loop
        runner.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
