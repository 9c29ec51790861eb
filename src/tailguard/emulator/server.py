"""HTTP face of the emulated engines: one aiohttp server per node, all in one process.

Each node listens on its own port and answers like a vLLM OpenAI server:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming (SSE)
  or not. A request generates exactly ``max_tokens`` tokens (default
  ``default_max_tokens``, 256) unless the emulator was given an
  end-of-sequence length distribution (``eos``), which then draws the answer
  length, capped at ``max_tokens``; ``"ignore_eos": true`` (a vLLM extension)
  restores the exact count. ``stream_options.include_usage`` adds the usage
  chunk. A prompt that cannot fit (``prompt + max_tokens`` over the model's
  context or the node's KV cache) is a 400, as in vLLM.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (see
  :mod:`tailguard.emulator.metrics`).
* vLLM's disaggregated prefill/decode over the OpenAI API, as its
  NixlConnector with ``kv_role: kv_both`` speaks it to vllm-router and the
  like: a request with ``kv_transfer_params.do_remote_decode`` computes the
  prompt and one token, holds the KV (``KV_HOLD_S`` at most) and answers with
  top-level ``kv_transfer_params`` (``do_remote_prefill``, ``remote_engine_id``,
  ``remote_request_id``, ``remote_block_ids``, ``remote_host``/``port``,
  ``tp_size``); a request that passes those on waits the transfer over the
  KV link (:mod:`tailguard.core.kv_transfer`) and computes only the prompt's
  last token, freeing the KV where it was. KV another process holds, or that
  expired, is computed again locally. ``/metrics`` counts the transfers
  (``tailguard_emulator_kv_transfers_total{direction}``).
* ``POST /admin/faults`` (one fault object, or a list), ``GET /admin/faults``
  and ``DELETE /admin/faults`` (see :mod:`tailguard.emulator.faults`). A
  ``"node": id`` key in the body, or ``?node=id`` on DELETE/GET, addresses
  another node of the same process, so a crashed node, whose own port is
  closed, can be brought back through a neighbour.

What each fault does on the wire:

``throttle``  engine steps take ``1/factor`` times as long (TPOT and TTFT grow).
``stall``     the engine pauses: streams freeze, queues grow.
``errors``    that share of completion requests is answered ``500`` at once.
``hang``      completion requests and ``/health`` are accepted and never
              answered (until the hang ends); streams already running go on.
``network``   a slow link: the answer's headers and every later write wait
              ``delay_s`` plus up to ``jitter_s`` (tokens that arrive in the
              meantime go out together, as over a congested link).
``crash``     every request held fails, every connection is dropped (RST), and
              the port is closed (connection refused) until the crash ends;
              the engine then restarts empty.

In zero-delay mode (``speed`` infinite) there is no engine clock to slow
down: ``errors``, ``hang`` and ``crash`` apply, ``throttle`` and ``stall`` do
nothing.

A client that disconnects cancels its request in the engine at once
(``handler_cancellation``), which frees its batch slot and KV cache.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any

from aiohttp import web

from tailguard.core.kv_transfer import DEFAULT_LINK, kv_transfer_s
from tailguard.emulator.dcgm import dcgm_page
from tailguard.emulator.driver import EngineDriver, Pending
from tailguard.emulator.faults import FaultSpec, FaultState, combine, parse_fault
from tailguard.emulator.fleet import EmulatedNode
from tailguard.emulator.metrics import EngineMetrics
from tailguard.emulator.protocol import (
    SSE_HEADERS,
    ChunkTemplate,
    ParsedRequest,
    RequestError,
    error_body,
    full_response,
    models_body,
    parse_request,
    usage as protocol_usage,
)
from tailguard.errors import ConfigError
from tailguard.traffic.workload import LengthDist

JSON = "application/json"
# How long a prompt's KV waits for its decode engine before it is freed.
KV_HOLD_S = 120.0


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, param), content_type=JSON)


class _ActiveFault:
    __slots__ = ("end", "repeat", "spec", "start", "started")

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.started = False
        self.start: asyncio.TimerHandle | None = None
        self.repeat: asyncio.TimerHandle | None = None  # the next pause of a periodic stall
        self.end: asyncio.TimerHandle | None = None

    def cancel(self) -> None:
        for h in (self.start, self.repeat, self.end):
            if h is not None:
                h.cancel()
        self.start = self.repeat = self.end = None


class EngineServer:
    """One emulated engine: the engine model, its driver, its HTTP server and its faults."""

    def __init__(
        self,
        node: EmulatedNode,
        *,
        time_scale: float = 1.0,
        host: str = "127.0.0.1",
        default_max_tokens: int = 256,
        eos: LengthDist | None = None,
        seed: int = 0,
        peers: Callable[[str], EngineServer | None] | None = None,
    ) -> None:
        self.node = node
        self.host = host
        self.port = node.port
        self.default_max_tokens = default_max_tokens
        self.eos = eos
        perf = node.perf()
        if perf.kv_capacity_tokens < 2 * node.engine.block_size:
            raise ConfigError(f"node {node.id}", f"{perf.model.name} does not fit on {node.tp} x "
                              f"{perf.gpu.name} (no room for KV cache): raise tp or pick a "
                              "smaller catalog_model")
        self.metrics = EngineMetrics(node.models[0], node.dialect, node.engine.block_size)
        self._block_size = node.engine.block_size
        self.driver = EngineDriver(perf, node.engine, self.metrics, time_scale=time_scale,
                                   base_speed=node.speed)
        self.metrics.source = self.driver
        self.max_model_len = min(perf.model.max_context, self.driver.kv_capacity_tokens)
        self._rng = random.Random(f"{seed}:{node.id}")
        self._peers = peers
        self._faults: list[_ActiveFault] = []
        self._state = FaultState()
        self._unhung = asyncio.Event()
        self._unhung.set()
        self._down = False
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # vLLM's P/D (NixlConnector, kv_both): prompts computed here for another
        # engine, their KV held until it is pulled (remote_request_id -> the
        # request, its expiry, its prompt tokens), and the transfers each way.
        self._held: dict[str, tuple[Pending, asyncio.TimerHandle | None, int]] = {}
        self.kv_link = DEFAULT_LINK
        self.kv_sent = self.kv_received = self.kv_missing = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.driver.start()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/dcgm", self._dcgm)
        app.router.add_post("/admin/faults", self._post_faults)
        app.router.add_get("/admin/faults", self._get_faults)
        app.router.add_delete("/admin/faults", self._delete_faults)
        # handler_cancellation: a client that goes away cancels its handler, and
        # the handler's cleanup cancels the request in the engine.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        await self._open_site()
        for spec in self.node.faults:
            self.inject(spec)

    async def _open_site(self) -> None:
        assert self._runner is not None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"node {self.node.id}",
                              f"cannot listen on {self.host}:{self.port}: {exc.strerror}") from exc
        self.port = sock.getsockname()[1]
        self._site = web.SockSite(self._runner, sock, backlog=1024)
        await self._site.start()

    async def stop(self) -> None:
        self._closing = True
        for f in self._faults:
            f.cancel()
        self._faults.clear()
        self._unhung.set()  # release hung handlers; they see _closing and drop
        self._forget_held()
        self.driver.stop()
        if self._listen_task is not None:
            with suppress(Exception):
                await self._listen_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._site = None

    def _drop_connections(self, keep: asyncio.BaseTransport | None = None) -> None:
        server = self._runner.server if self._runner is not None else None
        if server is None:
            return
        for handler in server.connections:
            t = handler.transport
            if t is not None and t is not keep:
                t.abort()

    def _set_listening(self, on: bool) -> None:
        prev = self._listen_task

        async def change() -> None:
            if prev is not None:
                with suppress(Exception):
                    await prev
            if self._closing:
                return
            if on and self._site is None:
                await self._open_site()
            elif not on and self._site is not None:
                site, self._site = self._site, None
                await site.stop()

        self._listen_task = asyncio.ensure_future(change())

    # ---------------------------------------------------------------- faults

    @property
    def faults(self) -> list[dict[str, Any]]:
        return [{**f.spec.to_json(), "active": f.started} for f in self._faults]

    def inject(self, spec: FaultSpec, keep: asyncio.BaseTransport | None = None) -> None:
        """Schedule a fault (``spec.at_s`` from now); ``keep`` survives a crash (the caller)."""
        assert self._loop is not None, "start() the server first"
        if spec.gpu_index is not None and spec.gpu_index >= self.node.tp:
            raise ConfigError(f"node {self.node.id}: fault.gpu_index",
                              f"GPU {spec.gpu_index} of a replica of {self.node.tp}")
        entry = _ActiveFault(spec)
        self._faults.append(entry)
        if spec.at_s > 0:
            entry.start = self._loop.call_later(spec.at_s, self._begin, entry, None)
        else:
            self._begin(entry, keep)

    def clear_faults(self) -> None:
        for f in self._faults:
            f.cancel()
        self._faults.clear()
        self._apply(None)

    def _begin(self, entry: _ActiveFault, keep: asyncio.BaseTransport | None) -> None:
        assert self._loop is not None
        entry.started = True
        spec = entry.spec
        if spec.kind == "stall":
            self.driver.stall(spec.seconds)
            if spec.period_s is not None:
                entry.repeat = self._loop.call_later(spec.period_s, self._repeat_stall, entry)
            elif spec.duration_s is None:
                self._faults.remove(entry)  # a single pause: nothing stays active
        if spec.duration_s is not None:
            entry.end = self._loop.call_later(spec.duration_s, self._end, entry)
        self._apply(keep)

    def _repeat_stall(self, entry: _ActiveFault) -> None:
        assert self._loop is not None and entry.spec.period_s is not None
        self.driver.stall(entry.spec.seconds)
        entry.repeat = self._loop.call_later(entry.spec.period_s, self._repeat_stall, entry)

    def _end(self, entry: _ActiveFault) -> None:
        entry.cancel()
        if entry in self._faults:
            self._faults.remove(entry)
        self._apply(None)

    def _apply(self, keep: asyncio.BaseTransport | None) -> None:
        new = combine([f.spec for f in self._faults if f.started])
        old, self._state = self._state, new
        if new.speed_factor != old.speed_factor:
            self.driver.set_speed_factor(new.speed_factor)
        if new.hang:
            self._unhung.clear()
        else:
            self._unhung.set()
        if new.crash and not old.crash:
            self._down = True
            self.driver.crash()
            self._forget_held()  # the crash took the held KV with it
            self._drop_connections(keep)
            self._set_listening(False)
        elif old.crash and not new.crash:
            self._down = False
            self.driver.restart()
            self._set_listening(True)

    # -------------------------------------------------------------- handlers

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=True)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, chat=False)

    def _refuse(self, request: web.Request) -> web.StreamResponse:
        """Answer nothing: reset the connection, as a dead process would."""
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=503)

    async def _completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self._down:
            return self._refuse(request)
        raw = await request.read()
        try:
            req = parse_request(raw, chat, self.node.models, self.default_max_tokens)
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.param)
        need = req.prompt_tokens + req.max_tokens
        if need > self.max_model_len:
            return _error(400, f"This model's maximum context length is {self.max_model_len} "
                               f"tokens. However, you requested {need} tokens "
                               f"({req.prompt_tokens} in the messages, {req.max_tokens} in the "
                               f"completion).", "max_tokens")
        if self._state.error_rate > 0.0 and self._rng.random() < self._state.error_rate:
            return _error(500, "emulated engine error (errors fault)")
        if not self._unhung.is_set():
            await self._unhung.wait()
        if self._down or self._closing:
            return self._refuse(request)
        output = req.max_tokens
        if self.eos is not None and not req.ignore_eos:
            output = min(output, self.eos.sample(self._rng))
        finish = "length" if req.explicit_max and output == req.max_tokens else "stop"
        kv = req.kv_transfer
        if kv is not None and kv.get("do_remote_decode") is True:
            return await self._prefill_for_remote(request, req)
        remote = False
        if kv is not None and kv.get("do_remote_prefill") is True:
            remote = await self._pull_kv(kv)
        p = self.driver.submit(req.prompt_tokens, output, req.stream, req.blocks,
                               remote_kv=remote)
        try:
            if req.stream:
                return await self._stream(request, req, p, finish)
            while not p.done:
                await p.wait()
            if p.failed:
                return self._refuse(request) if self._down else _error(500, "request failed")
            await self._link_delay()
            return web.Response(body=full_response(req, p.output, finish, self._cached(p)),
                                content_type=JSON)
        finally:
            if not p.done:
                self.driver.cancel(p)

    async def _prefill_for_remote(self, request: web.Request,
                                  req: ParsedRequest) -> web.StreamResponse:
        """A prefill leg (``do_remote_decode``): compute the prompt and one token, hold
        the KV for the decode engine, and answer with what it needs to pull it."""
        p = self.driver.submit(req.prompt_tokens, 1, False, req.blocks, hold_kv=True)
        try:
            while not p.done:
                await p.wait()
        finally:
            if not p.done:
                self.driver.cancel(p)
        if p.failed:
            return self._refuse(request) if self._down else _error(500, "request failed")
        rid = f"{self.node.id}-{p.rid}"
        assert self._loop is not None
        expiry = self._loop.call_later(KV_HOLD_S, self._expire_kv, rid)
        self._held[rid] = (p, expiry, req.prompt_tokens)
        self.kv_sent += 1
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_block_ids": list(range(-(-req.prompt_tokens // self._block_size))),
                  "remote_engine_id": self.node.id, "remote_request_id": rid,
                  "remote_host": self.host, "remote_port": self.port, "tp_size": self.node.tp}
        await self._link_delay()
        return web.Response(body=full_response(req, 1, "length", self._cached(p), params),
                            content_type=JSON)

    def _forget_held(self) -> None:
        for _, expiry, _ in self._held.values():
            if expiry is not None:
                expiry.cancel()
        self._held.clear()

    def _expire_kv(self, rid: str) -> None:
        """No decode engine pulled the KV in time: free it (vLLM's abort timeout)."""
        held = self._held.pop(rid, None)
        if held is not None:
            self.driver.release_kv(held[0])

    async def _pull_kv(self, kv: dict[str, Any]) -> bool:
        """A decode leg (``do_remote_prefill``): wait out the KV transfer from the engine
        that computed the prompt, then free it there. False when that KV is not to be
        had (expired, or an engine this process does not run): the prompt is then
        computed here, as vLLM recomputes after a failed load."""
        src_id, rid = kv.get("remote_engine_id"), kv.get("remote_request_id")
        src = self._peers(src_id) if self._peers is not None and isinstance(src_id, str) \
            else None
        held = src._held.pop(rid, None) if src is not None and isinstance(rid, str) else None
        if src is None or held is None:
            self.kv_missing += 1
            return False
        p, expiry, tokens = held
        if expiry is not None:
            expiry.cancel()
        try:
            if not self.driver.instant:
                t = kv_transfer_s(self.driver.engine.perf.model.kv_bytes_per_token, tokens,
                                  self.kv_link)
                await asyncio.sleep(t / self.driver.time_scale)
        finally:
            src.driver.release_kv(p)
        self.kv_received += 1
        return True

    def _cached(self, p: Pending) -> int | None:
        """The cached-token count to report: vLLM's, when its prefix cache is on."""
        return p.cached if self.driver.engine.config.enable_prefix_caching else None

    async def _stream(self, request: web.Request, req: ParsedRequest, p: Pending,
                      finish: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await self._link_delay()
        await resp.prepare(request)
        tpl = ChunkTemplate(req)
        sent = 0
        try:
            while True:
                done = p.done  # snapshot first: tokens may arrive while we write
                data = b""
                if p.avail > sent:
                    data = tpl.token * (p.avail - sent)
                    if sent == 0:
                        data = tpl.head + data
                    sent = p.avail
                if done:
                    if p.failed:
                        data += tpl.error_event("engine failed the request")
                    else:
                        usage = (protocol_usage(req.prompt_tokens, sent, self._cached(p))
                                 if req.include_usage else None)
                        data += tpl.tail(finish, usage)
                if data:
                    await self._link_delay()
                    await resp.write(data)
                if done:
                    break
                if p.avail == sent and not p.done:
                    await p.wait()
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away (or a crash dropped it); the caller cancels
        return resp

    async def _link_delay(self) -> None:
        """What a ``network`` fault costs one write (nothing without one)."""
        state = self._state
        if state.slow_link:
            await asyncio.sleep(state.delay_s + state.jitter_s * self._rng.random())

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(body=models_body(self.node.models, self.max_model_len),
                            content_type=JSON)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if not self._unhung.is_set():
            await self._unhung.wait()
        if self._down or self._closing:
            return self._refuse(request)
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        kv = (f"# HELP tailguard_emulator_kv_transfers_total Prompts whose KV this engine "
              f"held for another (sent), pulled from another (received), or found gone "
              f"and computed itself (missing).\n"
              f"# TYPE tailguard_emulator_kv_transfers_total counter\n"
              f'tailguard_emulator_kv_transfers_total{{direction="sent"}} {self.kv_sent}\n'
              f'tailguard_emulator_kv_transfers_total{{direction="received"}} '
              f"{self.kv_received}\n"
              f'tailguard_emulator_kv_transfers_total{{direction="missing"}} '
              f"{self.kv_missing}\n").encode()
        return web.Response(body=self.metrics.render() + kv,
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _dcgm(self, request: web.Request) -> web.StreamResponse:
        """A dcgm-exporter page for the node's GPUs, consistent with its faults."""
        if self._down:
            return self._refuse(request)
        return web.Response(body=dcgm_page(self.node, self._state).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    # ------------------------------------------------------------------ admin

    def _target(self, node_id: Any) -> EngineServer:
        if node_id is None or node_id == self.node.id:
            return self
        found = self._peers(str(node_id)) if self._peers is not None else None
        if found is None:
            raise RequestError(404, f"unknown node {node_id!r}", "node")
        return found

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            items = body if isinstance(body, list) else [body]
            parsed: list[tuple[EngineServer, FaultSpec]] = []
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise RequestError(400, f"fault[{i}] must be an object")
                target = self._target(item.get("node", request.query.get("node")))
                spec = parse_fault({k: v for k, v in item.items() if k != "node"}, f"fault[{i}]")
                if spec.gpu_index is not None and spec.gpu_index >= target.node.tp:
                    raise RequestError(400, f"fault[{i}].gpu_index: node {target.node.id} has "
                                            f"{target.node.tp} GPU(s)", "gpu_index")
                parsed.append((target, spec))
        except ValueError as exc:  # JSON and ConfigError
            return _error(400, str(exc))
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.param)
        crash = False
        for target, spec in parsed:
            # the admin connection itself survives a crash of its own node to get its answer
            target.inject(spec, keep=request.transport if target is self else None)
            crash = crash or (target is self and spec.kind == "crash")
        doc = {t.node.id: t.faults for t, _ in parsed}
        resp = web.Response(body=json.dumps({"faults": doc}).encode(), content_type=JSON)
        if crash:
            resp.force_close()
        return resp

    async def _get_faults(self, request: web.Request) -> web.Response:
        try:
            target = self._target(request.query.get("node"))
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.param)
        return web.json_response({"node": target.node.id, "faults": target.faults})

    async def _delete_faults(self, request: web.Request) -> web.Response:
        try:
            target = self._target(request.query.get("node"))
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.param)
        target.clear_faults()
        return web.json_response({"node": target.node.id, "faults": []})


class Emulator:
    """Every emulated node of a fleet in this process.

    ``speed`` scales time (2.0: everything twice as fast); ``float('inf')``
    is zero-delay mode (answers at once, for measuring a gateway's overhead).
    """

    def __init__(
        self,
        nodes: Sequence[EmulatedNode],
        *,
        speed: float = 1.0,
        host: str = "127.0.0.1",
        default_max_tokens: int = 256,
        eos: LengthDist | None = None,
        seed: int = 0,
    ) -> None:
        if not speed > 0:
            raise ConfigError("--speed", f"must be > 0, got {speed}")
        ids = [n.id for n in nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError("nodes", "node ids must be unique")
        self.nodes = list(nodes)
        self.speed = speed
        self.host = host
        self.default_max_tokens = default_max_tokens
        self.eos = eos
        self.seed = seed
        self.servers: dict[str, EngineServer] = {}

    def server(self, node_id: str) -> EngineServer:
        return self.servers[node_id]

    @property
    def urls(self) -> dict[str, str]:
        return {nid: s.url for nid, s in self.servers.items()}

    async def start(self) -> None:
        for node in self.nodes:
            srv = EngineServer(node, time_scale=self.speed, host=self.host,
                               default_max_tokens=self.default_max_tokens, eos=self.eos,
                               seed=self.seed, peers=self.servers.get)
            self.servers[node.id] = srv
            try:
                await srv.start()
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        servers = list(self.servers.values())
        await asyncio.gather(*(s.stop() for s in servers), return_exceptions=True)

    async def __aenter__(self) -> Emulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@asynccontextmanager
async def run_emulator(nodes: Sequence[EmulatedNode], **options: Any) -> AsyncIterator[Emulator]:
    """``async with run_emulator(nodes, speed=10) as emu: emu.urls[node_id]`` (see :class:`Emulator`)."""
    emu = Emulator(nodes, **options)
    await emu.start()
    try:
        yield emu
    finally:
        await emu.stop()
