"""A model of one continuous-batching inference engine (vLLM V1-like).

What it models: the scheduler of vLLM V1 with chunked prefill and prefix caching,
step by step (:mod:`tailguard.engine.scheduler` says how a step is composed).
This module is the engine a driver sees: inputs, faults, metrics and when
things happen.

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
request, from the decode batch's aggregates (:mod:`tailguard.engine.decode_batch`).

An input in the middle of a run truncates it to the step in progress: the
inverse of the closed-form sum (a quadratic root, fixed up by +-1), ``O(1)``.
With ``step_by_step=True`` the engine reports every step boundary from
:meth:`Engine.next_event_time` (for an emulator that streams tokens) and
computes the very same numbers.
"""

from __future__ import annotations

import math

from tailguard.core.hardware import PerfModel
from tailguard.engine.config import EngineConfig
from tailguard.engine.request import DECODE, GONE, PREFILL, WAITING, Request, blocks_for
from tailguard.engine.scheduler import FAILED, FINISH, FIRST_TOKEN, Event, Scheduler
from tailguard.engine.segment import Segment
from tailguard.errors import ConfigError


class Engine(Scheduler):
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
        if speed <= 0:
            raise ConfigError("speed", "must be > 0")
        super().__init__(perf, config if config is not None else EngineConfig(), speed)
        self.step_by_step = step_by_step

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
        *,
        remote_kv: bool = False,
        hold_kv: bool = False,
        priority: int = 0,
    ) -> None:
        """Queue a request; a request that can never fit fails at once (see module docstring).

        ``blocks`` are the hashes of its full ``block_tokens``-token blocks of
        prompt and then answer (chained: equal hashes, equal prefix), for the
        prefix cache; the prompt's are looked up at admission.

        Disaggregated serving (vLLM's P/D): ``remote_kv`` on a decode instance,
        the prompt's KV has arrived from a prefill instance, so admission takes
        its blocks and computes only the last prompt token (a preemption drops
        the KV and the prompt is then computed here); ``hold_kv`` on a prefill
        instance, the request's KV stays held after it ends, until
        :meth:`release_kv` (the decode side has pulled it, or gave up).

        ``priority``: as vLLM's priority scheduling, a request waits behind those
        of a lower or equal value only (all 0: first come, first served).
        """
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        self._bring_to(now)
        if req_id in self._reqs:
            raise ValueError(f"request {req_id} is already in the engine")
        if (
            self._crashed
            or blocks_for(prompt_tokens + output_tokens - 1, self._bs) > self._num_blocks
        ):
            self._out.append((now, FAILED, req_id))
        else:
            self._truncate()
            if blocks and block_tokens < 1:
                raise ValueError("blocks need block_tokens >= 1")
            if req_id in self._held:
                raise ValueError(f"request {req_id} still holds KV here")
            r = Request(req_id, prompt_tokens, output_tokens, blocks, block_tokens,
                        remote_kv, hold_kv, priority)
            self._reqs[req_id] = r
            w = self._waiting
            if w and w[-1].priority > priority:  # ahead of every waiting one of a higher value
                i = 0
                while i < len(w) and w[i].priority <= priority:
                    i += 1
                w.insert(i, r)
            else:
                w.append(r)
            self._num_waiting += 1
            if self._seg is None:
                self._compose(now)
        self._update_next()

    def cancel(self, req_id: int, now: float) -> bool:
        """Remove a request wherever it is and free its KV; False if it is not held."""
        if req_id in self._held:
            return self.release_kv(req_id, now)
        self._bring_to(now)
        r = self._reqs.pop(req_id, None)
        if r is None:
            self._update_next()
            return False
        self._truncate()
        self._hits.pop(req_id, None)
        if r.nheld:
            self._uncache(r)
        if r.state == WAITING:
            self._num_waiting -= 1  # its deque entry is skipped later
        elif r.state == PREFILL:
            del self._running[req_id]
            del self._prefilling[req_id]
            self._pre_blocks -= r.alloc
        elif r.state == DECODE:
            self._leave_decode(r)
            del self._running[req_id]
        r.state = GONE
        self._update_next()
        return True

    def release_kv(self, req_id: int, now: float) -> bool:
        """Free the KV a finished ``hold_kv`` request holds (its blocks join the
        prefix cache as other finished requests' do); False if it holds none."""
        self._bring_to(now)
        held = self._held.pop(req_id, None)
        if held is None:
            self._update_next()
            return False
        r, n = held
        self._held_blocks -= n
        if r.blocks and self._pc is not None:
            self._cache_done(r)
        if self._num_waiting and not self._crashed:
            if self._seg is None:
                self._compose(now)
            else:
                self._truncate()  # the room may admit a waiting prompt at the next step
        self._update_next()
        return True

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
        dec = self._dec
        self._gen_static += dec.g + dec.n * self._steps
        self._reqs.clear()
        self._waiting.clear()
        self._num_waiting = 0
        self._running.clear()
        self._prefilling.clear()
        self._pre_blocks = 0
        self._held.clear()
        self._held_blocks = 0
        dec.clear()
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
        return self._dec.blocks(self._steps) + self._pre_blocks + self._held_blocks

    @property
    def kv_held_blocks(self) -> int:
        """Blocks of finished prefills held for their decode side (``hold_kv``)."""
        return self._held_blocks

    @property
    def num_held(self) -> int:
        """Finished prefills whose KV is held for their decode side."""
        return len(self._held)

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
        return self._gen_static + self._dec.g + self._dec.n * self._steps

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
        if r.state == DECODE:
            return r.g0 + self._steps - r.s0
        return r.gen

    def tokens_by(self, req_id: int, now: float) -> int:
        """Tokens a held request has generated by ``now`` (not before the engine's
        last event), counting the steps of the decode run under way, without
        advancing the engine (KeyError once it has ended): what a client reading
        the stream has seen."""
        r = self._reqs[req_id]
        if r.state != DECODE:
            return r.gen
        steps, seg = self._steps, self._seg
        if seg is not None and seg.n > 1 and now > self._now:
            steps = max(steps, seg.s0 + seg.steps_done_by(min(now, seg.end)))
        return r.g0 + steps - r.s0

    def step_span(self, now: float) -> tuple[float, float] | None:
        """The step under way at ``now`` as (start, end), a pause counting as one step:
        the requests decoding in it got their last token at its start and get the
        next at its end (None when idle). Without advancing the engine."""
        seg = self._seg
        if seg is None:
            return None
        if seg.n <= 1:
            return seg.t0, seg.end
        k = seg.steps_done_by(now) if now > seg.t0 else 0
        return seg.time_at(k), seg.end if k + 1 >= seg.n else seg.time_at(k + 1)

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


__all__ = ["FAILED", "FINISH", "FIRST_TOKEN", "Engine", "EngineConfig", "Event"]
