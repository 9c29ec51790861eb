"""A model of one continuous-batching inference engine (vLLM V1-like).

What it models
--------------
The scheduler of vLLM V1 (``vllm/v1/core/sched/scheduler.py``) with chunked
prefill in the style of Sarathi-Serve (Agrawal et al., OSDI 2024): every step
carries one decode token for each running sequence whose prompt is done, and
spends the rest of a per-step token budget on prompt chunks. Each step is
composed at a step boundary:

1. Decode: every running request past its prefill decodes one token. A
   sequence holding ``n`` tokens of KV uses ``ceil(n/block_size)`` blocks; a
   decode step needs room for ``prompt + generated`` tokens. When the cache
   cannot hold that growth the most recently admitted running request is
   preempted (recompute mode: it frees its KV and returns to the *front* of
   the waiting queue; when re-admitted it prefills prompt + generated tokens
   again, and its first-token time is not re-emitted).
2. Prefill of running requests: the remaining budget
   (``max_num_batched_tokens - num_decoding``) goes to partly prefilled
   prompts in admission order, chunked; a chunk that does not fit in the
   cache preempts from the back of the running list too.
3. Admission: while ``running < max_num_seqs`` and budget is left, the head of
   the waiting FIFO is admitted if the KV blocks of its first chunk are free
   (FIFO: the queue stops at the first request that does not fit). As in
   vLLM, no request is admitted in a step that preempted one.

Prefix caching (on by default, as in vLLM V1; :mod:`tailguard.engine.prefix_cache`):
a request may carry the hashes of its full blocks; at admission the leading
blocks found in the cache count as computed (at least the last prompt token is
computed again), so its prefill starts there and its attention still covers
them. A request's blocks stay cached after it ends, as free KV evicted least
recently used first when running requests need the space.

A request's first token appears at the end of the step that computes its
last prompt chunk; every later step it takes part in adds one token; it
finishes at ``output_tokens`` tokens. The step time is
``PerfModel.step_time(...) / speed``.

Timing rules (where a real engine is ambiguous, the choice made here):

* A step is composed the moment the previous one (or a pause) ends, or when
  an idle engine receives a request. An input (submit, cancel, speed change, stall)
  at time ``now`` is seen by the first step composed *after* ``now``; an
  input that arrives exactly at a step boundary is seen by the step after
  the one composed there. The step in progress always completes as composed
  (a cancelled request's output from it is dropped).
* A request whose ``prompt + output - 1`` tokens cannot fit in the KV cache
  (it could never finish, as vLLM refuses prompts over ``max_model_len``) is
  rejected with a ``FAILED`` event at its submit time.
* While crashed, ``submit`` answers with a ``FAILED`` event at once (reported
  by the next :meth:`Engine.advance`); ``restart`` accepts requests again.

How it stays fast
-----------------
A simulator drives tens of millions of engine steps, so a step is not an
event. Steps are grouped into segments (:mod:`tailguard.engine.segment`):
a step that carries prefill chunks is a segment of its own, and a
pure-decode stretch with a fixed batch is one segment whose step times are
summed in closed form. A run ends at the earliest finish or at the first step
whose KV blocks would not fit; both are computed without touching each
request:

* every decoding request stores ``e = prompt + generated - step_counter`` at
  the moment it joins the decode batch, so its context at step ``s`` is
  ``e + s`` and its token count follows the engine's step counter;
* the batch keeps ``sum(e)``, ``sum(e // bs)`` and a ``block_size``-bin
  histogram of ``e % bs``: the batch's KV blocks at any future step, and the
  first step at which they outgrow the cache, take ``O(block_size)``;
* finishing steps sit in a heap (lazy deletion on cancel and preemption).

An input in the middle of a run truncates it to the step in progress: the
inverse of the closed-form sum (a quadratic root, fixed up by +-1), ``O(1)``. With ``step_by_step=True`` the
engine reports every step boundary from :meth:`Engine.next_event_time` (for
an emulator that streams tokens) and computes the very same numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from heapq import heappop, heappush

from tailguard.core.hardware import PerfModel
from tailguard.engine.prefix_cache import PrefixCache
from tailguard.engine.segment import Segment
from tailguard.errors import ConfigError

FIRST_TOKEN = 0
FINISH = 1
FAILED = 2

Event = tuple[float, int, int]
"""``(time, kind, req_id)`` with ``kind`` one of FIRST_TOKEN, FINISH, FAILED."""

_WAITING = 0
_PREFILL = 1
_DECODE = 2
_GONE = 3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler settings, named after vLLM's engine arguments.

    ``kv_capacity_tokens`` None takes the capacity from the performance model.
    With ``enable_chunked_prefill`` False a prompt is prefilled whole in one
    step; the first prompt of a step may exceed the token budget (the budget
    is raised to fit it), later ones must fit in what is left.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    # vLLM V1's automatic prefix caching is on by default (engine/prefix_cache.py).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", "must be >= 1")
        if self.block_size < 1:
            raise ConfigError("block_size", "must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running sequence needs a decode token.
            raise ConfigError("max_num_batched_tokens", "must be >= max_num_seqs")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ConfigError("kv_capacity_tokens", "must hold at least one block")


class Request:
    """Scheduler state of one request (internal; exposed for type hints only)."""

    __slots__ = (
        "alloc",
        "blocks",
        "bt",
        "cached",
        "epoch",
        "first_done",
        "g0",
        "gen",
        "nheld",
        "output",
        "prompt",
        "rid",
        "s0",
        "state",
        "target",
    )

    def __init__(
        self, rid: int, prompt: int, output: int, blocks: tuple[int, ...] = (), bt: int = 0
    ) -> None:
        self.rid = rid
        self.prompt = prompt
        self.output = output
        self.state = _WAITING
        self.gen = 0  # tokens generated, valid while not decoding
        self.target = prompt  # tokens to prefill: prompt + tokens generated before a preemption
        self.cached = 0  # prefill tokens computed so far
        self.alloc = 0  # KV blocks held while prefilling
        self.first_done = False
        self.g0 = 0  # tokens generated when it joined the decode batch
        self.s0 = 0  # engine step counter when it joined the decode batch
        self.epoch = 0  # identifies its current stay in the decode batch (heap validity)
        self.blocks = blocks  # hashes of its full blocks of prompt + answer (bt tokens each)
        self.bt = bt
        self.nheld = 0  # leading blocks it holds a reference on in the prefix cache


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class Engine:
    """One inference engine; see the module docstring for the model.

    Driver protocol: call :meth:`advance` at :meth:`next_event_time` (and may
    call it at any later time); :meth:`submit`, :meth:`cancel`,
    :meth:`set_speed`, :meth:`stall`, :meth:`crash` and :meth:`restart` may be
    called at any ``now`` not before the last call; re-read
    :meth:`next_event_time` after every call. Metrics reflect the state as of
    the last call.
    """

    def __init__(
        self,
        perf: PerfModel,
        config: EngineConfig | None = None,
        *,
        speed: float = 1.0,
        step_by_step: bool = False,
    ) -> None:
        cfg = config if config is not None else EngineConfig()
        if speed <= 0:
            raise ConfigError("speed", "must be > 0")
        self.perf = perf
        self.config = cfg
        self.step_by_step = step_by_step
        cap = cfg.kv_capacity_tokens if cfg.kv_capacity_tokens is not None else perf.kv_capacity_tokens
        self._bs = bs = cfg.block_size
        self._num_blocks = cap // bs
        self._max_seqs = cfg.max_num_seqs
        self._max_tokens = cfg.max_num_batched_tokens
        self._chunked = cfg.enable_chunked_prefill
        self._speed = speed
        self._copy_coefficients(perf)

        self._now = -math.inf
        self._steps = 0  # steps completed since construction
        self._seg: Segment | None = None
        self._next = math.inf
        self._crashed = False
        self._out: list[Event] = []

        self._reqs: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()  # may hold cancelled entries (state _GONE)
        self._num_waiting = 0
        self._running: dict[int, Request] = {}  # admission order
        self._prefilling: dict[int, Request] = {}  # admission order, subset of running
        self._pre_blocks = 0  # KV blocks held by prefilling requests

        # Decode batch aggregates over e = prompt + g0 - s0 (context at step s is e + s).
        self._dec_n = 0
        self._dec_e = 0  # sum of e
        self._dec_q = 0  # sum of e // bs
        self._dec_hist = [0] * bs  # histogram of e % bs
        self._dec_g = 0  # sum of g0 - s0: tokens of the batch at step s are this + n*s
        self._heap: list[tuple[int, int, int, Request]] = []  # (finish step, id, epoch, req)
        self._epoch = 0

        self._gen_static = 0  # tokens generated by requests outside the decode batch, ever
        self._prompt_total = 0
        self._preemptions = 0
        self._pc = PrefixCache() if cfg.enable_prefix_caching else None
        self._hits: dict[int, int] = {}  # request -> prompt tokens served from the cache
        self._pc_queries = 0  # prompt tokens looked up at admission (vLLM's, in tokens)
        self._pc_hit_tokens = 0

    # ------------------------------------------------------------------ driver

    def next_event_time(self) -> float:
        """When the driver must next call :meth:`advance` (``math.inf`` when idle)."""
        return self._next

    def advance(self, now: float) -> list[Event]:
        """Process everything up to ``now``; return the events since the last call, in time order."""
        self._bring_to(now)
        out = self._out
        self._out = []
        self._update_next()
        return out

    def submit(
        self,
        req_id: int,
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        blocks: tuple[int, ...] = (),
        block_tokens: int = 0,
    ) -> None:
        """Queue a request; a request that can never fit fails at once (see module docstring).

        ``blocks`` are the hashes of its full ``block_tokens``-token blocks of
        prompt and then answer (chained: equal hashes, equal prefix), for the
        prefix cache; the prompt's are looked up at admission.
        """
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        self._bring_to(now)
        if req_id in self._reqs:
            raise ValueError(f"request {req_id} is already in the engine")
        if self._crashed or _blocks(prompt_tokens + output_tokens - 1, self._bs) > self._num_blocks:
            self._out.append((now, FAILED, req_id))
        else:
            self._truncate()
            if blocks and block_tokens < 1:
                raise ValueError("blocks need block_tokens >= 1")
            r = Request(req_id, prompt_tokens, output_tokens, blocks, block_tokens)
            self._reqs[req_id] = r
            self._waiting.append(r)
            self._num_waiting += 1
            if self._seg is None:
                self._compose(now)
        self._update_next()

    def cancel(self, req_id: int, now: float) -> bool:
        """Remove a request wherever it is and free its KV; False if it is not held."""
        self._bring_to(now)
        r = self._reqs.pop(req_id, None)
        if r is None:
            self._update_next()
            return False
        self._truncate()
        self._hits.pop(req_id, None)
        if r.nheld:
            self._uncache(r)
        if r.state == _WAITING:
            self._num_waiting -= 1  # its deque entry is skipped later
        elif r.state == _PREFILL:
            del self._running[req_id]
            del self._prefilling[req_id]
            self._pre_blocks -= r.alloc
        elif r.state == _DECODE:
            self._leave_decode(r)
            del self._running[req_id]
        r.state = _GONE
        self._update_next()
        return True

    def _copy_coefficients(self, perf: PerfModel) -> None:
        # Roofline coefficients, copied for the decode-run formula.
        self._weight_s = perf.weight_s
        self._kv_s = perf.kv_s
        self._tok_s = perf.token_flop_s
        self._attn_s = perf.attn_flop_s
        self._fixed_s = perf.fixed_s
        self._ar_s = perf.allreduce_token_s

    def set_perf(self, perf: PerfModel, now: float) -> None:
        """Step times from ``perf`` (the same replica with a GPU slowed or restored,
        PerfModel.slowed) from the next step boundary on; its KV capacity is kept."""
        self._bring_to(now)
        self._truncate()
        self.perf = perf
        self._copy_coefficients(perf)
        self._update_next()

    def set_speed(self, factor: float, now: float) -> None:
        """Scale step times by ``1/factor`` from the next step boundary on."""
        if factor <= 0:
            raise ValueError("speed factor must be > 0")
        self._bring_to(now)
        self._truncate()
        self._speed = factor
        self._update_next()

    def stall(self, duration_s: float, now: float) -> None:
        """Pause the engine: the step in progress (or an idle engine) ends ``duration_s`` later."""
        if duration_s < 0:
            raise ValueError("stall duration must be >= 0")
        self._bring_to(now)
        if not self._crashed:
            seg = self._seg
            if seg is None:
                self._seg = Segment(now, self._steps, 0, now + duration_s, self._speed)
            else:
                self._truncate()
                seg.end += duration_s
        self._update_next()

    def crash(self, now: float) -> list[Event]:
        """Fail every request held and stop accepting work.

        Returns the events not yet reported by :meth:`advance` (any kind, at
        times <= ``now``: a caller that handles a crash before an engine event
        at the same instant gets them here), then one ``FAILED`` at ``now`` per
        request held, by id.
        """
        self._bring_to(now)
        out = self._out
        self._out = []
        for rid in sorted(self._reqs):
            out.append((now, FAILED, rid))
        self._gen_static += self._dec_g + self._dec_n * self._steps
        self._reqs.clear()
        self._waiting.clear()
        self._num_waiting = 0
        self._running.clear()
        self._prefilling.clear()
        self._pre_blocks = 0
        self._dec_n = self._dec_e = self._dec_q = self._dec_g = 0
        self._dec_hist = [0] * self._bs
        self._heap.clear()
        self._seg = None
        self._crashed = True
        if self._pc is not None:
            self._pc.clear()
        self._hits.clear()
        self._update_next()
        return out

    def restart(self, now: float) -> None:
        """Accept requests again after :meth:`crash` (an empty engine)."""
        self._bring_to(now)
        self._crashed = False
        self._update_next()

    # ----------------------------------------------------------------- metrics

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_gpu_blocks(self) -> int:
        return self._num_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the cache holds (whole blocks)."""
        return self._num_blocks * self._bs

    @property
    def kv_used_blocks(self) -> int:
        return self._dec_blocks(self._steps) + self._pre_blocks

    @property
    def kv_used_tokens(self) -> int:
        """KV in use, counted in whole blocks (as vLLM's usage gauge)."""
        return self.kv_used_blocks * self._bs

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self._num_blocks if self._num_blocks else 0.0

    @property
    def num_preemptions(self) -> int:
        return self._preemptions

    @property
    def prompt_tokens_total(self) -> int:
        """Prompt tokens of requests that produced their first token."""
        return self._prompt_total

    @property
    def generation_tokens_total(self) -> int:
        return self._gen_static + self._dec_g + self._dec_n * self._steps

    @property
    def crashed(self) -> bool:
        return self._crashed

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def steps_total(self) -> int:
        """Engine steps completed so far."""
        return self._steps

    @property
    def prefix_cache_queries_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache at admission (vLLM's queries counter)."""
        return self._pc_queries

    @property
    def prefix_cache_hits_tokens(self) -> int:
        """Prompt tokens found there (vLLM's hits counter)."""
        return self._pc_hit_tokens

    @property
    def prefix_cache_blocks(self) -> int:
        """Hashed blocks the cache holds, in use or free."""
        return len(self._pc) if self._pc is not None else 0

    def cached_tokens(self, req_id: int) -> int:
        """Prompt tokens of a request served from the prefix cache at its first
        admission (``usage.prompt_tokens_details.cached_tokens``); asked once, at
        its end: the count is forgotten."""
        return self._hits.pop(req_id, 0)

    def tokens_generated(self, req_id: int) -> int:
        """Tokens generated so far by a held request (KeyError once it has ended)."""
        r = self._reqs[req_id]
        if r.state == _DECODE:
            return r.g0 + self._steps - r.s0
        return r.gen

    def tokens_by(self, req_id: int, now: float) -> int:
        """Tokens a held request has generated by ``now`` (not before the engine's
        last event), counting the steps of the decode run under way, without
        advancing the engine (KeyError once it has ended): what a client reading
        the stream has seen."""
        r = self._reqs[req_id]
        if r.state != _DECODE:
            return r.gen
        steps, seg = self._steps, self._seg
        if seg is not None and seg.n > 1 and now > self._now:
            steps = max(steps, seg.s0 + seg.steps_done_by(min(now, seg.end)))
        return r.g0 + steps - r.s0

    # ---------------------------------------------------------------- internals

    def _update_next(self) -> None:
        seg = self._seg
        if self._out:
            self._next = self._now
        elif seg is None:
            self._next = math.inf
        elif seg.n == 0:
            self._next = seg.end if (self._running or self._num_waiting) else math.inf
        elif self.step_by_step:
            k = self._steps - seg.s0 + 1
            self._next = seg.end if k >= seg.n else seg.time_at(k)
        else:
            self._next = seg.end

    def _bring_to(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        seg = self._seg
        while seg is not None and seg.end <= now:
            self._end_segment(seg)
            seg = self._seg
        if seg is not None and seg.n > 1:
            self._steps = seg.s0 + seg.steps_done_by(now)
        self._now = now

    def _truncate(self) -> None:
        """Make the step in progress the last of its segment (an input changes the next one)."""
        seg = self._seg
        if seg is not None and seg.n > 1:
            k = self._steps - seg.s0 + 1
            if k < seg.n:
                seg.n = k
                seg.end = seg.time_at(k)

    def _dec_blocks(self, s: int) -> int:
        """KV blocks the decode batch needs for step ``s``: sum of ceil((e_i + s)/bs)."""
        n = self._dec_n
        if n == 0:
            return 0
        bs = self._bs
        m, j = divmod(s, bs)
        # (e_i + s) = bs*(q_i + m) + (r_i + j) with 0 <= r_i + j <= 2*bs - 2
        total = self._dec_q + n * m + n
        if j == 0:
            total -= self._dec_hist[0]
        elif j > 1:
            total += sum(self._dec_hist[bs + 1 - j :])
        return total

    def _join_decode(self, r: Request) -> None:
        s = self._steps
        g0 = r.gen
        e = r.prompt + g0 - s
        q, rem = divmod(e, self._bs)
        self._dec_n += 1
        self._dec_e += e
        self._dec_q += q
        self._dec_hist[rem] += 1
        self._dec_g += g0 - s
        self._gen_static -= g0
        self._epoch += 1
        r.state = _DECODE
        r.g0 = g0
        r.s0 = s
        r.epoch = self._epoch
        heappush(self._heap, (s + r.output - g0, r.rid, self._epoch, r))

    def _leave_decode(self, r: Request) -> None:
        e = r.prompt + r.g0 - r.s0
        q, rem = divmod(e, self._bs)
        self._dec_n -= 1
        self._dec_e -= e
        self._dec_q -= q
        self._dec_hist[rem] -= 1
        self._dec_g -= r.g0 - r.s0
        r.gen = r.g0 + self._steps - r.s0
        self._gen_static += r.gen
        r.state = _WAITING  # callers set the final state

    def _preempt_last(self) -> tuple[Request, int]:
        """Preempt the most recently admitted running request; return it and the blocks freed."""
        running = self._running
        r = running.pop(next(reversed(running)))
        if r.state == _DECODE:
            freed = _blocks(r.prompt + r.g0 - r.s0 + self._steps, self._bs)
            self._leave_decode(r)
        else:
            freed = r.alloc
            del self._prefilling[r.rid]
            self._pre_blocks -= freed
            r.alloc = 0
        r.state = _WAITING
        r.cached = 0
        if r.nheld:
            self._uncache(r)
        self._waiting.appendleft(r)
        self._num_waiting += 1
        self._preemptions += 1
        return r, freed

    def _end_segment(self, seg: Segment) -> None:
        steps = self._steps = seg.s0 + seg.n
        t = seg.end
        out = self._out
        mark = len(out)
        if seg.chunks is not None:
            for r, p in seg.chunks:
                if r.state != _PREFILL:
                    continue  # cancelled while the step ran
                r.cached += p
                if r.cached < r.target:
                    continue
                del self._prefilling[r.rid]
                self._pre_blocks -= r.alloc
                r.alloc = 0
                if r.blocks and self._pc is not None:
                    m = min(len(r.blocks), r.target // r.bt)
                    if m > r.nheld:
                        self._pc.acquire(r.blocks[r.nheld : m], r.bt)
                        r.nheld = m
                r.gen += 1
                self._gen_static += 1
                if not r.first_done:
                    r.first_done = True
                    self._prompt_total += r.prompt
                    out.append((t, FIRST_TOKEN, r.rid))
                if r.gen >= r.output:
                    del self._running[r.rid]
                    del self._reqs[r.rid]
                    r.state = _GONE
                    if r.blocks and self._pc is not None:
                        self._cache_done(r)
                    out.append((t, FINISH, r.rid))
                else:
                    self._join_decode(r)
        heap = self._heap
        while heap and heap[0][0] <= steps:
            _, rid, epoch, r = heappop(heap)
            if r.epoch != epoch or r.state != _DECODE:
                continue  # stale: cancelled or preempted
            self._leave_decode(r)
            r.state = _GONE
            del self._running[rid]
            del self._reqs[rid]
            if r.blocks and self._pc is not None:
                self._cache_done(r)
            out.append((t, FINISH, rid))
        if len(out) - mark > 1:
            out[mark:] = sorted(out[mark:])
        self._seg = None
        if not self._crashed:
            self._compose(t)

    def _compose(self, t: float) -> None:
        """Compose the step that starts at ``t`` (vLLM V1 ``schedule()``) and the segment it opens."""
        s = self._steps
        bs = self._bs
        nb = self._num_blocks
        running = self._running
        used = self._dec_blocks(s) + self._pre_blocks
        preempted = False
        # 1. decode growth: preempt from the back until the batch fits
        while used > nb:
            _, freed = self._preempt_last()
            used -= freed
            preempted = True
        budget = self._max_tokens - self._dec_n
        chunks: list[tuple[Request, int]] = []
        # 2. partly prefilled prompts, in admission order
        if self._prefilling and budget > 0:
            for r in list(self._prefilling.values()):
                if r.state != _PREFILL or budget <= 0:
                    break  # preempted: so is everything admitted after it
                p = r.target - r.cached
                if p > budget and self._chunked:
                    p = budget
                alloc = _blocks(r.cached + p, bs)
                extra = alloc - r.alloc
                while used + extra > nb:
                    victim, freed = self._preempt_last()
                    preempted = True
                    used -= freed
                    if victim is r:
                        break
                if r.state != _PREFILL:
                    break
                r.alloc = alloc
                self._pre_blocks += extra
                used += extra
                chunks.append((r, p))
                budget -= p
        # 3. admission from the waiting FIFO
        pc = self._pc
        if not preempted and self._num_waiting and budget > 0:
            waiting = self._waiting
            max_seqs = self._max_seqs
            while waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                if r.state != _WAITING:
                    waiting.popleft()
                    continue
                target = r.prompt + r.gen
                k = hit = 0
                if r.blocks and pc is not None:
                    # vLLM computes at least the last prompt token itself.
                    k = pc.lookup(r.blocks, (target - 1) // r.bt)
                    hit = k * r.bt
                p = target - hit
                if p > budget and (self._chunked or chunks):
                    if not self._chunked:
                        break
                    p = budget
                need = _blocks(hit + p, bs)
                if used + need > nb:
                    break
                waiting.popleft()
                self._num_waiting -= 1
                r.state = _PREFILL
                r.target = target
                r.cached = hit
                if pc is not None and r.rid not in self._hits and not r.first_done:
                    self._hits[r.rid] = hit
                    self._pc_queries += target
                    self._pc_hit_tokens += hit
                if k:
                    pc.acquire(r.blocks[:k], r.bt)  # type: ignore[union-attr]
                    r.nheld = k
                r.alloc = need
                running[r.rid] = r
                self._prefilling[r.rid] = r
                self._pre_blocks += need
                used += need
                chunks.append((r, p))
                budget -= p
        if pc is not None and pc.free_tokens > (nb - used) * bs:
            pc.fit((nb - used) * bs)
        n_dec = self._dec_n
        ctx = self._dec_e + n_dec * s
        speed = self._speed
        if chunks:
            p_tok = 0
            p_ctx = 0
            p_attn = 0.0
            for r, p in chunks:
                c = r.cached
                p_tok += p
                p_ctx += c + p
                p_attn += p * (c + 0.5 * p)
            dt = self.perf.step_time(n_dec, ctx, p_tok, p_ctx, p_attn) / speed
            seg = Segment(t, s, 1, t + dt, speed)
            seg.chunks = chunks
            self._seg = seg
            return
        if n_dec == 0:
            if running or self._num_waiting:
                raise RuntimeError("engine scheduler stalled with work pending")
            self._seg = None
            return
        if not self.perf.closed_form:  # a pipeline: each step timed on its own
            dt = self.perf.step_time(n_dec, ctx) / speed
            self._seg = Segment(t, s, 1, t + dt, speed)
            return
        # After a preemption the freed blocks may admit someone at the next boundary.
        n = 1 if preempted else self._run_length(s, nb - used)
        self._seg = Segment.decode_run(
            t,
            s,
            n,
            speed,
            m0=self._weight_s + self._kv_s * ctx,
            m1=self._kv_s * n_dec,
            c0=self._tok_s * n_dec + self._attn_s * ctx,
            c1=self._attn_s * n_dec,
            k=self._fixed_s + self._ar_s * n_dec,
        )

    def _uncache(self, r: Request) -> None:
        """A request leaves the running set early: its cached blocks become free."""
        assert self._pc is not None
        self._pc.release(r.blocks[: r.nheld])
        r.nheld = 0

    def _cache_done(self, r: Request) -> None:
        """A finished request frees its blocks, its answer's with them (tail first)."""
        assert self._pc is not None
        end = min(len(r.blocks), (r.prompt + r.output - 1) // r.bt)
        if end > r.nheld:
            self._pc.add_free(r.blocks[r.nheld : end], r.bt)
        self._pc.release(r.blocks[: r.nheld])
        r.nheld = 0

    def _run_length(self, s: int, free: int) -> int:
        """Steps of a pure-decode run from step ``s``: up to the first finish or KV overflow."""
        heap = self._heap
        while True:  # drop stale heap tops (cancelled or preempted requests)
            top = heap[0]
            r = top[3]
            if r.epoch == top[2] and r.state == _DECODE:
                break
            heappop(heap)
        n_fin = top[0] - s
        # Blocks gained by step s+k: sum_i floor((k + u_i)/bs), u_i = (ctx_i(s) - 1) % bs.
        # With free = n*m0 + rem, the first overflow is at k = m0*bs + j for the smallest
        # j whose count of u_i >= bs - j exceeds rem (else at (m0 + 1)*bs).
        bs = self._bs
        n = self._dec_n
        m0, rem = divmod(free, n)
        if m0 * bs >= n_fin:
            return n_fin
        hist = self._dec_hist
        shift = (s - 1) % bs  # u = (r + s - 1) % bs for e % bs == r
        cum = 0
        n_kv = (m0 + 1) * bs
        for j in range(1, bs):
            cum += hist[(bs - j - shift) % bs]
            if cum > rem:
                n_kv = m0 * bs + j
                break
        return n_fin if n_fin < n_kv else n_kv


__all__ = ["FAILED", "FINISH", "FIRST_TOKEN", "Engine", "EngineConfig", "Event"]
