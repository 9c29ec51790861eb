"""Chaos under a steady load (issue 11): bad reloads, and engines that crash, hang or fail.

The engines of the second test are `tailguard emulate` processes of their own
(one node each), so that they can be stopped with SIGSTOP and killed with
SIGKILL like real engine processes. Every test asserts what a client must
see: no error before the first byte while another node can serve, none after
it either (a stream whose node dies moves to another node), and afterwards nothing in flight,
no permit released twice, and file descriptors and tasks back to where they
were before the load.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from emulated_procs import engine_process, wait_listening
from gateway_fakes import FakeEngine, fleet_doc, free_port, wait_for

from tailguard.config.fleet import load_fleet
from tailguard.gateway.app import RunningGateway, run_gateway

MSG = [{"role": "user", "content": "hello there, how are you"}]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


class Load:
    """Closed-loop workers; every answer is classified the way a client sees it."""

    def __init__(self, gw: RunningGateway, workers: int, max_tokens: int = 12) -> None:
        self.gw = gw
        self.workers = workers
        self.max_tokens = max_tokens
        self.ok = 0
        self.before_first_byte: list[str] = []  # errors a client got instead of an answer
        self.mid_stream_events = 0  # streams that ended with an SSE error event
        self.truncated = 0  # streams that ended with neither [DONE] nor an error event
        self.moved = 0.0  # streams the gateway moved to another node mid-answer
        self.nodes: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    async def stop(self) -> None:
        """Stop the workers and close the session (again: nothing more to do)."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        if not self._session.closed:
            await self._session.close()

    async def _worker(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (i + n) % 4 != 0
            body = {"model": "m", "messages": MSG, "max_tokens": self.max_tokens,
                    "stream": stream}
            try:
                async with self._session.post(self.gw.url + "/v1/chat/completions",
                                              json=body) as r:
                    raw = await r.read()
                    node = r.headers.get("x-tailguard-node", "-")
                    if r.status != 200:
                        self.before_first_byte.append(f"{r.status} {raw[:160]!r}")
                        continue
            except aiohttp.ClientError as exc:
                self.before_first_byte.append(repr(exc))
                continue
            self.nodes[node] = self.nodes.get(node, 0) + 1
            if not stream or raw.endswith(b"data: [DONE]\n\n"):
                self.ok += 1
            elif b'data: {"error"' in raw:
                self.mid_stream_events += 1
            else:
                self.truncated += 1


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_bad_reloads_under_load_change_nothing_and_reload_survives(tmp_path: Path) -> None:
    """D4/D5: an emptied file moved listen and dropped every node; invalid UTF-8 killed reload."""

    async def body() -> None:
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        for e in (a, b):
            e.behavior.token_delay_s = 0.02  # streams stay open across the edits
        path = tmp_path / "fleet.yaml"
        good = fleet_doc([a, b], reload={"poll_s": 0.05},
                         admin={"token_env": "TG_CHAOS_TOKEN"})
        _write(path, good)
        try:
            async with run_gateway(load_fleet(path)) as gw:
                load = Load(gw, workers=6)
                load.start()
                await wait_for(lambda: load.ok > 10, what="traffic")
                errors = gw.metrics.reloads.labels("error")
                bad_files: list[bytes] = [
                    b"",  # `: > fleet.yaml`
                    b"   \n# nothing but a comment\n",
                    b"nodes: [{id: x, url: http://127.0.0.1:1, gpu: \xff\xfe, models: [m]}]\n",
                    b"nodes: [ {id: a\n",  # truncated mid-write
                    b"listen: 127.0.0.1:9\n",  # no nodes key: refused, not an empty fleet
                    yaml.safe_dump({**good, "nodes": [{**good["nodes"][0],
                                                       "url": "http://u:pw@127.0.0.1:1"}]}
                                   ).encode(),
                ]
                for i, raw in enumerate(bad_files):
                    path.write_bytes(raw)  # not atomic, on purpose: editors do this
                    await wait_for(lambda i=i: errors._value.get() >= i + 1, timeout=5.0,
                                   what=f"bad file {i} refused")
                    assert sorted(gw.fleet.balancer.nodes) == ["a", "b"]
                    assert gw.fleet.config.listen == ("127.0.0.1", 0)
                    assert gw.fleet.config.admin.token_env == "TG_CHAOS_TOKEN"
                assert gw.reloader._task is not None and not gw.reloader._task.done()
                # the reloader still works: remove a node with streams open on it
                _write(path, fleet_doc([b], reload={"poll_s": 0.05},
                                       admin={"token_env": "TG_CHAOS_TOKEN"}))
                await wait_for(lambda: "a" not in gw.fleet.balancer.nodes, what="a removed")
                mark = load.ok
                await wait_for(lambda: load.ok > mark + 10, what="traffic after")
                await load.stop()
                assert gw.fleet.in_flight() == 0
                assert gw.fleet.balancer.double_release == 0
        finally:
            await a.stop()
            await b.stop()
        assert not load.before_first_byte, load.before_first_byte[:5]
        assert load.truncated == 0 and load.mid_stream_events == 0

    asyncio.run(body())


async def set_fault(url: str, fault: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/faults", json=fault) as r:
        assert r.status == 200, await r.text()


def bitten(gw: RunningGateway, node: str) -> float:
    """Requests a slow link hurt on ``node``: first-byte timeouts plus streams that stalled > 1 s."""
    timeouts = gw.metrics.upstream_errors.labels(node, "timeout")._value.get()
    reg = gw.metrics.registry
    labels = {"pool": "m", "node": node, "gpu": gw.fleet.balancer.nodes[node].spec.gpu_class}
    gaps = reg.get_sample_value("tailguard_max_token_gap_seconds_count", labels) or 0.0
    quick = reg.get_sample_value("tailguard_max_token_gap_seconds_bucket",
                                 {**labels, "le": "1.0"}) or 0.0
    return float(timeouts + gaps - quick)


def test_engine_faults_under_load(tmp_path: Path) -> None:
    """Crash, hang (SIGSTOP), kill -9, 5xx bursts, a slow link: no client error before the first byte."""
    ports = [free_port() for _ in range(3)]
    nodes = [{"id": f"n{i}", "url": f"http://127.0.0.1:{p}", "gpu": "H100", "models": ["m"]}
             for i, p in enumerate(ports)]

    async def body(procs: list[subprocess.Popen[bytes]]) -> Load:
        for p in ports:
            await wait_listening(p)
        doc = fleet_doc([], pools={"m": {"policy": "tailguard", "retries": {
            "attempts": 3, "budget": 1.0}, "timeouts": {"connect_s": 0.5, "first_byte_s": 1.5,
                                                         "idle_s": 2.0, "total_s": 30.0}}})
        doc["nodes"] = nodes
        fleet_path = tmp_path / "fleet.yaml"
        _write(fleet_path, doc)
        async with run_gateway(load_fleet(fleet_path)) as gw:
            await wait_for(lambda: all(m.sample is not None for m in gw.fleet.monitors.values()),
                           timeout=10.0, what="engines scraped")
            fd0, tasks0 = fds(), len(asyncio.all_tasks())
            load = Load(gw, workers=8, max_tokens=16)
            load.start()
            try:
                await wait_for(lambda: load.ok > 30, timeout=20.0, what="traffic")
                # 0. n1's link turns slow: every write waits longer than the first-byte
                # timeout, so new requests there time out and go elsewhere, and its
                # streams under way stall between chunks (the balancer, seeing them
                # stuck, may send n1 nothing new: then only the stalls show)
                before = bitten(gw, "n1")
                await set_fault(nodes[1]["url"], {"kind": "network", "delay_s": 1.6,
                                                  "jitter_s": 0.2, "duration_s": 3})
                await asyncio.sleep(3.5)
                # the slow link did bite (a stalled stream counts once it ends)
                await wait_for(lambda: bitten(gw, "n1") > before, timeout=5.0,
                               what="a timeout or a stalled stream on n1")
                # 1. a burst of 5xx from n0
                await set_fault(nodes[0]["url"], {"kind": "errors", "rate": 1.0, "duration_s": 2})
                await asyncio.sleep(2.5)
                # 2. n1 hangs: the process is stopped, its kernel still accepts connections
                procs[1].send_signal(signal.SIGSTOP)
                await asyncio.sleep(3.0)
                procs[1].send_signal(signal.SIGCONT)
                await asyncio.sleep(1.0)
                # 3. n2 is killed with streams open, then comes back on its port
                procs[2].kill()
                procs[2].wait(timeout=10)
                await asyncio.sleep(2.0)
                with engine_process(tmp_path, nodes[2]) as again:
                    await wait_listening(ports[2])
                    # 4. n0 crashes (refuses connections) for 2 s
                    await set_fault(nodes[0]["url"], {"kind": "crash", "duration_s": 2})
                    await asyncio.sleep(3.0)
                    mark = load.ok
                    await wait_for(lambda: load.ok > mark + 20, timeout=20.0, what="recovered")
                    await load.stop()
                    load.moved = sum(s.value for m in gw.metrics.registry.collect()
                                     if m.name == "tailguard_migrations" for s in m.samples
                                     if s.name.endswith("_total"))
                    await wait_for(lambda: gw.fleet.in_flight() == 0, what="nothing in flight")
                    assert gw.fleet.balancer.double_release == 0
                    for node in gw.fleet.balancer.nodes.values():
                        assert node.in_flight == 0 and node.prefill_backlog == 0, node.id
                    # connections to clients and engines close within their idle timeouts
                    await wait_for(lambda: fds() <= fd0 + 2 and len(asyncio.all_tasks()) <= tasks0,
                                   timeout=25.0, what=f"fds {fd0} and tasks {tasks0} again")
                    assert again.poll() is None
            finally:
                await load.stop()  # a failed step must not leave the workers running
        return load

    with engine_process(tmp_path, nodes[0]) as p0, engine_process(tmp_path, nodes[1]) as p1, \
            engine_process(tmp_path, nodes[2]) as p2:
        load = asyncio.run(body([p0, p1, p2]))
    assert not load.before_first_byte, load.before_first_byte[:5]
    assert load.truncated == 0, load.truncated
    # The killed node's open streams moved to other nodes: no client saw an error event.
    assert load.mid_stream_events == 0 and load.moved >= 1, (load.mid_stream_events, load.moved)
    assert len(load.nodes) == 3
