"""vllm-router's P/D mode (``--vllm-pd-disaggregation``), unchanged, in front of the
emulated engines: streamed and plain chat and completions all served, and every
request's prompt computed on the prefill engine and pulled by the decode engine."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from tailguard.emulator import EmulatedNode, run_emulator

MODEL = "llama-3.1-8b"


def router_binary() -> str:
    """vllm-router from the environment (a dev dependency), or skip (fail in CI)."""
    path = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) \
        or shutil.which("vllm-router")
    if path is None:
        msg = "vllm-router is not installed (pip install -e '.[dev]')"
        if os.environ.get("REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_vllm_router_pd_serves_through_the_emulated_engines(policy: str) -> None:
    binary = router_binary()

    async def main() -> None:
        nodes = [EmulatedNode("pre0", "H100-SXM", (MODEL,)),
                 EmulatedNode("pre1", "H100-SXM", (MODEL,)),
                 EmulatedNode("dec0", "A100-80GB", (MODEL,))]
        async with run_emulator(nodes, speed=5.0) as emu:
            port = free_port()
            proc = subprocess.Popen(
                [binary, "--host", "127.0.0.1", "--port", str(port),
                 "--vllm-pd-disaggregation", "--prefill", emu.urls["pre0"], "none",
                 "--prefill", emu.urls["pre1"], "none", "--decode", emu.urls["dec0"],
                 "--policy", policy, "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                url = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as s:
                    for _ in range(150):
                        try:
                            async with s.get(url + "/health") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        await asyncio.sleep(0.1)
                client = AsyncOpenAI(base_url=url + "/v1", api_key="unused")
                messages = [{"role": "user", "content": "tell me " * 600}]
                try:
                    for _ in range(2):
                        stream = await client.chat.completions.create(
                            model=MODEL, messages=messages, max_tokens=12, stream=True,
                            stream_options={"include_usage": True})  # type: ignore[arg-type]
                        usage = None
                        async for chunk in stream:
                            usage = chunk.usage or usage
                        assert usage is not None and usage.completion_tokens == 12
                        plain = await client.chat.completions.create(
                            model=MODEL, messages=messages,  # type: ignore[arg-type]
                            max_tokens=7)
                        assert plain.usage is not None and plain.usage.completion_tokens == 7
                        text = await client.completions.create(model=MODEL, prompt="x " * 400,
                                                               max_tokens=5)
                        assert text.choices[0].text.count("tok") == 5
                finally:
                    await client.close()
                sent = emu.server("pre0").kv_sent + emu.server("pre1").kv_sent
                dec = emu.server("dec0")
                # Every request: a prompt computed on a prefill engine, pulled by the
                # decode engine; no prompt computed there for want of its KV.
                assert (sent, dec.kv_received, dec.kv_missing) == (6, 6, 0)
                for nid in ("pre0", "pre1"):
                    assert emu.server(nid).driver.engine.num_held == 0
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if proc.stderr is not None:
                    proc.stderr.close()

    asyncio.run(asyncio.wait_for(main(), 60))
