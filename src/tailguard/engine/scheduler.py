"""The step scheduler of the engine model: vLLM V1's ``schedule()`` and a step's end.

It models the scheduler of vLLM V1 (``vllm/v1/core/sched/scheduler.py``) with chunked
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

The driver side (inputs, faults, metrics, timing rules) is
:class:`tailguard.engine.model.Engine`, which extends :class:`Scheduler`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tailguard.core.hardware import PerfModel
from tailguard.engine.decode_batch import DecodeBatch
from tailguard.engine.prefix_cache import PrefixCache
from tailguard.engine.request import DECODE, GONE, PREFILL, WAITING, Request, blocks_for
from tailguard.engine.segment import Segment
from tailguard.errors import ConfigError

FIRST_TOKEN = 0
FINISH = 1
FAILED = 2

Event = tuple[float, int, int]
"""``(time, kind, req_id)`` with ``kind`` one of FIRST_TOKEN, FINISH, FAILED."""


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
    # vLLM's ``--long-prefill-token-threshold``: with chunked prefill, a prompt
    # computes at most this many tokens a step, leaving the rest of the budget to
    # the prompts behind it (0: no cap, the whole budget in admission order).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", "must be >= 1")
        if self.block_size < 1:
            raise ConfigError("block_size", "must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold", "must be >= 0 (0: no cap)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running sequence needs a decode token.
            raise ConfigError("max_num_batched_tokens", "must be >= max_num_seqs")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ConfigError("kv_capacity_tokens", "must hold at least one block")


_NO_CHUNKS: list[tuple[Request, int]] = []  # never appended to


class _StepPlan:
    """What the step being composed has taken so far: KV blocks, token budget, prompt chunks."""

    __slots__ = ("budget", "chunks", "preempted", "used")

    def __init__(self, used: int, budget: int, preempted: bool) -> None:
        self.used = used
        self.budget = budget
        self.preempted = preempted
        self.chunks: list[tuple[Request, int]] = []


class Scheduler:
    """The engine's state and its step composition (see the module docstring)."""

    def __init__(self, perf: PerfModel, cfg: EngineConfig, speed: float) -> None:
        self.perf = perf
        self.config = cfg
        cap = (
            cfg.kv_capacity_tokens
            if cfg.kv_capacity_tokens is not None
            else perf.kv_capacity_tokens
        )
        self._bs = bs = cfg.block_size
        self._num_blocks = cap // bs
        self._max_seqs = cfg.max_num_seqs
        self._max_tokens = cfg.max_num_batched_tokens
        self._chunked = cfg.enable_chunked_prefill
        self._long = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        self._speed = speed
        self._copy_coefficients(perf)

        self._now = -math.inf
        self._steps = 0  # steps completed since construction
        self._seg: Segment | None = None
        self._next = math.inf
        self._crashed = False
        self._out: list[Event] = []

        self._reqs: dict[int, Request] = {}
        self._waiting: deque[Request] = deque()  # may hold cancelled entries (state GONE)
        self._num_waiting = 0
        self._running: dict[int, Request] = {}  # admission order
        self._prefilling: dict[int, Request] = {}  # admission order, subset of running
        self._pre_blocks = 0  # KV blocks held by prefilling requests
        # A prefill instance's finished prompts whose KV the decode side has not
        # taken yet (request id -> it and its blocks): held, so not free.
        self._held: dict[int, tuple[Request, int]] = {}
        self._held_blocks = 0

        self._dec = DecodeBatch(bs)

        self._gen_static = 0  # tokens generated by requests outside the decode batch, ever
        self._prompt_total = 0
        self._preemptions = 0
        self._pc = PrefixCache() if cfg.enable_prefix_caching else None
        self._hits: dict[int, int] = {}  # request -> prompt tokens served from the cache
        self._pc_queries = 0  # prompt tokens looked up at admission (vLLM's, in tokens)
        self._pc_hit_tokens = 0

    def _copy_coefficients(self, perf: PerfModel) -> None:
        # Roofline coefficients, copied for the decode-run formula.
        self._weight_s = perf.weight_s
        self._kv_s = perf.kv_s
        self._tok_s = perf.token_flop_s
        self._attn_s = perf.attn_flop_s
        self._fixed_s = perf.fixed_s
        self._ar_s = perf.allreduce_token_s

    def _join_decode(self, r: Request) -> None:
        self._gen_static -= r.gen
        self._dec.join(r, self._steps)

    def _leave_decode(self, r: Request) -> None:
        self._dec.leave(r, self._steps)
        self._gen_static += r.gen

    def _preempt_last(self) -> tuple[Request, int]:
        """Preempt the most recently admitted running request; return it and the blocks freed."""
        running = self._running
        r = running.pop(next(reversed(running)))
        if r.state == DECODE:
            freed = blocks_for(r.prompt + r.g0 - r.s0 + self._steps, self._bs)
            self._leave_decode(r)
        else:
            freed = r.alloc
            del self._prefilling[r.rid]
            self._pre_blocks -= freed
            r.alloc = 0
        r.state = WAITING
        r.cached = 0
        r.remote = False  # its transferred KV is gone with the rest: recomputed here
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
                if r.state != PREFILL:
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
                    self._done(r)
                    out.append((t, FINISH, r.rid))
                else:
                    self._join_decode(r)
        for r in self._dec.finished_by(steps):
            self._leave_decode(r)
            rid = r.rid
            del self._running[rid]
            del self._reqs[rid]
            self._done(r)
            out.append((t, FINISH, rid))
        if len(out) - mark > 1:
            out[mark:] = sorted(out[mark:])
        self._seg = None
        if not self._crashed:
            self._compose(t)

    def _done(self, r: Request) -> None:
        """A request has generated its last token: its KV is freed, or held for the
        decode side when it is a disaggregated prefill (``Request.hold``)."""
        r.state = GONE
        if r.hold:
            n = blocks_for(r.prompt + r.output - 1, self._bs)
            self._held[r.rid] = (r, n)
            self._held_blocks += n
        elif r.blocks and self._pc is not None:
            self._cache_done(r)

    def _compose(self, t: float) -> None:
        """Compose the step that starts at ``t`` (vLLM V1 ``schedule()``) and the segment it opens."""
        used = self._dec.blocks(self._steps) + self._pre_blocks + self._held_blocks
        preempted = False
        # 1. decode growth: preempt from the back until the batch fits
        while used > self._num_blocks:
            used -= self._preempt_last()[1]
            preempted = True
        budget = self._max_tokens - self._dec.n
        if budget > 0 and (self._prefilling or (self._num_waiting and not preempted)):
            plan = _StepPlan(used, budget, preempted)
            # 2. partly prefilled prompts, in admission order
            if self._prefilling:
                self._continue_prefills(plan)
            # 3. admission from the waiting FIFO (none in a step that preempted)
            if not plan.preempted and self._num_waiting and plan.budget > 0:
                self._admit_waiting(plan)
            used, chunks, preempted = plan.used, plan.chunks, plan.preempted
        else:
            chunks = _NO_CHUNKS  # a pure-decode step
        free = self._num_blocks - used
        pc = self._pc
        if pc is not None and pc.free_tokens > free * self._bs:
            pc.fit(free * self._bs)
        self._open_segment(t, chunks, preempted, free)

    def _continue_prefills(self, plan: _StepPlan) -> None:
        """Give the step's budget to partly prefilled prompts, preempting from the back for room."""
        bs, nb, chunks = self._bs, self._num_blocks, plan.chunks
        used, budget = plan.used, plan.budget
        for r in list(self._prefilling.values()):
            if r.state != PREFILL or budget <= 0:
                break  # preempted: so is everything admitted after it
            p = r.target - r.cached
            if 0 < self._long < p:
                p = self._long
            if p > budget and self._chunked:
                p = budget
            alloc = blocks_for(r.cached + p, bs)
            extra = alloc - r.alloc
            while used + extra > nb:
                victim, freed = self._preempt_last()
                plan.preempted = True
                used -= freed
                if victim is r:
                    break
            if r.state != PREFILL:
                break
            r.alloc = alloc
            self._pre_blocks += extra
            used += extra
            chunks.append((r, p))
            budget -= p
        plan.used, plan.budget = used, budget

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Admit from the head of the waiting FIFO while seats, budget and KV blocks allow."""
        bs, nb, chunks = self._bs, self._num_blocks, plan.chunks
        used, budget = plan.used, plan.budget
        pc = self._pc
        running = self._running
        waiting = self._waiting
        max_seqs = self._max_seqs
        while waiting and budget > 0 and len(running) < max_seqs:
            r = waiting[0]
            if r.state != WAITING:
                waiting.popleft()
                continue
            target = r.prompt + r.gen
            k = hit = 0
            if r.remote:
                # Its prompt's KV arrived from a prefill instance (vLLM computes the
                # last token again, as on a full prefix-cache hit).
                hit = target - 1
            elif r.blocks and pc is not None:
                # vLLM computes at least the last prompt token itself.
                k = pc.lookup(r.blocks, (target - 1) // r.bt)
                hit = k * r.bt
            p = target - hit
            if 0 < self._long < p:
                p = self._long
            if p > budget and (self._chunked or chunks):
                if not self._chunked:
                    break
                p = budget
            need = blocks_for(hit + p, bs)
            if used + need > nb:
                break
            waiting.popleft()
            self._num_waiting -= 1
            r.state = PREFILL
            r.target = target
            r.cached = hit
            if pc is not None and not r.remote:
                self._count_lookup(r, target, hit, k)
            r.alloc = need
            running[r.rid] = r
            self._prefilling[r.rid] = r
            self._pre_blocks += need
            used += need
            chunks.append((r, p))
            budget -= p
        plan.used, plan.budget = used, budget

    def _count_lookup(self, r: Request, target: int, hit: int, k: int) -> None:
        """Count a first admission's prefix-cache lookup; hold the ``k`` blocks it found."""
        if r.rid not in self._hits and not r.first_done:
            self._hits[r.rid] = hit
            self._pc_queries += target
            self._pc_hit_tokens += hit
        if k:
            self._pc.acquire(r.blocks[:k], r.bt)  # type: ignore[union-attr]
            r.nheld = k

    def _open_segment(
        self, t: float, chunks: list[tuple[Request, int]], preempted: bool, free: int
    ) -> None:
        """Time the composed step: a prefill step, a pipelined step or a closed-form decode run."""
        s = self._steps
        dec = self._dec
        n_dec = dec.n
        ctx = dec.e + n_dec * s
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
            # Idle with prompts waiting is legal only while held KV leaves them no
            # room: releasing it composes again (Engine.release_kv).
            if self._running or (self._num_waiting and not self._held_blocks):
                raise RuntimeError("engine scheduler stalled with work pending")
            self._seg = None
            return
        if not self.perf.closed_form:  # a pipeline: each step timed on its own
            dt = self.perf.step_time(n_dec, ctx) / speed
            self._seg = Segment(t, s, 1, t + dt, speed)
            return
        # After a preemption the freed blocks may admit someone at the next boundary.
        n = 1 if preempted else dec.run_length(s, free)
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
