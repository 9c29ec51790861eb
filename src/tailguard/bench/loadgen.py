"""A load generator for any OpenAI-compatible endpoint (an engine, or the gateway).

Two ways to offer load:

* **open loop** (``rate``): Poisson arrivals at ``rate`` requests/s for
  ``duration_s``; a request is sent at its arrival time whatever happened to
  the earlier ones, so an overloaded server shows up as growing latency and
  failures (the way users see it), not as a lower sending rate;
* **closed loop** (``concurrency``): that many clients each send a request,
  wait for its end, and send the next, until ``duration_s``;
* **a workload** (``workload``): the requests of a simulator workload, sent at
  their arrival times; with shared prefixes (sessions, a Mooncake trace) each
  prompt is made of the text of its blocks (:mod:`tailguard.bench.prefix_text`),
  so the engines' prefix caches see the workload's reuse, and the result
  reports the hit rate the engines reported (``usage.prompt_tokens_details``).

Prompt and answer lengths are drawn from the simulator's length
distributions (:mod:`tailguard.traffic.workload`) with a seeded generator, so
``tailguard sim`` and ``tailguard bench`` can offer the same workload. A
prompt of ``n`` tokens is a word unique to the request and ``n - 4``
repetitions of ``" tok"``: about one BPE token each for a real tokenizer, and
about ``n`` for the emulator's 4-characters-per-token estimate (which adds 3
tokens of message framing). The unique word comes first so that no two
prompts share a prefix: an engine's prefix cache (and the gateway's prefix
routing) would otherwise serve every prompt from the first one's KV, which is
not the independent traffic these workloads stand for.

What is measured per request, on the loop clock:

* TTFT: from sending to the first SSE event that carries text (a role-only
  first chunk does not count);
* TPOT: ``(last event - first token) / (tokens - 1)``, 0 for one token;
* E2E: from sending to the end of the response;
* output tokens: the usage chunk when the server sends one
  (``stream_options.include_usage`` is always asked for), else the count of
  events that carry text;
* the serving node: the ``x-tailguard-node`` response header (the gateway
  sets it), or ``direct`` when absent; on a disaggregated fleet also the node
  that computed the prompt and its leg's time (``x-tailguard-prefill-node``,
  ``x-tailguard-prefill-s``), summed up in the result's ``disaggregated`` block;
* the outcome: ``ok``, or an error kind (``http_429``, ``http_4xx``,
  ``http_5xx``, ``connect``, ``timeout``, ``disconnect``, ``stream_error``,
  ``incomplete``, ``unfinished``, ``client_limit``).

TTFT statistics also count the requests still unanswered when the drain
ends, with the time they had waited (a lower bound), as the simulator's
report does. Non-streaming requests have no first token on the wire: their TTFT is the
E2E time and their TPOT is 0.

Streams are not JSON-decoded per event: after the first token, an event is
counted when it contains a non-empty ``"content":"`` or ``"text":"``, and only
a usage or error event is decoded. This keeps the generator's cost small next
to the server it measures.

The result (:func:`summarize`) has the shape of one entry of ``tailguard sim
--json``, with 429s counted apart from failures (``rejected``) and a
``per_node`` breakdown.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tailguard.adapters.api_errors import PREFILL_NODE_HEADER, PREFILL_TIME_HEADER
from tailguard.bench.prefix_text import BlockText
from tailguard.bench.summary import DIRECT, OK, Record, summarize
from tailguard.core.policies import Slo
from tailguard.traffic.workload import FixedLength, LengthDist, Requests

NODE_HEADER = "x-tailguard-node"
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    target: str
    model: str | None = None
    rate: float | None = None
    concurrency: int | None = None
    duration_s: float = 30.0
    input_tokens: LengthDist = field(default_factory=lambda: FixedLength(200))
    output_tokens: LengthDist = field(default_factory=lambda: FixedLength(200))
    slo: Slo = field(default_factory=Slo)
    stream: bool = True
    endpoint: str = "chat"  # chat | completions
    api_key: str | None = None
    ignore_eos: bool = False
    seed: int = 0
    max_requests: int | None = None
    max_in_flight: int = 10_000
    drain_s: float = 60.0  # after the last arrival, how long to let requests finish
    timeout_s: float = 600.0  # per request
    label: str = "bench"
    headers: Mapping[str, str] = field(default_factory=dict)  # extra request headers
    workload: Requests | None = None  # requests to send at their own times (open loop)

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.rate, self.concurrency, self.workload))
        if given != 1:
            raise ValueError("give exactly one of rate, concurrency and workload")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")


@dataclass(slots=True)
class Progress:
    """A live snapshot, handed to the progress callback about four times a second."""

    elapsed_s: float
    duration_s: float
    sent: int
    completed: int
    failed: int
    rejected: int
    in_flight: int
    tokens: int


def _note_cached(rec: Record, usage: Mapping[str, Any]) -> None:
    """The server's count of the prompt's tokens served from its prefix cache."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached = details["cached_tokens"]
        prompt = usage.get("prompt_tokens")
        rec.prompt_reported = prompt if isinstance(prompt, int) else 0


def _has_text(payload: bytes) -> bool:
    if b'"content":"' in payload:
        return b'"content":""' not in payload
    if b'"text":"' in payload:
        return b'"text":""' not in payload
    return False


def _first_text(doc: Any) -> bool:
    try:
        choice = doc["choices"][0]
    except (KeyError, IndexError, TypeError):
        return False
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return isinstance(text, str) and text != ""


class LoadGenerator:
    """One run of :class:`BenchConfig` against its target; see the module docstring."""

    def __init__(self, cfg: BenchConfig, progress: Callable[[Progress], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        self.records: list[Record] = []
        self.in_flight = 0
        self.model = cfg.model or ""
        # Several targets (comma-separated): requests go to them in turn, as
        # a load balancer in front of gateway replicas would spread them.
        bases = []
        for t in cfg.target.split(","):
            base = t.strip().rstrip("/")
            bases.append(base[:-3] if base.endswith("/v1") else base)
        self.base = bases[0]
        path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
        self.urls = [b + path for b in bases]
        self.url = self.urls[0]
        self._turn = 0
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self.headers["Authorization"] = f"Bearer {cfg.api_key}"
        self.headers.update(cfg.headers)
        self._t0 = 0.0
        self._clock = time.perf_counter
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.elapsed_s = 0.0
        self._seq = 0  # makes every independent prompt unique (see the module docstring)
        wl = cfg.workload
        self._texts = BlockText(wl.block_tokens) if wl is not None and wl.blocks else None

    # ---------------------------------------------------------------- requests

    def _body(self, rec: Record) -> bytes:
        cfg = self.cfg
        n_in, n_out = rec.input, rec.max_tokens
        if rec.blocks is not None and self._texts is not None:
            text = self._texts.prompt(rec.blocks, max(1, n_in - 3), rec.salt)
        else:
            self._seq += 1
            text = f" r{self._seq:x}" + " tok" * max(0, n_in - 4)
        body: dict[str, Any] = {"model": self.model, "max_tokens": n_out, "stream": cfg.stream}
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text if rec.blocks is not None else text + " tok" * 3
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        return json.dumps(body).encode()

    async def _one(self, rec: Record) -> None:
        assert self._session is not None
        clock, t0 = self._clock, self._t0
        self.in_flight += 1
        urls = self.urls
        url = urls[0]
        if len(urls) > 1:
            rec.target = self._turn % len(urls)
            url = urls[rec.target]
            self._turn += 1
        try:
            headers = self.headers
            if rec.session is not None:
                headers = {**headers, SESSION_HEADER: str(rec.session)}
            async with self._session.post(url, data=self._body(rec), headers=headers) as resp:
                rec.status = resp.status
                rec.node = resp.headers.get(NODE_HEADER, DIRECT)
                pre = resp.headers.get(PREFILL_NODE_HEADER)
                if pre is not None:
                    rec.prefill_node = pre
                    try:
                        rec.prefill_s = float(resp.headers.get(PREFILL_TIME_HEADER, "0"))
                    except ValueError:
                        rec.prefill_s = 0.0
                if resp.status != 200:
                    await resp.read()
                    rec.end = clock() - t0
                    rec.error = "http_429" if resp.status == 429 else f"http_{resp.status // 100}xx"
                    return
                if self.cfg.stream:
                    await self._read_stream(resp, rec)
                else:
                    doc = json.loads(await resp.read())
                    rec.end = rec.first = clock() - t0
                    u = doc.get("usage") or {}
                    rec.tokens = int(u.get("completion_tokens", 0))
                    _note_cached(rec, u)
                    rec.error = OK
        except TimeoutError:
            rec.error = "timeout"
        except aiohttp.ClientConnectorError:
            rec.error = "connect"
        except (aiohttp.ClientError, ValueError):
            rec.error = "disconnect"
        finally:
            self.in_flight -= 1
            if rec.end < 0 and rec.error != "unfinished":
                rec.end = clock() - t0

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: Record) -> None:
        clock, t0 = self._clock, self._t0
        buf = b""
        count = 0
        usage_tokens = -1
        done = failed = False
        async for data in resp.content.iter_any():
            now = clock() - t0
            buf += data
            if b"\n\n" not in buf:
                continue
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data:"):
                    continue  # SSE comment or keep-alive
                payload = ev[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                if payload.startswith(b'{"error"'):
                    failed = True
                    continue
                if rec.first < 0:
                    doc = json.loads(payload)
                    if _first_text(doc):
                        rec.first = now
                        count = 1
                elif _has_text(payload):
                    count += 1
                if b'"usage":{' in payload:
                    u = json.loads(payload).get("usage") or {}
                    usage_tokens = int(u.get("completion_tokens", -1))
                    _note_cached(rec, u)
        rec.end = clock() - t0
        rec.tokens = usage_tokens if usage_tokens >= 0 else count
        if failed:
            rec.error = "stream_error"
        elif not done:
            rec.error = "incomplete"
        else:
            rec.error = OK
            if rec.first < 0:  # an empty answer: no first token, count the end
                rec.first = rec.end

    # -------------------------------------------------------------------- run

    def _launch(self, rec: Record) -> None:
        self.records.append(rec)
        if self.in_flight >= self.cfg.max_in_flight:
            rec.error = "client_limit"
            rec.end = rec.arrival
            return
        task = asyncio.ensure_future(self._one(rec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_loop(self, rng: random.Random) -> None:
        cfg = self.cfg
        assert cfg.rate is not None
        arrivals = random.Random(rng.getrandbits(64))
        lengths_in = random.Random(rng.getrandbits(64))
        lengths_out = random.Random(rng.getrandbits(64))
        t = 0.0
        limit = cfg.max_requests if cfg.max_requests is not None else math.inf
        n = 0
        while n < limit:
            t += arrivals.expovariate(cfg.rate)
            if t >= cfg.duration_s:
                break
            delay = self._t0 + t - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
            self._launch(Record(t, cfg.input_tokens.sample(lengths_in),
                                cfg.output_tokens.sample(lengths_out)))
            n += 1

    async def _replay(self) -> None:
        """A workload's requests at their own arrival times."""
        wl = self.cfg.workload
        assert wl is not None
        limit = self.cfg.max_requests if self.cfg.max_requests is not None else len(wl)
        blocks = wl.blocks
        sessions = wl.session
        for i in range(min(limit, len(wl))):
            t = wl.arrival_s[i]
            if t >= self.cfg.duration_s:
                break
            delay = self._t0 + t - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
            self._launch(Record(t, wl.input_tokens[i], wl.output_tokens[i],
                                blocks[i] if blocks is not None else None, i,
                                sessions[i] if sessions is not None else None))

    async def _closed_loop(self, rng: random.Random) -> None:
        cfg = self.cfg
        assert cfg.concurrency is not None
        lengths_in = random.Random(rng.getrandbits(64))
        lengths_out = random.Random(rng.getrandbits(64))
        limit = cfg.max_requests if cfg.max_requests is not None else math.inf
        sent = 0

        async def client() -> None:
            nonlocal sent
            while sent < limit:
                now = self._clock() - self._t0
                if now >= cfg.duration_s:
                    return
                sent += 1
                rec = Record(now, cfg.input_tokens.sample(lengths_in),
                             cfg.output_tokens.sample(lengths_out))
                self.records.append(rec)
                await self._one(rec)

        await asyncio.gather(*(client() for _ in range(cfg.concurrency)))

    async def _discover_model(self) -> None:
        assert self._session is not None
        async with self._session.get(self.base + "/v1/models", headers=self.headers) as resp:
            resp.raise_for_status()
            doc = await resp.json()
        models = [m.get("id") for m in doc.get("data", []) if isinstance(m, dict)]
        if not models:
            raise ValueError(f"{self.base}/v1/models lists no model: give one")
        self.model = str(models[0])

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self._emit()

    def _emit(self) -> None:
        if self.progress is None:
            return
        done = failed = rejected = tokens = 0
        for r in self.records:
            e = r.error
            if e == OK:
                done += 1
                tokens += r.tokens
            elif e == "http_429":
                rejected += 1
            elif e != "unfinished":
                failed += 1
        self.progress(Progress(self._clock() - self._t0, self.cfg.duration_s, len(self.records),
                               done, failed, rejected, self.in_flight, tokens))

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=10.0)
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        reporter: asyncio.Task[None] | None = None
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            self._session = session
            if not self.model:
                await self._discover_model()
            rng = random.Random(cfg.seed)
            self._t0 = self._clock()
            if self.progress is not None:
                reporter = asyncio.ensure_future(self._report())
            try:
                if cfg.rate is not None or cfg.workload is not None:
                    await (self._open_loop(rng) if cfg.rate is not None else self._replay())
                    if self._tasks:
                        await asyncio.wait(set(self._tasks), timeout=cfg.drain_s)
                else:
                    await asyncio.wait_for(self._closed_loop(rng),
                                           timeout=cfg.duration_s + cfg.drain_s)
            except TimeoutError:
                pass  # closed loop past its drain: the requests left are unfinished
            finally:
                self.elapsed_s = self._clock() - self._t0
                for task in list(self._tasks):
                    task.cancel()
                if self._tasks:
                    await asyncio.wait(set(self._tasks))
                if reporter is not None:
                    reporter.cancel()
                    await asyncio.gather(reporter, return_exceptions=True)
                self._emit()
        return self.document()

    def document(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "scenario": cfg.label,
            "target": cfg.target,
            "model": self.model,
            "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s,
                    "attainment": cfg.slo.attainment},
            "results": {cfg.label: summarize(self.records, cfg, self.elapsed_s)},
        }


async def run_bench(cfg: BenchConfig, progress: Callable[[Progress], None] | None = None
                    ) -> dict[str, Any]:
    """Run one benchmark; returns ``{"scenario", "target", "model", "slo", "results": {label: ...}}``."""
    return await LoadGenerator(cfg, progress).run()


__all__ = ["BenchConfig", "LoadGenerator", "Progress", "Record", "run_bench", "summarize"]
